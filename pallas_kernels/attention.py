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

Inside a present block the element mask is one of: none, causal (key position not after the
query's), or *hashed* (``hashed_block_sparse_attention``): each query and key carries its bucket id
and original position, and a query sees a key of its own bucket at a position not after its own.
That is the mask of hash-based sparse attention on the (bucket, position)-sorted sequence
(Pagliardini et al. 2023; 000 §2.4): the block lists come from the blocks' bucket and position
ranges, built on device, and the kernels compare the per-token ids of a loaded block pair.

Rows with no allowed key return zeros (and get zero gradients). See ``backend`` for the GPU target.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backend, xla
from pallas_kernels.block_index import compact_rows, range_blocks
from pallas_kernels.tiles import NN, NT, TN, block, mm

Mask = Literal["none", "causal", "hashed"]


@dataclasses.dataclass(frozen=True)
class _Config:
    block: int
    mask: Mask  # the element mask inside a present block
    scale: float
    interpret: bool


class _Tables(NamedTuple):
    """Compacted block lists, batch and heads flattened into the leading axis."""

    kv_index: jax.Array  # [BH, n, n] int32: per query block, present key blocks first
    kv_count: jax.Array  # [BH, n] int32
    q_index: jax.Array  # [BH, n, n] int32: per key block, query blocks that attend to it
    q_count: jax.Array  # [BH, n] int32


class _Meta(NamedTuple):
    """Per-token ids of the hashed mask, ``[BH, S]`` int32 each, in the sorted order."""

    q_pos: jax.Array
    q_bucket: jax.Array
    k_pos: jax.Array
    k_bucket: jax.Array


def _ids(pos_ref, bucket_ref, rows) -> tuple[jax.Array, jax.Array] | None:
    """The (position, bucket) ids of ``rows`` of a meta ref pair; None without the hashed mask."""
    return None if pos_ref is None else (pos_ref[rows], bucket_ref[rows])


def _scores(q, k, i, j, cfg: _Config, q_ids, k_ids) -> jax.Array:
    """Scaled logits of query block ``i`` against key block ``j``, masked inside the block:
    causal by block offsets, or hashed by the tokens' ``(position, bucket)`` ids."""
    s = mm(q, k, NT) * cfg.scale
    if cfg.mask == "causal":
        rows = i * cfg.block + jnp.arange(cfg.block)
        cols = j * cfg.block + jnp.arange(cfg.block)
        s = jnp.where(rows[:, None] >= cols[None, :], s, -jnp.inf)
    elif cfg.mask == "hashed":
        (qp, qb), (kp, kb) = q_ids, k_ids
        allowed = (qb[:, None] == kb[None, :]) & (kp[None, :] <= qp[:, None])
        s = jnp.where(allowed, s, -jnp.inf)
    return s


def _split(refs: tuple, n_out: int) -> tuple[tuple, tuple]:
    """(the four meta refs, or four Nones without the hashed mask; the ``n_out`` output refs)."""
    meta, outs = refs[:-n_out], refs[-n_out:]
    return (meta if meta else (None,) * 4), outs


def _fwd_kernel(idx_ref, cnt_ref, q_ref, k_ref, v_ref, *refs, cfg: _Config):
    (qp_ref, qb_ref, kp_ref, kb_ref), (o_ref, lse_ref) = _split(refs, 2)
    i = pl.program_id(0)
    q = q_ref[...]
    q_ids = _ids(qp_ref, qb_ref, ...)

    def body(t, carry):
        acc, m, denom = carry
        j = idx_ref[t]
        kv = block(j, cfg.block)
        v = v_ref[kv, :]
        s = _scores(q, k_ref[kv, :], i, j, cfg, q_ids, _ids(kp_ref, kb_ref, kv))
        # A row may have no allowed key yet (the hashed mask: another bucket), so m_new may be
        # -inf: shift by 0 there, which keeps p = exp(-inf) = 0 and alpha = 0 free of NaN.
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - shift[:, None])
        alpha = jnp.exp(m - shift)
        acc = alpha[:, None] * acc + mm(p.astype(v.dtype), v, NN)
        return acc, m_new, alpha * denom + jnp.sum(p, axis=-1)

    rows, dim = q.shape
    init = (
        jnp.zeros((rows, dim), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, m, denom = lax.fori_loop(0, cnt_ref[0], body, init)
    # A row with no allowed key keeps acc = 0: output zeros. Its log-sum-exp is +inf, so the
    # backward's exp(s - lse) is 0 for it in any block it visits.
    empty = denom == 0.0
    o_ref[...] = (acc / jnp.where(empty, 1.0, denom)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, denom)))


