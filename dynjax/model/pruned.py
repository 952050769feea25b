"""Block-sparse linears inside a block: the record that names them, and the matmul they run.

Block-granularity pruning zeroes whole ``bs x bs`` blocks of a weight (which stays stored dense in
the params, pruned entries exactly zero). Once few blocks remain, a layer's options may name some
of its linears (``"mlp/up"``, ``"attn/qkv"``, ...) with static widths ``((K, n), ...)``: its
block-columns sorted by present blocks (descending) fall into groups of ``n`` columns computing
``K`` blocks each, and the block multiplies them with
`dynjax.model.sparse_linear.block_pruned_matmul` at ``sum(n * K) / (C * in // bs)`` of the dense
cost. The groups' tables are derived here, inside the forward, from the weight's own zero
pattern (`present_groups`): no runtime input carries them. The widths must bound the sorted
counts position by position; pruning only removes blocks, and a column count that falls can only
lower every position of the sorted counts, so widths counted at some step stay valid afterwards.

A record is found among a layer's options by type (`sparse_linears`), so any scheme whose record
is a `SparseLinears` (e.g. pruning's, a subclass) switches the matmuls; the model names none.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from dynjax.model.sparse_linear import Groups, Widths, block_pruned_matmul

# The dense blocks' linears: GPT's in order, then the Llama family's SwiGLU gate.
LINEARS = ("attn/qkv", "attn/out", "mlp/up", "mlp/down", "mlp/gate")


@dataclasses.dataclass(frozen=True)
class SparseLinears:
    """Which linears of a block multiply block-sparsely.

    ``widths``: (linear path inside the block, its `Widths`) pairs; ``block_size``: the blocks'
    side; ``loop``: `block_pruned_matmul`'s loop over block-columns (False: one batched step a
    group, slower, but what ``cost_analysis`` counts in full).
    """

    block_size: int = 0
    widths: tuple[tuple[str, Widths], ...] = ()
    loop: bool = True

    def width(self, path: str) -> Widths | None:
        return dict(self.widths).get(path)


def sparse_linears(options: Any) -> SparseLinears | None:
    """The `SparseLinears` record among a layer's options (``(name, record)`` pairs), if any."""
    return next((r for _, r in options or () if isinstance(r, SparseLinears)), None)


def _present(w: jax.Array, block_size: int) -> jax.Array:
    """``[in // bs, out // bs]`` bool: the blocks of ``w`` holding a nonzero."""
    bs = block_size
    tiles = jax.lax.stop_gradient(w).reshape(w.shape[0] // bs, bs, w.shape[1] // bs, bs)
    return jnp.any(tiles != 0, axis=(1, 3))


def present_groups(w: jax.Array, block_size: int, widths: Widths) -> Groups:
    """The tables of `block_pruned_matmul` for ``w``'s zero pattern, as
    `sparse_linear.column_groups` makes them on the host: block-columns by present blocks,
    descending (ties by position), cut into ``widths``; each column's present block-rows
    ascending, padded with the sentinel ``in // bs`` (``lax.top_k`` over the rows, present rows
    ranked by position)."""
    present = _present(w, block_size)  # [R, C]
    n_rows = present.shape[0]
    order = jnp.argsort(-jnp.sum(present, axis=0), stable=True).astype(jnp.int32)
    score = jnp.where(present, n_rows - jnp.arange(n_rows)[:, None], 0).T  # [C, R]
    out, start = [], 0
    for k, n in widths:
        cols = order[start : start + n]
        start += n
        if k == 0:  # the empty columns' group: no rows to rank
            out.append((cols, jnp.zeros((n, 0), jnp.int32)))
            continue
        vals, rows = jax.lax.top_k(score[cols], k)
        out.append((cols, jnp.where(vals > 0, rows, n_rows).astype(jnp.int32)))
    return tuple(out)


def column_counts(w: jax.Array, block_size: int, size: int) -> jax.Array:
    """``[size]`` int32: the present blocks of each block-column of ``w``, descending, padded
    with -1 (what `sparse_linear.group_widths` cuts)."""
    counts = -jnp.sort(-jnp.sum(_present(w, block_size), axis=0, dtype=jnp.int32))
    return jnp.pad(counts, (0, size - counts.shape[0]), constant_values=-1)


def linear(module: nnx.Linear, x: jax.Array, path: str, sparse: SparseLinears | None):
    """``module(x)``, block-sparse when ``sparse`` gives ``path`` widths; its output named
    ``path`` for a rematerialisation policy that keeps projections (`dynjax.model.remat`)."""
    widths = sparse.width(path) if sparse is not None else None
    if widths is None:
        return checkpoint_name(module(x), path)
    w = module.kernel[...]
    groups = present_groups(w, sparse.block_size, widths)
    y = block_pruned_matmul(x, w, groups, block_size=sparse.block_size, loop=sparse.loop)
    return checkpoint_name(y + module.bias[...] if module.bias is not None else y, path)
