"""CSR format (anywhere) and the jax-triton CSR SpMM (GPU with the [triton] extra only)."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.csr import CsrMatrix

from ..helpers import ROOT


def _sparse(shape, density, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * (rng.random(shape) < density)).astype(np.float32)


def test_csr_round_trip_and_layout():
    dense = _sparse((6, 5), 0.4, 0)
    w = CsrMatrix.from_dense(dense)
    np.testing.assert_array_equal(w.to_dense(), dense)
    assert w.nnz == np.count_nonzero(dense) and w.indptr.shape == (6,)
    for j in range(5):  # row j of the CSR is column j of the weight
        start, end = int(w.indptr[j]), int(w.indptr[j + 1])
        np.testing.assert_array_equal(w.indices[start:end], np.nonzero(dense[:, j])[0])
        np.testing.assert_array_equal(w.out_ids[start:end], j)


def test_csr_mask_keeps_zeros_and_validates_shape():
    dense = np.zeros((4, 4), np.float32)
    w = CsrMatrix.from_dense(dense, np.eye(4, dtype=bool))
    assert w.nnz == 4
    with pytest.raises(ValueError, match="mask must have shape"):
        CsrMatrix.from_dense(dense, np.ones((4, 3), bool))


def test_jax_triton_is_never_imported_on_cpu():
    code = (
        "import sys, pallas_kernels\n"
        "assert 'pallas_kernels.triton_csr' not in sys.modules\n"
        "try:\n"
        "    pallas_kernels.csr_matmul\n"
        "except ImportError as e:\n"
        "    assert 'needs a GPU backend' in str(e)\n"
        "else:\n"
        "    raise AssertionError('csr_matmul loaded on CPU')\n"
        "assert 'jax_triton' not in sys.modules\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)


def test_triton_csr_matmul_on_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("jax-triton CSR SpMM runs on GPU only")
    triton_csr = pytest.importorskip("pallas_kernels.triton_csr")
    dense = _sparse((256, 192), 0.1, 1)
    w = CsrMatrix.from_dense(dense)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 100, 256)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((2, 100, 192)), jnp.float32)
    y, vjp = jax.vjp(lambda x, v: triton_csr.csr_matmul(x, CsrMatrix(v, w.indices, w.indptr,
                                                                      w.shape)), x, w.values)
    dx, dv = vjp(dy)
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    np.testing.assert_allclose(y, x64 @ dense, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dx, dy64 @ dense.T, rtol=1e-4, atol=1e-4)
    full = np.einsum("bmk,bmn->kn", x64, dy64)
    np.testing.assert_allclose(dv, full[w.indices, w.out_ids], rtol=1e-4, atol=1e-4)
