"""Pallas kernels for dynamic sparsity: block-sparse flash attention and block-sparse SpMM.

``csr_matmul`` (unstructured CSR SpMM through jax-triton, the ``[triton]`` extra) is loaded on
first access only, and only on a GPU backend: importing this package never imports jax-triton.
"""

from pallas_kernels.attention import block_sparse_attention, hashed_block_sparse_attention
from pallas_kernels.block_sparse_matrix import BlockSparseMatrix
from pallas_kernels.csr import CsrMatrix
from pallas_kernels.selector import (
    CrossoverCache,
    measure_crossover,
    prefer_sparse,
    sparse_or_dense_matmul,
)
from pallas_kernels.spmm import block_sparse_matmul

__all__ = [
    "BlockSparseMatrix",
    "CrossoverCache",
    "CsrMatrix",
    "block_sparse_attention",
    "block_sparse_matmul",
    "csr_matmul",
    "hashed_block_sparse_attention",
    "measure_crossover",
    "prefer_sparse",
    "sparse_or_dense_matmul",
]


def __getattr__(name: str):
    if name == "csr_matmul":
        from pallas_kernels.triton_csr import csr_matmul

        return csr_matmul
    raise AttributeError(f"module 'pallas_kernels' has no attribute {name!r}")
