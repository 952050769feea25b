"""Block-sparse flash attention as Pallas kernels, forward and backward.

Hash-based dynamic sparse attention (000 §2.4, §4.2.4) lets each query block attend to a
data-dependent set of key blocks, so the attention matrix is block sparse and a layer costs in
proportion to its present blocks. These kernels take that block mask, compact it into per-block
index lists (``block_index.compact_rows``) and loop only over the present blocks with a flash-style
online softmax (fp32 statistics and accumulators), so absent key/value blocks are never loaded.

Three kernels share one grid layout, ``(blocks along the sequence, batch * heads)``:

- forward: per query block, the output and the row log-sum-exp (kept for the backward);
- dQ: per query block, the same key-block list, recomputing probabilities from the log-sum-exp;
- dK/dV: per key block, the transposed list of query blocks that attend to it.

Rows with no allowed key return zeros (and get zero gradients). See ``backend`` for the GPU target.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backend, xla
from pallas_kernels.block_index import compact_rows
from pallas_kernels.tiles import NN, NT, TN, block, mm


@dataclasses.dataclass(frozen=True)
class _Config:
    block: int
    causal: bool
    scale: float
    interpret: bool


class _Tables(NamedTuple):
    """Compacted block lists, batch and heads flattened into the leading axis."""

    kv_index: jax.Array  # [BH, n, n] int32: per query block, present key blocks first
    kv_count: jax.Array  # [BH, n] int32
    q_index: jax.Array  # [BH, n, n] int32: per key block, query blocks that attend to it
    q_count: jax.Array  # [BH, n] int32


def _scores(q: jax.Array, k: jax.Array, i: jax.Array, j: jax.Array, cfg: _Config) -> jax.Array:
    """Scaled logits of query block ``i`` against key block ``j``, causal mask inside the block."""
    s = mm(q, k, NT) * cfg.scale
    if cfg.causal:
        rows = i * cfg.block + jnp.arange(cfg.block)
        cols = j * cfg.block + jnp.arange(cfg.block)
        s = jnp.where(rows[:, None] >= cols[None, :], s, -jnp.inf)
    return s


def _fwd_kernel(idx_ref, cnt_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, cfg: _Config):
    i = pl.program_id(0)
    q = q_ref[...]

    def body(t, carry):
        acc, m, denom = carry
        j = idx_ref[t]
        kv = block(j, cfg.block)
        v = v_ref[kv, :]
        s = _scores(q, k_ref[kv, :], i, j, cfg)
        # Every row of a listed block has an allowed key (causal keeps the diagonal), so m_new
        # is finite and exp(-inf - m_new) = 0 starts the running sums cleanly.
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        acc = alpha[:, None] * acc + mm(p.astype(v.dtype), v, NN)
        return acc, m_new, alpha * denom + jnp.sum(p, axis=-1)

    rows, dim = q.shape
    init = (
        jnp.zeros((rows, dim), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, m, denom = lax.fori_loop(0, cnt_ref[0], body, init)
    # A query block with no key block keeps acc = 0: output zeros. Its -inf log-sum-exp is never
    # read, as no backward program visits a block that is not listed.
    denom = jnp.where(denom == 0.0, 1.0, denom)
    o_ref[...] = (acc / denom[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(denom)


def _dq_kernel(
    idx_ref, cnt_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, cfg: _Config
):
    i = pl.program_id(0)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def body(t, dq):
        j = idx_ref[t]
        kv = block(j, cfg.block)
        k = k_ref[kv, :]
        p = jnp.exp(_scores(q, k, i, j, cfg) - lse[:, None])
        ds = p * (mm(do, v_ref[kv, :], NT) - delta[:, None])
        return dq + mm(ds.astype(k.dtype), k, NN)

    dq = lax.fori_loop(0, cnt_ref[0], body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(
    idx_ref, cnt_ref, k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
    *, cfg: _Config,
):
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]

    def body(t, carry):
        dk, dv = carry
        i = idx_ref[t]
        rows = block(i, cfg.block)
        q, do = q_ref[rows, :], do_ref[rows, :]
        p = jnp.exp(_scores(q, k, i, j, cfg) - lse_ref[rows][:, None])
        dv = dv + mm(p.astype(do.dtype), do, TN)
        ds = p * (mm(do, v, NT) - delta_ref[rows][:, None])
        return dk + mm(ds.astype(q.dtype), q, TN), dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, cnt_ref[0], body, (zeros, zeros))
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _specs(cfg: _Config, seq: int, dim: int) -> dict[str, pl.BlockSpec]:
    """Block specs on the ``(block, bh)`` grid: this block's tile, or the whole sequence."""
    b, n = cfg.block, seq // cfg.block
    return {
        "index": pl.BlockSpec((None, None, n), lambda i, h: (h, i, 0)),
        "count": pl.BlockSpec((None, 1), lambda i, h: (h, i)),
        "tile": pl.BlockSpec((None, b, dim), lambda i, h: (h, i, 0)),
        "full": pl.BlockSpec((None, seq, dim), lambda i, h: (h, 0, 0)),
        "row_tile": pl.BlockSpec((None, b), lambda i, h: (h, i)),
        "row_full": pl.BlockSpec((None, seq), lambda i, h: (h, 0)),
    }


def _call(kernel, cfg: _Config, shape: tuple[int, int, int], in_specs, out_specs, out_shape):
    bh, seq, dim = shape
    return pl.pallas_call(
        functools.partial(kernel, cfg=cfg),
        grid=(seq // cfg.block, bh),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=backend.compiler_params(
            cfg.block * max(cfg.block, dim), interpret=cfg.interpret
        ),
        interpret=cfg.interpret,
        name=f"attention{kernel.__name__.removesuffix('_kernel')}",
    )


