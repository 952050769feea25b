"""Block-sparse SpMM ``x @ w`` as Pallas kernels, forward and backward.

Pruned weights only pay off with a sparse kernel that beats the dense one; on an A100 Sputnik's
SpMM overtook cuBLAS from about 75% sparsity while cuSPARSE never did (000 §4.2.2, 003 §C).
These kernels work on ``BlockSparseMatrix`` tiles so every product is a dense tile ``dot``:

- forward ``y = x @ w``: per ``(row tile, block column)``, loop over that column's blocks;
- ``dx = dy @ w.T``: per ``(row tile, block row)``, loop over that row's blocks;
- ``dw``: one program per present block, ``x[:, rows].T @ dy[:, cols]`` over all rows of ``x``
  (absent blocks get no gradient: they do not exist).

Absent blocks are never loaded. See ``backend`` for the GPU target.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backend, xla
from pallas_kernels.block_index import segments
from pallas_kernels.block_sparse_matrix import BlockSparseMatrix
from pallas_kernels.tiles import NN, NT, TN, block, mm


@dataclasses.dataclass(frozen=True)
class _Config:
    bm: int  # rows of x per tile
    bk: int
    bn: int
    interpret: bool


class _Tables(NamedTuple):
    """Block lists grouped by block column (forward) and by block row (dx)."""

    rows: jax.Array  # [nnzb] block row of each block
    cols: jax.Array  # [nnzb] block column of each block
    col_ptr: jax.Array  # [grid_n + 1]: blocks of column j are col_order[col_ptr[j]:col_ptr[j+1]]
    col_order: jax.Array  # [nnzb]
    col_rows: jax.Array  # [nnzb] rows[col_order]
    row_ptr: jax.Array  # [grid_k + 1]
    row_order: jax.Array  # [nnzb]
    row_cols: jax.Array  # [nnzb] cols[row_order]

    @classmethod
    def build(cls, w: BlockSparseMatrix) -> _Tables:
        grid_k, grid_n = w.grid
        col_order, col_ptr = segments(w.cols, grid_n)
        row_order, row_ptr = segments(w.rows, grid_k)
        return cls(w.rows, w.cols, col_ptr, col_order, w.rows[col_order], row_ptr, row_order,
                   w.cols[row_order])


def _fwd_kernel(ptr_ref, blk_ref, row_ref, x_ref, w_ref, y_ref, *, cfg: _Config):
    j = pl.program_id(1)

    def body(t, acc):
        x = x_ref[:, block(row_ref[t], cfg.bk)]
        return acc + mm(x, w_ref[block(blk_ref[t], cfg.bk), :], NN)

    acc = jnp.zeros((cfg.bm, cfg.bn), jnp.float32)
    y_ref[...] = lax.fori_loop(ptr_ref[j], ptr_ref[j + 1], body, acc).astype(y_ref.dtype)


def _dx_kernel(ptr_ref, blk_ref, col_ref, dy_ref, w_ref, dx_ref, *, cfg: _Config):
    r = pl.program_id(1)

    def body(t, acc):
        dy = dy_ref[:, block(col_ref[t], cfg.bn)]
        return acc + mm(dy, w_ref[block(blk_ref[t], cfg.bk), :], NT)

    acc = jnp.zeros((cfg.bm, cfg.bk), jnp.float32)
    dx_ref[...] = lax.fori_loop(ptr_ref[r], ptr_ref[r + 1], body, acc).astype(dx_ref.dtype)


def _dw_kernel(rows_ref, cols_ref, x_ref, dy_ref, dw_ref, *, cfg: _Config):
    b = pl.program_id(0)
    r, c = rows_ref[b], cols_ref[b]

    def body(m, acc):
        tile = block(m, cfg.bm)
        return acc + mm(x_ref[tile, block(r, cfg.bk)], dy_ref[tile, block(c, cfg.bn)], TN)

    acc = jnp.zeros((cfg.bk, cfg.bn), jnp.float32)
    dw_ref[...] = lax.fori_loop(0, x_ref.shape[0] // cfg.bm, body, acc).astype(dw_ref.dtype)


def _whole(shape: tuple[int, ...]) -> pl.BlockSpec:
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _call(kernel, cfg: _Config, grid, in_specs, out_specs, out_shape):
    return pl.pallas_call(
        functools.partial(kernel, cfg=cfg),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=backend.compiler_params(
            cfg.bm * max(cfg.bk, cfg.bn), interpret=cfg.interpret
        ),
        interpret=cfg.interpret,
        name=f"spmm{kernel.__name__.removesuffix('_kernel')}",
    )


def _forward(cfg: _Config, x: jax.Array, blocks: jax.Array, t: _Tables) -> jax.Array:
    (m, k), nnzb, grid_n = x.shape, blocks.shape[0], t.col_ptr.shape[0] - 1
    return _call(
        _fwd_kernel, cfg, (m // cfg.bm, grid_n),
        [_whole(t.col_ptr.shape), _whole((nnzb,)), _whole((nnzb,)),
         pl.BlockSpec((cfg.bm, k), lambda i, j: (i, 0)), _whole((nnzb * cfg.bk, cfg.bn))],
        pl.BlockSpec((cfg.bm, cfg.bn), lambda i, j: (i, j)),
        jax.ShapeDtypeStruct((m, grid_n * cfg.bn), x.dtype),
    )(t.col_ptr, t.col_order, t.col_rows, x, blocks.reshape(nnzb * cfg.bk, cfg.bn))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul(cfg: _Config, x: jax.Array, blocks: jax.Array, tables: _Tables) -> jax.Array:
    return _forward(cfg, x, blocks, tables)


def _matmul_fwd(cfg: _Config, x, blocks, tables):
    return _forward(cfg, x, blocks, tables), (x, blocks, tables)


def _matmul_bwd(cfg: _Config, residuals, dy):
    x, blocks, t = residuals
    (m, k), n, nnzb = x.shape, dy.shape[1], blocks.shape[0]
    grid_k = t.row_ptr.shape[0] - 1
    dx = _call(
        _dx_kernel, cfg, (m // cfg.bm, grid_k),
        [_whole(t.row_ptr.shape), _whole((nnzb,)), _whole((nnzb,)),
         pl.BlockSpec((cfg.bm, n), lambda i, r: (i, 0)), _whole((nnzb * cfg.bk, cfg.bn))],
        pl.BlockSpec((cfg.bm, cfg.bk), lambda i, r: (i, r)),
        jax.ShapeDtypeStruct(x.shape, x.dtype),
    )(t.row_ptr, t.row_order, t.row_cols, dy, blocks.reshape(nnzb * cfg.bk, cfg.bn))
    dw = _call(
        _dw_kernel, cfg, (nnzb,),
        [_whole((nnzb,)), _whole((nnzb,)), _whole((m, k)), _whole((m, n))],
        pl.BlockSpec((None, cfg.bk, cfg.bn), lambda b: (b, 0, 0)),
        jax.ShapeDtypeStruct(blocks.shape, blocks.dtype),
    )(t.rows, t.cols, x, dy)
    return dx, dw, None


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


@functools.partial(jax.jit, static_argnames=("block_m", "interpret"))
def _block_sparse_matmul(x: jax.Array, w: BlockSparseMatrix, block_m: int, interpret: bool):
    k, n = w.shape
    lead, x = x.shape[:-1], x.reshape(-1, k)
    dtype = jnp.result_type(x, w.blocks)
    if w.nnz_blocks == 0:
        return jnp.zeros((*lead, n), dtype)
    m = x.shape[0]
    bm = min(block_m, max(16, pl.next_power_of_2(m)))
    x = jnp.pad(x.astype(dtype), ((0, -m % bm), (0, 0)))
    cfg = _Config(bm=bm, bk=w.block_size[0], bn=w.block_size[1], interpret=interpret)
    y = _matmul(cfg, x, w.blocks.astype(dtype), _Tables.build(w))
    return y[:m].reshape(*lead, n)


def block_sparse_matmul(
    x: jax.Array, w: BlockSparseMatrix, *, block_m: int = 128, interpret: bool | None = None
) -> jax.Array:
    """``x @ w`` for ``x`` of shape ``(..., in)`` and a block-sparse ``w`` of shape ``(in, out)``.

    Differentiable in ``x`` and ``w.blocks`` (gradients only for present blocks). ``block_m``
    is the tile along the rows of ``x`` (rows are zero-padded to a multiple of it); ``interpret``
    as in ``block_sparse_attention``. Accumulates in fp32 and returns the promoted input dtype.

    Example:
      >>> w = BlockSparseMatrix.from_dense(jnp.eye(32), block_size=16)
      >>> block_sparse_matmul(jnp.ones((3, 32)), w).shape
      (3, 32)
    """
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"x of shape {x.shape} cannot multiply a matrix of shape {w.shape}")
    how = backend.route(interpret)
    for name, size in zip(("block_m", "block rows", "block columns"), (block_m, *w.block_size),
                          strict=True):
        backend.check_tile(name, size, interpret=how != "triton")
    if how == "xla":
        return xla.dense_matmul(x, w)
    return _block_sparse_matmul(x, w, block_m, how == "interpret")
