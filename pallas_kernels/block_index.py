"""Compacted block indices: the lists that let a kernel loop over present blocks only.

A kernel that skips absent blocks must not even load them (000 §4.2.4: hash-based sparse flash
attention gains its speed from the blocks it never touches). Instead of testing a mask inside the
loop, each grid row gets the ascending list of its present column indices and their count, and
loops ``for t in range(count)`` loading block ``index[t]`` by dynamic offset.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def compact_rows(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row of a ``(..., R, C)`` bool mask: present column indices first, and their count.

    Returns ``index`` of shape ``(..., R, C)`` int32 whose first ``count[..., r]`` entries of row
    ``r`` are the True columns in ascending order (the rest are valid but unused indices), and
    ``count`` of shape ``(..., R)`` int32.
    """
    mask = mask.astype(bool)
    index = jnp.argsort(~mask, axis=-1, stable=True).astype(jnp.int32)
    count = jnp.sum(mask, axis=-1, dtype=jnp.int32)
    return index, count


def segments(keys: jax.Array, num_segments: int) -> tuple[jax.Array, jax.Array]:
    """Group entries by an int key (CSR-style): ``order`` sorts them, ``ptr`` bounds each group.

    Entries ``order[ptr[s]:ptr[s + 1]]`` are those with ``keys == s``; ``ptr`` has
    ``num_segments + 1`` entries.
    """
    order = jnp.argsort(keys, stable=True).astype(jnp.int32)
    ptr = jnp.searchsorted(keys[order], jnp.arange(num_segments + 1), side="left")
    return order, ptr.astype(jnp.int32)


def _block_ranges(values: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """``(..., S)`` -> per block of ``block`` consecutive entries its (min, max), each
    ``(..., S // block)``."""
    blocks = values.reshape(*values.shape[:-1], values.shape[-1] // block, block)
    return blocks.min(-1), blocks.max(-1)


def range_blocks(
    q_bucket: jax.Array, q_pos: jax.Array, k_bucket: jax.Array, k_pos: jax.Array, block: int
) -> jax.Array:
    """``(..., n, n)`` bool: whether query block ``i`` and key block ``j`` may hold a pair with the
    same bucket and ``k_pos <= q_pos`` (hash-based attention, 000 §2.4), from per-token ids
    ``(..., S)``: the blocks' bucket ranges overlap and key block ``j``'s first position is not
    after query block ``i``'s last. A superset of the blocks with a pair in any order; on a
    (bucket, position)-sorted sequence it skips nearly every block without one."""
    qb_lo, qb_hi = _block_ranges(q_bucket, block)
    kb_lo, kb_hi = _block_ranges(k_bucket, block)
    _, qp_hi = _block_ranges(q_pos, block)
    kp_lo, _ = _block_ranges(k_pos, block)
    overlap = (kb_lo[..., None, :] <= qb_hi[..., :, None]) & (
        qb_lo[..., :, None] <= kb_hi[..., None, :]
    )
    return overlap & (kp_lo[..., None, :] <= qp_hi[..., :, None])