def _forward(cfg: _Config, q, k, v, tables: _Tables) -> tuple[jax.Array, jax.Array]:
    s = _specs(cfg, q.shape[1], q.shape[2])
    lse_shape = jax.ShapeDtypeStruct(q.shape[:2], jnp.float32)
    return _call(
        _fwd_kernel, cfg, q.shape,
        [s["index"], s["count"], s["tile"], s["full"], s["full"]],
        [s["tile"], s["row_tile"]],
        [jax.ShapeDtypeStruct(q.shape, q.dtype), lse_shape],
    )(tables.kv_index, tables.kv_count, q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg: _Config, q, k, v, tables: _Tables) -> jax.Array:
    return _forward(cfg, q, k, v, tables)[0]


def _attention_fwd(cfg: _Config, q, k, v, tables: _Tables):
    out, lse = _forward(cfg, q, k, v, tables)
    return out, (q, k, v, tables, out, lse)


def _attention_bwd(cfg: _Config, residuals, do):
    q, k, v, tables, out, lse = residuals
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    s = _specs(cfg, q.shape[1], q.shape[2])
    dq = _call(
        _dq_kernel, cfg, q.shape,
        [s["index"], s["count"], s["tile"], s["full"], s["full"], s["tile"], s["row_tile"],
         s["row_tile"]],
        s["tile"],
        jax.ShapeDtypeStruct(q.shape, q.dtype),
    )(tables.kv_index, tables.kv_count, q, k, v, do, lse, delta)
    dk, dv = _call(
        _dkv_kernel, cfg, q.shape,
        [s["index"], s["count"], s["tile"], s["tile"], s["full"], s["full"], s["row_full"],
         s["row_full"]],
        [s["tile"], s["tile"]],
        [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
    )(tables.q_index, tables.q_count, k, v, q, do, lse, delta)
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _block_sparse_attention(q, k, v, block_mask, cfg: _Config) -> jax.Array:
    batch, heads, seq, dim = q.shape
    n = seq // cfg.block
    mask = jnp.broadcast_to(block_mask.astype(bool), (batch, heads, n, n))
    if cfg.causal:  # blocks above the diagonal hold no allowed key: drop them from the lists
        mask = mask & jnp.tril(jnp.ones((n, n), bool))
    mask = mask.reshape(batch * heads, n, n)
    kv_index, kv_count = compact_rows(mask)
    q_index, q_count = compact_rows(mask.swapaxes(-1, -2))
    flat = lambda x: x.reshape(batch * heads, seq, dim)
    out = _attention(
        cfg, flat(q), flat(k), flat(v), _Tables(kv_index, kv_count, q_index, q_count)
    )
    return out.reshape(q.shape)


def block_sparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block_mask: jax.Array,
    *,
    block_size: int = 128,
    causal: bool = True,
    sm_scale: float | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Softmax attention restricted to the key blocks each query block may see.

    Args:
      q, k, v: ``(batch, heads, seq, head_dim)``, float32 or bfloat16 (fp32 accumulation).
      block_mask: bool, ``(batch, heads, seq // block_size, seq // block_size)`` or broadcastable
        to it; ``block_mask[b, h, i, j]`` lets query block ``i`` attend key block ``j``. It may be
        a traced array (e.g. from hashing, 000 §2.4): the block lists are built on device.
      block_size: tile size along the sequence, for queries and keys alike.
      causal: also mask keys after the query inside each block (blocks above the diagonal are
        dropped).
      sm_scale: logit scale, default ``1 / sqrt(head_dim)``.
      interpret: run the Pallas interpreter; ``None`` interprets off GPU and compiles on GPU
        (``backend.route``).

    Returns:
      ``(batch, heads, seq, head_dim)`` in the input dtype; rows with no allowed key are zeros.

    Example:
      >>> q = k = v = jnp.ones((1, 1, 32, 8))
      >>> mask = jnp.eye(2, dtype=bool)[None, None]  # each block sees only itself
      >>> block_sparse_attention(q, k, v, mask, block_size=16).shape
      (1, 1, 32, 8)
    """
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            "q, k, v must share one shape (batch, heads, seq, head_dim); got "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q, k, v must share one float dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    batch, heads, seq, dim = q.shape
    how = backend.route(interpret)
    backend.check_tile("block_size", block_size, interpret=how != "triton")
    backend.check_tile("head_dim", dim, interpret=how != "triton")
    if seq % block_size:
        raise ValueError(
            f"sequence length {seq} is not a multiple of block_size {block_size}; "
            "pad the sequence or pick a block size that divides it"
        )
    n = seq // block_size
    block_mask = jnp.asarray(block_mask)
    try:
        jnp.broadcast_shapes(block_mask.shape, (batch, heads, n, n))
    except ValueError:
        raise ValueError(
            f"block_mask of shape {block_mask.shape} does not broadcast to "
            f"(batch, heads, seq // block_size, seq // block_size) = {(batch, heads, n, n)}"
        ) from None
    scale = 1.0 / math.sqrt(dim) if sm_scale is None else float(sm_scale)
    if how == "xla":
        return xla.masked_attention(
            q, k, v, block_mask, block_size=block_size, causal=causal, scale=scale
        )
    cfg = _Config(block=block_size, causal=causal, scale=scale, interpret=how == "interpret")
    return _block_sparse_attention(q, k, v, block_mask, cfg)