def _dq_kernel(
    idx_ref, cnt_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg: _Config
):
    (qp_ref, qb_ref, kp_ref, kb_ref), (dq_ref,) = _split(refs, 1)
    i = pl.program_id(0)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_ids = _ids(qp_ref, qb_ref, ...)

    def body(t, dq):
        j = idx_ref[t]
        kv = block(j, cfg.block)
        k = k_ref[kv, :]
        s = _scores(q, k, i, j, cfg, q_ids, _ids(kp_ref, kb_ref, kv))
        p = jnp.exp(s - lse[:, None])
        ds = p * (mm(do, v_ref[kv, :], NT) - delta[:, None])
        return dq + mm(ds.astype(k.dtype), k, NN)

    dq = lax.fori_loop(0, cnt_ref[0], body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(
    idx_ref, cnt_ref, k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, *refs, cfg: _Config
):
    (qp_ref, qb_ref, kp_ref, kb_ref), (dk_ref, dv_ref) = _split(refs, 2)
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    k_ids = _ids(kp_ref, kb_ref, ...)

    def body(t, carry):
        dk, dv = carry
        i = idx_ref[t]
        rows = block(i, cfg.block)
        q, do = q_ref[rows, :], do_ref[rows, :]
        s = _scores(q, k, i, j, cfg, _ids(qp_ref, qb_ref, rows), k_ids)
        p = jnp.exp(s - lse_ref[rows][:, None])
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


def _meta_specs(s: dict[str, pl.BlockSpec], meta: _Meta | None, q_own: bool) -> list:
    """Specs of the meta refs: the program's own block's ids as a tile, the other side's whole
    sequence (sliced per visited block in the kernel)."""
    if meta is None:
        return []
    q_spec, k_spec = (s["row_tile"], s["row_full"]) if q_own else (s["row_full"], s["row_tile"])
    return [q_spec, q_spec, k_spec, k_spec]


def _forward(cfg: _Config, q, k, v, tables: _Tables, meta: _Meta | None):
    s = _specs(cfg, q.shape[1], q.shape[2])
    lse_shape = jax.ShapeDtypeStruct(q.shape[:2], jnp.float32)
    return _call(
        _fwd_kernel, cfg, q.shape,
        [s["index"], s["count"], s["tile"], s["full"], s["full"], *_meta_specs(s, meta, True)],
        [s["tile"], s["row_tile"]],
        [jax.ShapeDtypeStruct(q.shape, q.dtype), lse_shape],
    )(tables.kv_index, tables.kv_count, q, k, v, *(meta or ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg: _Config, q, k, v, tables: _Tables, meta: _Meta | None) -> jax.Array:
    return _forward(cfg, q, k, v, tables, meta)[0]


def _attention_fwd(cfg: _Config, q, k, v, tables: _Tables, meta: _Meta | None):
    out, lse = _forward(cfg, q, k, v, tables, meta)
    return out, (q, k, v, tables, meta, out, lse)


def _attention_bwd(cfg: _Config, residuals, do):
    q, k, v, tables, meta, out, lse = residuals
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    s = _specs(cfg, q.shape[1], q.shape[2])
    ids = tuple(meta or ())
    dq = _call(
        _dq_kernel, cfg, q.shape,
        [s["index"], s["count"], s["tile"], s["full"], s["full"], s["tile"], s["row_tile"],
         s["row_tile"], *_meta_specs(s, meta, True)],
        s["tile"],
        jax.ShapeDtypeStruct(q.shape, q.dtype),
    )(tables.kv_index, tables.kv_count, q, k, v, do, lse, delta, *ids)
    dk, dv = _call(
        _dkv_kernel, cfg, q.shape,
        [s["index"], s["count"], s["tile"], s["tile"], s["full"], s["full"], s["row_full"],
         s["row_full"], *_meta_specs(s, meta, False)],
        [s["tile"], s["tile"]],
        [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
    )(tables.q_index, tables.q_count, k, v, q, do, lse, delta, *ids)
    return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _tables(mask: jax.Array) -> _Tables:
    """The compacted lists of a ``[BH, n, n]`` block mask, by query block and by key block."""
    kv_index, kv_count = compact_rows(mask)
    q_index, q_count = compact_rows(mask.swapaxes(-1, -2))
    return _Tables(kv_index, kv_count, q_index, q_count)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _block_sparse_attention(q, k, v, block_mask, cfg: _Config) -> jax.Array:
    batch, heads, seq, dim = q.shape
    n = seq // cfg.block
    mask = jnp.broadcast_to(block_mask.astype(bool), (batch, heads, n, n))
    if cfg.mask == "causal":  # blocks above the diagonal hold no allowed key: drop them
        mask = mask & jnp.tril(jnp.ones((n, n), bool))
    flat = lambda x: x.reshape(batch * heads, seq, dim)
    out = _attention(
        cfg, flat(q), flat(k), flat(v), _tables(mask.reshape(batch * heads, n, n)), None
    )
    return out.reshape(q.shape)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _hashed_attention(q, k, v, ids: _Meta, cfg: _Config) -> jax.Array:
    batch, heads, seq, dim = q.shape
    mask = range_blocks(ids.q_bucket, ids.q_pos, ids.k_bucket, ids.k_pos, cfg.block)  # on device
    flat = lambda x: x.reshape(batch * heads, *x.shape[2:])
    meta = _Meta(*(flat(x.astype(jnp.int32)) for x in ids))
    out = _attention(cfg, flat(q), flat(k), flat(v), _tables(flat(mask)), meta)
    return out.reshape(q.shape)


def _check_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            "q, k, v must share one shape (batch, heads, seq, head_dim); got "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q, k, v must share one float dtype; got {q.dtype}, {k.dtype}, {v.dtype}")


def _route(q: jax.Array, block_size: int, interpret: bool | None) -> backend.Route:
    """The backend route, after checking the tile sizes it needs and that blocks tile ``seq``."""
    seq, dim = q.shape[2], q.shape[3]
    how = backend.route(interpret)
    backend.check_tile("block_size", block_size, interpret=how != "triton")
    backend.check_tile("head_dim", dim, interpret=how != "triton")
    if seq % block_size:
        raise ValueError(
            f"sequence length {seq} is not a multiple of block_size {block_size}; "
            "pad the sequence or pick a block size that divides it"
        )
    return how


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
    _check_qkv(q, k, v)
    batch, heads, seq, dim = q.shape
    how = _route(q, block_size, interpret)
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
    cfg = _Config(
        block=block_size, mask="causal" if causal else "none", scale=scale,
        interpret=how == "interpret",
    )
    return _block_sparse_attention(q, k, v, block_mask, cfg)


def hashed_block_sparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    q_buckets: jax.Array,
    k_positions: jax.Array,
    k_buckets: jax.Array,
    *,
    block_size: int = 128,
    sm_scale: float | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Hash-based sparse attention on a (bucket, position)-sorted sequence (000 §2.4).

    Query ``t`` sees key ``u`` iff ``q_buckets[t] == k_buckets[u]`` and
    ``k_positions[u] <= q_positions[t]`` (causal in the original order). The block lists are
    built on device from each block's bucket and position ranges (``block_index.range_blocks``:
    a key block is listed iff its bucket range overlaps the query block's and its first position
    is not after the query block's last); the kernels compute the element mask of a listed block
    from the per-token ids, forward and backward. Queries and keys may be sorted by different
    permutations (each by its own buckets); the ranges assume each side is sorted by (bucket,
    position), else blocks are listed that hold no pair, which costs time but not exactness.

    Args:
      q, k, v: ``(batch, heads, seq, head_dim)``, float32 or bfloat16, in the sorted order.
      q_positions, q_buckets, k_positions, k_buckets: int, ``(batch, heads, seq)``: each sorted
        token's original position and bucket id.
      block_size, sm_scale, interpret: as in ``block_sparse_attention``.

    Returns:
      ``(batch, heads, seq, head_dim)`` in the sorted order; rows with no allowed key are zeros.
    """
    _check_qkv(q, k, v)
    ids = _Meta(q_positions, q_buckets, k_positions, k_buckets)
    names = ("q_positions", "q_buckets", "k_positions", "k_buckets")
    for name, x in zip(names, ids, strict=True):
        if x.shape != q.shape[:3] or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(
                f"{name} must be an int array of shape (batch, heads, seq) = {q.shape[:3]}; "
                f"got {x.dtype} {x.shape}"
            )
    how = _route(q, block_size, interpret)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    if how == "xla":
        return xla.hashed_attention(q, k, v, ids, scale=scale)
    cfg = _Config(block=block_size, mask="hashed", scale=scale, interpret=how == "interpret")
    return _hashed_attention(q, k, v, ids, cfg)
