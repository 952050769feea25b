"""``CsrMatrix``: an unstructured pruned weight in compressed sparse row form.

The format DynMo's pruning case uses (000 §4.2.2, 003 §C): CSR, multiplied by a Sputnik-style
SpMM. It is stored as the CSR of ``w.T`` (one row per output feature), so ``x @ w`` reads
contiguous rows of ``x.T`` per nonzero. Only the kernel (``triton_csr``) needs a GPU; this
format is plain JAX and NumPy so it can be built and checked anywhere.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["values", "indices", "indptr"],
    meta_fields=["shape"],
)
@dataclasses.dataclass(frozen=True, eq=False)  # array fields: no elementwise ==
class CsrMatrix:
    """A ``shape = (in, out)`` matrix ``w`` stored as the CSR of ``w.T``.

    Nonzeros ``indptr[j]:indptr[j + 1]`` are those of output column ``j``: ``values`` at input
    rows ``indices``.

    Example:
      >>> w = CsrMatrix.from_dense(np.array([[0.0, 2.0], [3.0, 0.0]], np.float32))
      >>> w.indptr.tolist(), w.indices.tolist(), w.values.tolist()
      ([0, 1, 2], [1, 0], [3.0, 2.0])
    """

    values: jax.Array  # [nnz]
    indices: jax.Array  # [nnz] int32, input row of each nonzero
    indptr: jax.Array  # [out + 1] int32
    shape: tuple[int, int]

    @classmethod
    def from_dense(cls, dense: jax.Array | np.ndarray, mask: np.ndarray | None = None) -> CsrMatrix:
        """Keep the entries selected by the host bool ``mask`` (default: the nonzeros)."""
        if jnp.ndim(dense) != 2:
            raise ValueError(f"dense must be 2-D (in, out); got shape {jnp.shape(dense)}")
        transposed = jnp.asarray(dense).T
        mask = np.asarray(transposed != 0 if mask is None else np.asarray(mask, bool).T)
        if mask.shape != transposed.shape:
            raise ValueError(f"mask must have shape {jnp.shape(dense)}; got {mask.T.shape}")
        out_idx, in_idx = np.nonzero(mask)
        indptr = np.searchsorted(out_idx, np.arange(mask.shape[0] + 1))
        return cls(
            values=transposed[out_idx, in_idx],
            indices=jnp.asarray(in_idx, jnp.int32),
            indptr=jnp.asarray(indptr, jnp.int32),
            shape=tuple(int(d) for d in jnp.shape(dense)),
        )

    @property
    def nnz(self) -> int:
        return self.values.shape[0]

    @property
    def out_ids(self) -> jax.Array:
        """Output column of each nonzero (the CSR row ids), ``[nnz]`` int32."""
        return (jnp.searchsorted(self.indptr, jnp.arange(self.nnz), side="right") - 1).astype(
            jnp.int32
        )

    def to_dense(self) -> jax.Array:
        """The dense ``(in, out)`` matrix (differentiable in ``values``)."""
        dense = jnp.zeros(self.shape, self.values.dtype)
        return dense.at[self.indices, self.out_ids].add(self.values)
