"""``BlockSparseMatrix``: a pruned weight stored as its present ``(bk, bn)`` blocks.

Unstructured pruning needs a sparse format and SpMM kernels to turn sparsity into speed (000
§4.2.2, 003 §C); tiles of a block format keep the GPU's matrix units busy where scattered
nonzeros cannot. The number of present blocks fixes the compiled shapes, so a new pruning mask
means a new matrix (and a new compile, as for any other Plan change); the block values are the
trainable leaves.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["blocks", "rows", "cols"],
    meta_fields=["shape", "block_size"],
)
@dataclasses.dataclass(frozen=True, eq=False)  # array fields: no elementwise ==
class BlockSparseMatrix:
    """A ``shape = (in, out)`` matrix holding only its present blocks.

    Block ``t`` covers rows ``rows[t] * bk : (rows[t] + 1) * bk`` and columns
    ``cols[t] * bn : (cols[t] + 1) * bn`` of the dense matrix; all other entries are zero.
    ``rows`` and ``cols`` are integer leaves (a new mask of the same size needs no recompile):
    differentiate ``blocks``, or pass ``allow_int=True`` to ``jax.grad`` over the whole matrix.

    Example:
      >>> w = BlockSparseMatrix.from_dense(np.eye(4, dtype=np.float32), block_size=2)
      >>> w.nnz_blocks, w.density
      (2, 0.5)
      >>> bool((w.to_dense() == np.eye(4)).all())
      True
    """

    blocks: jax.Array  # [nnzb, bk, bn]
    rows: jax.Array  # [nnzb] int32, block-row index along `in`
    cols: jax.Array  # [nnzb] int32, block-column index along `out`
    shape: tuple[int, int]
    block_size: tuple[int, int]

    @classmethod
    def from_dense(
        cls,
        dense: jax.Array | np.ndarray,
        block_size: int | tuple[int, int],
        mask: np.ndarray | None = None,
    ) -> BlockSparseMatrix:
        """Keep the blocks of ``dense`` selected by ``mask`` (default: blocks with a nonzero).

        ``mask`` is a host bool array of shape ``(in // bk, out // bn)``; blocks it keeps are
        stored even when all zero (a pruning mask decides what may train, not the values).
        With a mask, ``dense`` may be traced, so gradients flow from the blocks to ``dense``.
        """
        bk, bn = (block_size, block_size) if isinstance(block_size, int) else block_size
        if jnp.ndim(dense) != 2:
            raise ValueError(f"dense must be 2-D (in, out); got shape {jnp.shape(dense)}")
        k, n = jnp.shape(dense)
        if bk < 1 or bn < 1 or k % bk or n % bn:
            raise ValueError(f"shape {(k, n)} is not divisible into blocks of {(bk, bn)}")
        grid = (k // bk, n // bn)
        tiles = jnp.asarray(dense).reshape(grid[0], bk, grid[1], bn).transpose(0, 2, 1, 3)
        if mask is None:
            mask = np.asarray(tiles).any(axis=(2, 3))
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != grid:
            raise ValueError(f"mask must have shape {grid} (blocks of {bk}x{bn}); got {mask.shape}")
        rows, cols = np.nonzero(mask)
        return cls(
            blocks=tiles[rows, cols],
            rows=jnp.asarray(rows, jnp.int32),
            cols=jnp.asarray(cols, jnp.int32),
            shape=(int(k), int(n)),
            block_size=(bk, bn),
        )

    def to_dense(self) -> jax.Array:
        """The dense ``(in, out)`` matrix (differentiable in ``blocks``)."""
        (k, n), (bk, bn) = self.shape, self.block_size
        tiles = jnp.zeros((k // bk, n // bn, bk, bn), self.blocks.dtype)
        tiles = tiles.at[self.rows, self.cols].add(self.blocks)
        return tiles.transpose(0, 2, 1, 3).reshape(k, n)

    @property
    def grid(self) -> tuple[int, int]:
        """Number of block rows and block columns."""
        return self.shape[0] // self.block_size[0], self.shape[1] // self.block_size[1]

    @property
    def nnz_blocks(self) -> int:
        return self.blocks.shape[0]

    @property
    def density(self) -> float:
        """Fraction of blocks present (static: it fixes the compiled shapes)."""
        return self.nnz_blocks / (self.grid[0] * self.grid[1])

    @property
    def sparsity(self) -> float:
        return 1.0 - self.density
