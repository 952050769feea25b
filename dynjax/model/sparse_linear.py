"""Block-pruned matmul: ``x @ w`` computing only the blocks a pruning mask keeps (seed 000
§4.2.2, 003 §C; docs/schemes/pruning.md "The block-pruned matmul" has the design and where
the time goes).

``w`` stays stored dense (``[in, out]``, pruned entries exactly zero). Its output block-columns
(blocks of ``bs x bs``) are split into *groups*, each with its own static width ``K``: a group
is ``(cols, rows)``, ``cols`` (``[n]``) the block-columns it holds and ``rows`` (``[n, K]``) each
one's present block-rows, ascending, padded with the sentinel ``in // bs``. Both are runtime
``int32`` arrays (a new mask with the same group shapes reuses the compiled step); only the
widths ``((K, n), ...)`` are in the Plan. Columns sorted by their present blocks fall into a few
groups (`group_widths`), so the work follows the kept blocks: at 10% overall density a matrix's
busiest column can keep a third of its block-rows, and one width for all columns (the
busiest's) computed three times the blocks it keeps. The product is ``x @ (w * mask)``: absent
blocks count as zero and get a zero gradient; forward and backward cost ``sum(n * K) / (C * R)``
of the dense FLOPs.

``block_pruned_matmul`` has two paths: ``"xla"`` (any backend, the default off GPU: per
block-column products in the transposed activation layout, a custom VJP, one unrolled loop per
group; XLA's ``cost_analysis`` counts a loop body once, so compare FLOPs with ``loop=False``) and
``"pallas"`` (the default on GPU: ``pallas_kernels.block_sparse_matmul`` on the ``sum(n * K)``
indexed blocks). Element-granularity pruning does not use this: it multiplies densely with its
masks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import BlockSparseMatrix, block_sparse_matmul

Impl = Literal["auto", "xla", "pallas"]
# The static shape of a block-sparse matmul: (K, number of block-columns) per group.
Widths = tuple[tuple[int, int], ...]
# Its runtime tables: (cols [n], rows [n, K]) int32 per group.
Groups = tuple[tuple[jax.Array, jax.Array], ...]

# How far the XLA path unrolls its loop over block-columns. Inside a loop XLA:CPU runs each gather
# and update single-threaded; with several columns in one body its thunk executor overlaps one
# column's gather and update with another's dot. But each unrolled step holds its own gathered
# slabs, and past a few MiB of them the overlap loses to cache misses. Measured at
# benchmarks/sparse_matmul.py's shapes (jax 0.10.2, 2 cores; unroll 1/2/4/8 per row): 512 KiB of
# slabs per step ran best at 8, 1 MiB at 4-8, 2 MiB at 2-4, 4 MiB at 1-2.
_UNROLL_MAX = 8
_UNROLL_BYTES = 8 << 20


def _unroll(n_steps: int, slab_bytes: int) -> int:
    """Loop bodies to unroll: up to ``_UNROLL_BYTES`` of gathered slabs in flight, at most 8 and
    a quarter of the steps."""
    return max(1, min(_UNROLL_MAX, n_steps // 4, _UNROLL_BYTES // max(slab_bytes, 1)))


def bucket_blocks(count: int, n_rows: int) -> int:
    """A coarse static width for ``count`` blocks out of ``n_rows`` (sparse attention's budgets).

    With ``step = ceil(n_rows / 8)``: powers of two below ``step``, then multiples of ``step``
    (capped at ``n_rows``). Padding then costs less than 1/8 of the dense FLOPs and less than the
    exact count itself, and a count falling from ``n_rows`` to 0 crosses at most
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


def group_widths(counts: Sequence[int], max_groups: int) -> Widths:
    """The widths that cover block-columns of ``counts`` present blocks with the fewest blocks.

    Columns sorted by count (descending) are cut into at most ``max_groups`` runs of nonzero
    count, each as wide as its first column, plus one group of width 0 for the empty columns
    (free: it computes nothing). The cut minimises ``sum(n * K)`` (dynamic programming over the
    sorted counts). More groups pad less but compile one more loop each.

    Example:
      >>> group_widths([1, 6, 0, 2, 2, 1], max_groups=2)
      ((6, 1), (2, 4), (0, 1))
    """
    if max_groups < 1:
        raise ValueError(f"max_groups must be at least 1, got {max_groups}")
    c = np.sort(np.asarray(counts, np.int64))[::-1]
    if c.size and c[-1] < 0:
        raise ValueError(f"counts must be non-negative, got {c[-1]}")
    z = int(np.count_nonzero(c))
    groups = min(max_groups, z)
    # best[g][j]: the fewest blocks covering columns [0, j) with g groups; cut[g][j] its last
    # group's start. cost[i, j]: best[g - 1][i] plus a group of columns [i, j) as wide as c[i].
    never = np.iinfo(np.int64).max // 4  # no such cut (twice it still fits in int64)
    best = np.full((groups + 1, z + 1), never)
    cut = np.zeros((groups + 1, z + 1), np.int64)
    best[0, 0] = 0
    start, stop = np.arange(z)[:, None], np.arange(z + 1)[None, :]
    width = np.where(start < stop, (stop - start) * c[:z, None], never)
    for g in range(1, groups + 1):
        cost = np.minimum(best[g - 1, :z, None] + width, never)
        cut[g] = np.argmin(cost, axis=0)
        best[g, 1:] = cost[cut[g, 1:], np.arange(1, z + 1)]
    g = int(np.argmin(best[1:, z])) + 1 if z else 0
    out, j = [], z
    while g:
        i = int(cut[g, j])
        out.append((int(c[i]), j - i))
        j, g = i, g - 1
    out.reverse()
    if c.size > z:
        out.append((0, int(c.size - z)))
    return tuple(out)


def group_blocks(widths: Widths) -> int:
    """The blocks a matmul of ``widths`` computes per block-row of output: ``sum(n * K)``."""
    return sum(k * n for k, n in widths)


def column_groups(block_mask: np.ndarray, widths: Widths | None = None) -> Groups:
    """The runtime tables of a host bool ``[in//bs, out//bs]`` block mask, as `present_groups`
    derives them on device: columns by present count, descending (ties by position), cut into
    ``widths`` (default: one group as wide as the busiest column).

    Example:
      >>> [(c.tolist(), r.tolist()) for c, r in column_groups(np.array([[1, 0], [1, 1]], bool))]
      [([0, 1], [[0, 1], [1, 2]])]
    """
    mask = np.asarray(block_mask, dtype=bool)
    if mask.ndim != 2:
        raise ValueError(f"block_mask must be 2-D [in//bs, out//bs], got shape {mask.shape}")
    n_rows, n_cols = mask.shape
    counts = mask.sum(axis=0)
    if widths is None:
        widths = ((int(counts.max(initial=0)), n_cols),)
    _check_widths(widths, n_cols)
    order = np.argsort(-counts, kind="stable")
    out, start = [], 0
    for k, n in widths:
        cols = order[start : start + n]
        start += n
        if n and counts[cols].max() > k:
            raise ValueError(f"a column has {counts[cols].max()} present blocks, more than k={k}")
        rows = np.argsort(~mask[:, cols], axis=0, kind="stable")[:k].T  # present rows first
        rows = np.where(np.arange(k) < counts[cols][:, None], rows, n_rows)
        out.append((jnp.asarray(cols, jnp.int32), jnp.asarray(rows.reshape(n, k), jnp.int32)))
    return tuple(out)


def column_block_index(block_mask: np.ndarray, k: int | None = None) -> np.ndarray:
    """The ``[out//bs, K]`` int32 index of one group holding every block-column in order.

    Row ``j`` holds the present block-rows of block-column ``j`` in ascending order, then the
    sentinel ``in // bs``. ``k`` defaults to `bucket_blocks` of the busiest column.

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


def _check_widths(widths: Widths, n_cols: int) -> None:
    if any(k < 0 or n < 0 for k, n in widths) or sum(n for _, n in widths) != n_cols:
        raise ValueError(
            f"widths {widths} must be (K >= 0, columns >= 0) pairs whose columns sum to {n_cols}"
        )


def block_mask_of(groups: Groups | jax.Array, n_rows: int, n_cols: int | None = None) -> jax.Array:
    """The bool ``[n_rows, out//bs]`` block mask that groups (or one index) describe."""
    groups = _as_groups(groups)
    n_cols = sum(c.shape[0] for c, _ in groups) if n_cols is None else n_cols
    mask = jnp.zeros((n_rows + 1, n_cols), bool)
    for cols, rows in groups:
        mask = mask.at[rows, cols[:, None]].set(True)
    return mask[:n_rows]


def _as_groups(index: Groups | jax.Array) -> Groups:
    """One ``[C, K]`` index as a group of every column in order; groups as they are."""
    if isinstance(index, jax.Array | np.ndarray):
        index = jnp.asarray(index)
        return ((jnp.arange(index.shape[0], dtype=jnp.int32), index),)
    return tuple((jnp.asarray(c), jnp.asarray(r)) for c, r in index)


def _blocks(w: jax.Array, cols: jax.Array, rows: jax.Array, bs: int) -> jax.Array:
    """``[n, K, bs, bs]``: block ``(rows[j, t], cols[j])`` of ``w``; zeros for sentinels."""
    n_rows, n_cols = w.shape[0] // bs, w.shape[1] // bs
    tiles = w.reshape(n_rows, bs, n_cols, bs)
    return tiles.at[rows, :, cols[:, None], :].get(mode="fill", fill_value=0)


def _dot(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _gather_slabs(xT: jax.Array, rows: jax.Array, g: int, k: int, bs: int) -> jax.Array:
    """``[g, k*bs, M]``: the activation slabs of ``rows`` (``[g*k]``), sentinels clamped."""
    return jnp.take(xT, rows, axis=0, mode="clip").reshape(g, k * bs, xT.shape[-1])


def _steps(cols: jax.Array, rows: jax.Array, g: int) -> tuple[jax.Array, jax.Array]:
    """A group's tables by loop step: ``[n//g, g]`` columns and ``[n//g, g*K]`` rows."""
    n, k = rows.shape
    return cols.reshape(n // g, g), rows.reshape(n // g, g * k)


def _read_columns(a: jax.Array, cols: jax.Array, bs: int) -> jax.Array:
    """``[g, bs, M]``: block-columns ``cols`` (``[g]``) of ``a`` (``[M, C*bs]``), transposed."""
    m = a.shape[0]
    if cols.shape[0] == 1:  # a contiguous slice: the loop's case
        return lax.dynamic_slice_in_dim(a, cols[0] * bs, bs, axis=1).T.reshape(1, bs, m)
    return jnp.take(a.reshape(m, -1, bs), cols, axis=1).transpose(1, 2, 0)


def _write_columns(y: jax.Array, y_t: jax.Array, cols: jax.Array, bs: int) -> jax.Array:
    """``y`` with block-columns ``cols`` replaced by ``y_t`` (``[g, bs, M]``, transposed)."""
    m, g = y.shape[0], cols.shape[0]
    # The product stays in its own [g, bs, M] layout and is transposed in the update: with
    # ``(w_t @ xs).T`` XLA folded the transpose into the dot, which then ran 3x slower.
    if g == 1:
        return lax.dynamic_update_slice(y, y_t.transpose(2, 0, 1).reshape(m, bs), (0, cols[0] * bs))
    return y.reshape(m, -1, bs).at[:, cols].set(y_t.transpose(2, 0, 1)).reshape(m, -1)


def _xla_forward(xT: jax.Array, blocks: Sequence[jax.Array], groups: Groups, n_cols: int,
                 bs: int, batched: bool, dtype: jnp.dtype) -> jax.Array:
    """``y = x @ w_masked`` from ``xT`` (``[R, bs, M]``) and each group's indexed blocks."""
    m = xT.shape[-1]
    y = jnp.zeros((m, n_cols * bs), dtype)
    for (cols, rows), group in zip(groups, blocks, strict=True):
        (n, k), g = rows.shape, rows.shape[0] if batched else 1
        if k == 0 or n == 0:
            continue
        blocks_t = group.transpose(0, 3, 1, 2).reshape(n // g, g, bs, k * bs)  # [.., out, in]
        step_cols, step_rows = _steps(cols, rows, g)

        def step(s, y, blocks_t=blocks_t, step_cols=step_cols, step_rows=step_rows, g=g, k=k):
            y_t = _dot("gck,gkm->gcm", blocks_t[s], _gather_slabs(xT, step_rows[s], g, k, bs))
            return _write_columns(y, y_t.astype(dtype), step_cols[s], bs)

        unroll = _unroll(n // g, g * k * bs * m * xT.dtype.itemsize)
        y = lax.fori_loop(0, n // g, step, y, unroll=unroll)
    return y


def _xla_backward(xT: jax.Array, blocks: Sequence[jax.Array], groups: Groups, dy: jax.Array,
                  bs: int, batched: bool) -> tuple[jax.Array, list[jax.Array]]:
    """``(dx^T [R, bs, M], each group's dw blocks [n, K, bs, bs])`` in fp32, one loop a group."""
    n_rows, _, m = xT.shape
    dxT, dblocks = jnp.zeros((n_rows, bs, m), jnp.float32), []
    for (cols, rows), group in zip(groups, blocks, strict=True):
        (n, k), g = rows.shape, rows.shape[0] if batched else 1
        if k == 0 or n == 0:
            dblocks.append(jnp.zeros((n, k, bs, bs), jnp.float32))
            continue
        blocks_g = group.reshape(n // g, g, k * bs, bs)
        step_cols, step_rows = _steps(cols, rows, g)

        def step(s, carry, blocks_g=blocks_g, step_cols=step_cols, step_rows=step_rows, g=g, k=k):
            dxT, db_all = carry
            dy_t = _read_columns(dy, step_cols[s], bs)
            xs = _gather_slabs(xT, step_rows[s], g, k, bs)
            db = _dot("gkm,gcm->gkc", xs, dy_t).reshape(1, g, k, bs, bs)
            dx_part = _dot("gkc,gcm->gkm", blocks_g[s], dy_t).reshape(g * k, bs, m)
            dxT = dxT.at[step_rows[s]].add(dx_part, mode="drop")  # sums over columns: keep fp32
            return dxT, lax.dynamic_update_slice(db_all, db, (s, 0, 0, 0, 0))

        init = (dxT, jnp.zeros((n // g, g, k, bs, bs), jnp.float32))
        unroll = _unroll(n // g, g * k * bs * m * xT.dtype.itemsize)
        dxT, db_all = lax.fori_loop(0, n // g, step, init, unroll=unroll)
        dblocks.append(db_all.reshape(n, k, bs, bs))
    return dxT, dblocks


def _transpose_blocks(x: jax.Array, bs: int) -> jax.Array:
    """``[M, in] -> [in//bs, bs, M]``."""
    return x.T.reshape(x.shape[1] // bs, bs, x.shape[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _xla_matmul(x: jax.Array, w: jax.Array, groups: Groups, bs: int, batched: bool) -> jax.Array:
    return _xla_matmul_fwd(x, w, groups, bs, batched)[0]


def _xla_matmul_fwd(x, w, groups, bs, batched):
    xT = _transpose_blocks(x, bs)
    blocks = [_blocks(w, cols, rows, bs) for cols, rows in groups]
    y = _xla_forward(xT, blocks, groups, w.shape[1] // bs, bs, batched, x.dtype)
    return y, (xT, blocks, groups)


def _xla_matmul_bwd(bs, batched, residuals, dy):
    xT, blocks, groups = residuals
    n_rows, _, m = xT.shape
    dxT, dblocks = _xla_backward(xT, blocks, groups, dy, bs, batched)
    dx = dxT.reshape(n_rows * bs, m).T.astype(xT.dtype)
    dtype = blocks[0].dtype
    dw = _scatter_blocks([d.astype(dtype) for d in dblocks], groups, n_rows, dy.shape[1] // bs)
    zeros = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), groups)
    return dx, dw, zeros


def _scatter_blocks(blocks: Sequence[jax.Array], groups: Groups, n_rows: int,
                    n_cols: int) -> jax.Array:
    """The dense ``[n_rows*bs, C*bs]`` matrix holding each group's ``blocks[j, t]``
    (``[n, K, bs, bs]``) at block ``(rows[j, t], cols[j])`` and zeros elsewhere (sentinel slots
    dropped).

    Written as one gather pass over the output: a small ``[R, C]`` table gives each block's slot
    in the groups' blocks laid end to end (the last, a zero block, where absent). A zero fill
    followed by a scatter-add wrote it twice. Rows within a column are unique (as
    `column_groups` and `present_groups` make them).
    """
    bs = blocks[0].shape[-1]
    flat = [b.reshape(-1, bs, bs) for b in blocks]
    total = sum(f.shape[0] for f in flat)
    slot = jnp.full((n_rows + 1, n_cols), total, jnp.int32)
    offset = 0
    for (cols, rows), f in zip(groups, flat, strict=True):
        ids = offset + jnp.arange(f.shape[0], dtype=jnp.int32).reshape(rows.shape)
        slot = slot.at[rows, cols[:, None]].set(ids)
        offset += f.shape[0]
    padded = jnp.concatenate([*flat, jnp.zeros((1, bs, bs), flat[0].dtype)])
    tiles = padded[slot[:n_rows]]  # [R, C, bs, bs]
    return tiles.transpose(0, 2, 1, 3).reshape(n_rows * bs, n_cols * bs)


_xla_matmul.defvjp(_xla_matmul_fwd, _xla_matmul_bwd)


def _pallas_matmul(x: jax.Array, w: jax.Array, groups: Groups, bs: int,
                   interpret: bool | None) -> jax.Array:
    n_rows = w.shape[0] // bs
    matrix = BlockSparseMatrix(
        blocks=jnp.concatenate([_blocks(w, c, r, bs).reshape(-1, bs, bs) for c, r in groups]),
        # padding: a zero block on a valid row
        rows=jnp.concatenate([jnp.minimum(r, n_rows - 1).reshape(-1) for _, r in groups]),
        cols=jnp.concatenate([jnp.repeat(c, r.shape[1]) for c, r in groups]),
        shape=w.shape,
        block_size=(bs, bs),
    )
    return block_sparse_matmul(x, matrix, interpret=interpret)


def block_pruned_matmul(
    x: jax.Array,
    w: jax.Array,
    index: Groups | jax.Array,
    *,
    block_size: int,
    impl: Impl = "auto",
    interpret: bool | None = None,
    loop: bool = True,
) -> jax.Array:
    """``x @ (w * block_mask_of(index))`` at ``sum(n * K) / (C * in // bs)`` of the dense cost.

    ``x`` is ``[..., in]``, ``w`` the dense ``[in, out]`` weight, ``index`` the groups of
    `column_groups` (``(cols [n], rows [n, K])`` int32 pairs covering each block-column once) or
    one ``[out//bs, K]`` table of `column_block_index` (runtime data; the group shapes and
    ``block_size`` are static). Differentiable in ``x`` and ``w``; ``w``'s gradient is zero
    outside the present blocks. ``impl``: ``"auto"`` takes Pallas on GPU and XLA elsewhere;
    ``interpret`` is passed to the Pallas kernels (``None``: compile on GPU). ``loop=False``
    runs the XLA path as one batched step per group (slow, ``K`` times the output in
    temporaries; for ``cost_analysis``, which counts a loop body once). Accumulates in fp32.

    Example:
      >>> mask = np.array([[True, False], [False, True]])  # block-diagonal, blocks of 2
      >>> w = jnp.arange(16.0).reshape(4, 4)
      >>> y = block_pruned_matmul(jnp.ones((1, 4)), w, column_groups(mask), block_size=2)
      >>> bool(jnp.allclose(y, jnp.ones((1, 4)) @ (w * jnp.kron(mask, jnp.ones((2, 2))))))
      True
    """
    bs = block_size
    d_in, d_out = w.shape
    if bs < 1 or d_in % bs or d_out % bs:
        raise ValueError(f"w of shape {w.shape} is not divisible into {bs}x{bs} blocks")
    groups = tuple((c.astype(jnp.int32), r.astype(jnp.int32)) for c, r in _as_groups(index))
    covered = sum(c.shape[0] for c, _ in groups)
    if (x.shape[-1] != d_in or covered != d_out // bs
            or any(r.ndim != 2 or c.shape != r.shape[:1] for c, r in groups)):
        raise ValueError(f"x {x.shape}, w {w.shape} and index shapes "
                         f"{[(c.shape, r.shape) for c, r in groups]} do not match (the groups "
                         f"must cover the {d_out // bs} block-columns once, [n] and [n, K] each)")
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" else "xla"
    if impl not in ("xla", "pallas"):
        raise ValueError(f"impl must be 'auto', 'xla' or 'pallas', got {impl!r}")
    lead = x.shape[:-1]
    dtype = jnp.result_type(x, w)
    x2 = x.reshape(math.prod(lead), d_in).astype(dtype)
    if not sum(math.prod(r.shape) for _, r in groups) or x2.shape[0] == 0:
        return jnp.zeros((*lead, d_out), dtype)
    if impl == "pallas":
        y = _pallas_matmul(x2, w.astype(dtype), groups, bs, interpret)
    else:
        y = _xla_matmul(x2, w.astype(dtype), groups, bs, not loop)
    return y.reshape(*lead, d_out)
