"""Unstructured CSR SpMM through jax-triton: the optional ``[triton]`` extra, NVIDIA GPUs only.

Sputnik-style row-split SpMM (000 §4.2.2, 003 §C): one program per (output feature, tile of
tokens) walks that feature's nonzeros in chunks, gathers the matching rows of ``x.T`` and
accumulates in fp32. The backward reuses it on the transposed CSR for ``dx`` and computes
``dvalues`` with an SDDMM (one dot over tokens per nonzero), so gradients exist only for stored
nonzeros.

jax-triton imports only with a CUDA jaxlib, so this module refuses to import elsewhere; nothing
else in ``pallas_kernels`` imports it. Written against the jax-triton 0.3/0.4 ``triton_call``
API but NOT yet run on a GPU (the sessions that wrote it had none): treat it as untested until
``tests/pallas_kernels/test_triton_csr.py`` has passed on a GPU.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

if jax.default_backend() != "gpu":
    raise ImportError("pallas_kernels.triton_csr needs a GPU backend (jax-triton is CUDA only)")

import jax_triton as jt  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pallas_kernels.block_index import segments  # noqa: E402
from pallas_kernels.csr import CsrMatrix  # noqa: E402

BLOCK_M = 64  # tokens per program
BLOCK_NZ = 32  # nonzeros gathered per step
# jax-triton >= 0.4 renamed out_shape to out_type (the old name warns).
_OUT = "out_type" if "out_type" in inspect.signature(jt.triton_call).parameters else "out_shape"


@triton.jit
def _spmm_kernel(indptr_ptr, indices_ptr, values_ptr, b_ptr, m, out_ptr,
                 BLOCK_M: tl.constexpr, BLOCK_NZ: tl.constexpr):
    """``out[r, :] = sum_t values[t] * b[indices[t], :]`` over the nonzeros ``t`` of CSR row r."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    col_ok = cols < m
    start = tl.load(indptr_ptr + row)
    end = tl.load(indptr_ptr + row + 1)
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for t0 in range(start, end, BLOCK_NZ):
        t = t0 + tl.arange(0, BLOCK_NZ)
        nz_ok = t < end
        k = tl.load(indices_ptr + t, mask=nz_ok, other=0)
        v = tl.load(values_ptr + t, mask=nz_ok, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + k[:, None] * m + cols[None, :],
                    mask=nz_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.sum(v[:, None] * b.to(tl.float32), axis=0)
    tl.store(out_ptr + row * m + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _sddmm_kernel(indptr_ptr, indices_ptr, a_ptr, b_ptr, m, out_ptr,
                  BLOCK_M: tl.constexpr, BLOCK_NZ: tl.constexpr):
    """``out[t] = a[r, :] . b[indices[t], :]`` for the nonzeros ``t`` of CSR row r."""
    row = tl.program_id(0)
    start = tl.load(indptr_ptr + row)
    end = tl.load(indptr_ptr + row + 1)
    for t0 in range(start, end, BLOCK_NZ):
        t = t0 + tl.arange(0, BLOCK_NZ)
        nz_ok = t < end
        k = tl.load(indices_ptr + t, mask=nz_ok, other=0)
        acc = tl.zeros((BLOCK_NZ,), dtype=tl.float32)
        for c0 in range(0, m, BLOCK_M):
            cols = c0 + tl.arange(0, BLOCK_M)
            col_ok = cols < m
            a = tl.load(a_ptr + row * m + cols, mask=col_ok, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + k[:, None] * m + cols[None, :],
                        mask=nz_ok[:, None] & col_ok[None, :], other=0.0)
            acc += tl.sum(b.to(tl.float32) * a[None, :], axis=1)
        tl.store(out_ptr + t, acc.to(out_ptr.dtype.element_ty), mask=nz_ok)


def _spmm(indptr, indices, values, b: jax.Array) -> jax.Array:
    """CSR ``(rows, b.shape[0])`` times dense ``b`` of shape ``(k, m)``: ``(rows, m)``."""
    rows, m = indptr.shape[0] - 1, b.shape[1]
    return jt.triton_call(
        indptr, indices, values, b, m,  # outputs follow the inputs (out_ptr)
        kernel=_spmm_kernel, grid=(rows, triton.cdiv(m, BLOCK_M)),
        BLOCK_M=BLOCK_M, BLOCK_NZ=BLOCK_NZ, **{_OUT: jax.ShapeDtypeStruct((rows, m), b.dtype)},
    )


def _sddmm(indptr, indices, a: jax.Array, b: jax.Array, dtype) -> jax.Array:
    return jt.triton_call(
        indptr, indices, a, b, a.shape[1],
        kernel=_sddmm_kernel, grid=(indptr.shape[0] - 1,),
        BLOCK_M=BLOCK_M, BLOCK_NZ=BLOCK_NZ,
        **{_OUT: jax.ShapeDtypeStruct(indices.shape, dtype)},
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul_t(shape: tuple[int, int], x_t, values, indices, indptr) -> jax.Array:
    """``(x @ w).T`` from ``x.T`` of shape ``(in, tokens)``."""
    return _spmm(indptr, indices, values.astype(x_t.dtype), x_t)


def _matmul_t_fwd(shape, x_t, values, indices, indptr):
    return _matmul_t(shape, x_t, values, indices, indptr), (x_t, values, indices, indptr)


def _matmul_t_bwd(shape, residuals, dy_t):
    x_t, values, indices, indptr = residuals
    w = CsrMatrix(values, indices, indptr, shape)
    order, in_ptr = segments(indices, shape[0])  # CSR of w itself: one row per input
    dx_t = _spmm(in_ptr, w.out_ids[order], values[order].astype(dy_t.dtype), dy_t)
    dvalues = _sddmm(indptr, indices, dy_t, x_t, values.dtype)
    return dx_t, dvalues, None, None


_matmul_t.defvjp(_matmul_t_fwd, _matmul_t_bwd)


@jax.jit
def csr_matmul(x: jax.Array, w: CsrMatrix) -> jax.Array:
    """``x @ w`` for ``x`` of shape ``(..., in)``; differentiable in ``x`` and ``w.values``."""
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"x of shape {x.shape} cannot multiply a matrix of shape {w.shape}")
    lead = x.shape[:-1]
    if w.nnz == 0:  # no kernel launch on empty buffers
        return jnp.zeros((*lead, w.shape[1]), x.dtype)
    x_t = x.reshape(-1, w.shape[0]).T
    y_t = _matmul_t(w.shape, x_t, w.values, w.indices, w.indptr)
    return y_t.T.reshape(*lead, w.shape[1])
