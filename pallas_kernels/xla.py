"""The kernels' computations in plain XLA ops: the GPU route when jax has no Pallas Triton lowering.

Same inputs, outputs and gradients as ``block_sparse_attention`` and ``block_sparse_matmul`` (fp32
accumulation, rows without an allowed key give zeros), but dense: every block is computed and
the absent ones masked (attention) or multiplied as zeros (SpMM), so the cost does not fall with
sparsity. See ``backend.route`` for when it runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.block_sparse_matrix import BlockSparseMatrix


def masked_attention(q, k, v, block_mask, *, block_size: int, causal: bool, scale: float):
    """Softmax attention over the keys ``block_mask`` (``[b, h, n, n]``-broadcastable) allows."""
    batch, heads, seq, _ = q.shape
    n = seq // block_size
    mask = jnp.broadcast_to(jnp.asarray(block_mask, bool), (batch, heads, n, n))
    allowed = jnp.repeat(jnp.repeat(mask, block_size, axis=-2), block_size, axis=-1)
    if causal:
        allowed = allowed & jnp.tril(jnp.ones((seq, seq), bool))
    return _attention(q, k, v, allowed, scale)


def hashed_attention(q, k, v, ids, *, scale: float):
    """Softmax attention over the keys of a query's bucket at positions not after its own
    (``ids``: per-token positions and buckets, ``[b, h, s]`` each, as the kernels take them)."""
    q_pos, q_bucket, k_pos, k_bucket = ids
    allowed = (q_bucket[..., :, None] == k_bucket[..., None, :]) & (
        k_pos[..., None, :] <= q_pos[..., :, None]
    )
    return _attention(q, k, v, allowed, scale)


def _attention(q, k, v, allowed, scale: float):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(allowed, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))  # a row without keys: all zeros
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return (out / jnp.where(denom == 0.0, 1.0, denom)).astype(q.dtype)


def dense_matmul(x: jax.Array, w: BlockSparseMatrix) -> jax.Array:
    """``x @ w`` through ``w.to_dense()`` (gradients reach the present blocks only)."""
    dtype = jnp.result_type(x, w.blocks)
    dense = w.to_dense().astype(dtype)
    return jnp.matmul(x.astype(dtype), dense, preferred_element_type=jnp.float32).astype(dtype)
