"""Block-pruned matmul: ``x @ w`` computing only the blocks a pruning mask keeps (seed 000
§4.2.2, 003 §C; docs/schemes/pruning.md "The block-pruned matmul" has the design and where
the time goes).

``w`` stays stored dense (``[in, out]``, pruned entries exactly zero). For each output
block-column ``j`` (blocks of ``bs x bs``), ``index[j, :]`` lists the present block-rows,
ascending, padded with the sentinel ``in // bs`` to a static width ``K``. ``index`` is a runtime
``int32`` array (a new mask with the same ``K`` reuses the compiled step); only ``K`` is in the
Plan, rounded up by ``bucket_blocks`` so that pruning recompiles rarely. The product is
``x @ (w * block_mask(index))``: absent blocks count as zero and get a zero gradient; forward
and backward cost ``K / (in // bs)`` of the dense FLOPs.

``block_pruned_matmul`` has two paths: ``"xla"`` (any backend, the default off GPU: per
block-column products in the transposed activation layout, a custom VJP, unrolled; XLA's
``cost_analysis`` counts a loop body once, so compare FLOPs with ``loop=False``) and
``"pallas"`` (the default on GPU: ``pallas_kernels.block_sparse_matmul`` on the ``C*K``
indexed blocks). Element-granularity pruning does not use this: it multiplies densely with its
masks.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import BlockSparseMatrix, block_sparse_matmul

Impl = Literal["auto", "xla", "pallas"]

# How far the XLA path unrolls its loop over column groups. Inside a loop XLA:CPU runs each gather
# and update single-threaded; with several groups in one body its thunk executor overlaps one
# group's gather and update with another's dot. But each unrolled group holds its own gathered
# slabs, and past a few MiB of them the overlap loses to cache misses. Measured at
# benchmarks/sparse_matmul.py's shapes (jax 0.10.2, 2 cores; unroll 1/2/4/8 per row): 512 KiB of
# slabs per group ran best at 8, 1 MiB at 4-8, 2 MiB at 2-4, 4 MiB at 1-2.
_UNROLL_MAX = 8
_UNROLL_BYTES = 8 << 20


def _unroll(n_steps: int, slab_bytes: int) -> int:
    """Loop bodies to unroll: up to ``_UNROLL_BYTES`` of gathered slabs in flight, at most 8."""
    return max(1, min(_UNROLL_MAX, n_steps, _UNROLL_BYTES // max(slab_bytes, 1)))


def bucket_blocks(count: int, n_rows: int) -> int:
    """Static width ``K`` for a busiest column of ``count`` present blocks out of ``n_rows``.

    With ``step = ceil(n_rows / 8)``: powers of two below ``step``, then multiples of ``step``
    (capped at ``n_rows``). Padding then costs less than 1/8 of the dense FLOPs and less than the
    exact count itself, and a density falling from 1 to 0 crosses at most
    ``9 + ceil(log2(step))`` buckets, each one recompile.

    Example:
      >>> [bucket_blocks(c, 32) for c in (0, 1, 3, 4, 5, 9, 32)]
      [0, 1, 4, 4, 8, 12, 32]
    """
    if not 0 <= count <= n_rows:
        raise ValueError(f"count must be in [0, {n_rows}], got {count}")
    step = -(-n_rows // 8)
    if count <= step:
        return 0 if count == 0 else min(step, 1 << (count - 1).bit_length())
    return min(n_rows, -(-count // step) * step)


def column_block_index(block_mask: np.ndarray, k: int | None = None) -> np.ndarray:
    """The ``[out//bs, K]`` int32 index of a host bool ``[in//bs, out//bs]`` block mask.

    Row ``j`` holds the present block-rows of block-column ``j`` in ascending order, then the
    sentinel ``in // bs``. ``k`` defaults to ``bucket_blocks`` of the busiest column.

    Example:
      >>> column_block_index(np.array([[True, False], [True, True]]), k=2).tolist()
      [[0, 1], [1, 2]]
    """
    mask = np.asarray(block_mask, dtype=bool)
    if mask.ndim != 2:
        raise ValueError(f"block_mask must be 2-D [in//bs, out//bs], got shape {mask.shape}")
    n_rows = mask.shape[0]
    counts = mask.sum(axis=0)
    busiest = int(counts.max(initial=0))
    k = bucket_blocks(busiest, n_rows) if k is None else k
    if busiest > k:
        raise ValueError(f"a column has {busiest} present blocks, more than k={k}")
    rows = np.argsort(~mask, axis=0, kind="stable")[:k].T  # present rows first, ascending
    return np.where(np.arange(k) < counts[:, None], rows, n_rows).astype(np.int32)


def block_mask_of(index: jax.Array, n_rows: int) -> jax.Array:
    """The bool ``[n_rows, out//bs]`` block mask an index describes (sentinels dropped)."""
    n_cols = index.shape[0]
    mask = jnp.zeros((n_rows + 1, n_cols), bool)
    return mask.at[index, jnp.arange(n_cols)[:, None]].set(True)[:n_rows]


def _blocks(w: jax.Array, index: jax.Array, bs: int) -> jax.Array:
    """``[C, K, bs, bs]``: block ``(index[j, t], j)`` of ``w``; zeros for sentinels."""
    n_rows, n_cols = w.shape[0] // bs, w.shape[1] // bs
    tiles = w.reshape(n_rows, bs, n_cols, bs)
    return tiles.at[index, :, jnp.arange(n_cols)[:, None], :].get(mode="fill", fill_value=0)


def _dot(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _gather_slabs(xT: jax.Array, rows: jax.Array, g: int, k: int, bs: int) -> jax.Array:
    """``[g, k*bs, M]``: the activation slabs of ``rows`` (``[g*k]``), sentinels clamped."""
    return jnp.take(xT, rows, axis=0, mode="clip").reshape(g, k * bs, xT.shape[-1])


def _xla_forward(xT: jax.Array, blocks: jax.Array, index: jax.Array, bs: int, g: int,
                 dtype: jnp.dtype) -> jax.Array:
    """``y = x @ w_masked`` from ``xT`` (``[R, bs, M]``) and the indexed blocks."""
    n_cols, k = index.shape
    m = xT.shape[-1]
    blocks_t = blocks.transpose(0, 3, 1, 2).reshape(n_cols // g, g, bs, k * bs)  # [.., out, in]
    rows = index.reshape(n_cols // g, g * k)

    def step(s, y):
        # Keep the product in its own [g, bs, M] layout and transpose in the update: with
        # ``(w_t @ xs).T`` XLA folded the transpose into the dot, which then ran 3x slower.
        y_t = _dot("gck,gkm->gcm", blocks_t[s], _gather_slabs(xT, rows[s], g, k, bs))
        return lax.dynamic_update_slice(y, y_t.transpose(2, 0, 1).reshape(m, g * bs).astype(dtype),
                                        (0, s * g * bs))

    unroll = _unroll(n_cols // g, g * k * bs * m * xT.dtype.itemsize)
    return lax.fori_loop(0, n_cols // g, step, jnp.zeros((m, n_cols * bs), dtype), unroll=unroll)


def _xla_backward(xT: jax.Array, blocks: jax.Array, index: jax.Array, dy: jax.Array, bs: int,
                  g: int) -> tuple[jax.Array, jax.Array]:
    """``(dx^T [R, bs, M], dw blocks [C, K, bs, bs])`` in fp32, one loop over column groups."""
    n_cols, k = index.shape
    n_rows, _, m = xT.shape
    blocks_g = blocks.reshape(n_cols // g, g, k * bs, bs)
    rows = index.reshape(n_cols // g, g * k)

    def step(s, carry):
        dxT, dblocks = carry
        dy_t = lax.dynamic_slice_in_dim(dy, s * g * bs, g * bs, axis=1).T.reshape(g, bs, m)
        xs = _gather_slabs(xT, rows[s], g, k, bs)
        db = _dot("gkm,gcm->gkc", xs, dy_t).reshape(1, g, k, bs, bs)
        dx_part = _dot("gkc,gcm->gkm", blocks_g[s], dy_t).reshape(g * k, bs, m)
        dxT = dxT.at[rows[s]].add(dx_part, mode="drop")  # sums over columns: keep fp32
        dblocks = lax.dynamic_update_slice(dblocks, db, (s, 0, 0, 0, 0))
        return dxT, dblocks

    init = (jnp.zeros((n_rows, bs, m), jnp.float32),
            jnp.zeros((n_cols // g, g, k, bs, bs), jnp.float32))
    unroll = _unroll(n_cols // g, g * k * bs * m * xT.dtype.itemsize)
    dxT, dblocks = lax.fori_loop(0, n_cols // g, step, init, unroll=unroll)
    return dxT, dblocks.reshape(n_cols, k, bs, bs)


def _transpose_blocks(x: jax.Array, bs: int) -> jax.Array:
    """``[M, in] -> [in//bs, bs, M]``."""
    return x.T.reshape(x.shape[1] // bs, bs, x.shape[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _xla_matmul(x: jax.Array, w: jax.Array, index: jax.Array, bs: int, g: int) -> jax.Array:
    return _xla_matmul_fwd(x, w, index, bs, g)[0]


def _xla_matmul_fwd(x, w, index, bs, g):
    xT = _transpose_blocks(x, bs)
    blocks = _blocks(w, index, bs)
    return _xla_forward(xT, blocks, index, bs, g, x.dtype), (xT, blocks, index)


def _xla_matmul_bwd(bs, g, residuals, dy):
    xT, blocks, index = residuals
    n_rows, _, m = xT.shape
    dxT, dblocks = _xla_backward(xT, blocks, index, dy, bs, g)
    dx = dxT.reshape(n_rows * bs, m).T.astype(xT.dtype)
    dw = _scatter_blocks(dblocks.astype(blocks.dtype), index, n_rows)
    return dx, dw, np.zeros(index.shape, jax.dtypes.float0)


def _scatter_blocks(blocks: jax.Array, index: jax.Array, n_rows: int) -> jax.Array:
    """The dense ``[n_rows*bs, C*bs]`` matrix holding ``blocks[j, t]`` (``[C, K, bs, bs]``) at
    block ``(index[j, t], j)`` and zeros elsewhere (sentinel slots dropped).

    Written as one gather pass over the output: a small ``[R, C]`` table gives each block's slot
    (``K``, a zero block, where absent). A zero fill followed by a scatter-add wrote it twice.
    Rows within a column are unique (as ``column_block_index`` makes them).
    """
    n_cols, k, bs, _ = blocks.shape
    slot = jnp.full((n_rows + 1, n_cols), k, jnp.int32)
    slot = slot.at[index, jnp.arange(n_cols)[:, None]].set(jnp.arange(k, dtype=jnp.int32))
    padded = jnp.concatenate([blocks, jnp.zeros((n_cols, 1, bs, bs), blocks.dtype)], axis=1)
    tiles = padded[jnp.arange(n_cols), slot[:n_rows]]  # [R, C, bs, bs]
    return tiles.transpose(0, 2, 1, 3).reshape(n_rows * bs, n_cols * bs)


_xla_matmul.defvjp(_xla_matmul_fwd, _xla_matmul_bwd)


def _pallas_matmul(x: jax.Array, w: jax.Array, index: jax.Array, bs: int,
                   interpret: bool | None) -> jax.Array:
    n_rows = w.shape[0] // bs
    n_cols, k = index.shape
    matrix = BlockSparseMatrix(
        blocks=_blocks(w, index, bs).reshape(n_cols * k, bs, bs),
        rows=jnp.minimum(index, n_rows - 1).reshape(-1),  # padding: a zero block on a valid row
        cols=jnp.repeat(jnp.arange(n_cols, dtype=jnp.int32), k),
        shape=w.shape,
        block_size=(bs, bs),
    )
    return block_sparse_matmul(x, matrix, interpret=interpret)


def block_pruned_matmul(
    x: jax.Array,
    w: jax.Array,
    index: jax.Array,
    *,
    block_size: int,
    impl: Impl = "auto",
    interpret: bool | None = None,
    loop: bool = True,
) -> jax.Array:
    """``x @ (w * block_mask_of(index))`` at ``K / (in // bs)`` of the dense cost.

    ``x`` is ``[..., in]``, ``w`` the dense ``[in, out]`` weight, ``index`` the ``[out//bs, K]``
    int32 table of ``column_block_index`` (runtime data; ``K`` and ``block_size`` are static).
    Differentiable in ``x`` and ``w``; ``w``'s gradient is zero outside the present blocks.
    ``impl``: ``"auto"`` takes Pallas on GPU and XLA elsewhere; ``interpret`` is passed to the
    Pallas kernels (``None``: compile on GPU). ``loop=False`` runs the XLA path as one batched
    step (slow, ``K`` times the output in temporaries; for ``cost_analysis``, which counts a loop
    body once). Accumulates in fp32.

    Example:
      >>> mask = np.array([[True, False], [False, True]])  # block-diagonal, blocks of 2
      >>> index = jnp.asarray(column_block_index(mask))
      >>> w = jnp.arange(16.0).reshape(4, 4)
      >>> y = block_pruned_matmul(jnp.ones((1, 4)), w, index, block_size=2)
      >>> bool(jnp.allclose(y, jnp.ones((1, 4)) @ (w * jnp.kron(mask, jnp.ones((2, 2))))))
      True
    """
    bs = block_size
    (d_in, d_out), (n_cols, k) = w.shape, index.shape
    if bs < 1 or d_in % bs or d_out % bs:
        raise ValueError(f"w of shape {w.shape} is not divisible into {bs}x{bs} blocks")
    if x.shape[-1] != d_in or n_cols != d_out // bs:
        raise ValueError(f"x {x.shape}, w {w.shape} and index {index.shape} do not match "
                         f"(index must be [out // {bs}, K])")
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" else "xla"
    if impl not in ("xla", "pallas"):
        raise ValueError(f"impl must be 'auto', 'xla' or 'pallas', got {impl!r}")
    lead = x.shape[:-1]
    dtype = jnp.result_type(x, w)
    x2 = x.reshape(math.prod(lead), d_in).astype(dtype)
    if k == 0 or x2.shape[0] == 0:
        return jnp.zeros((*lead, d_out), dtype)
    index = index.astype(jnp.int32)
    if impl == "pallas":
        y = _pallas_matmul(x2, w.astype(dtype), index, bs, interpret)
    else:
        y = _xla_matmul(x2, w.astype(dtype), index, bs, 1 if loop else n_cols)
    return y.reshape(*lead, d_out)
