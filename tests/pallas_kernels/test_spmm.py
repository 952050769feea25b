"""Block-sparse SpMM (interpret mode) and its format against dense float64 NumPy."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import BlockSparseMatrix, block_sparse_matmul

from ..helpers import assert_kernel_close

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
# (lead dims of x, in, out, block): tiny, few distinct shapes so compiles are reused.
SHAPES = [((5,), 32, 48, (8, 16)), ((2, 3), 16, 16, (8, 8)), ((33,), 32, 32, (16, 8))]


@functools.partial(jax.jit, static_argnames=("block_m", "interpret"))
def _run(x, blocks, w, dy, block_m=128, interpret=None):
    """y, dx, dw with ``w``'s values replaced by ``blocks`` (the differentiable leaf)."""
    matmul = lambda x, blocks: block_sparse_matmul(
        x, dataclasses.replace(w, blocks=blocks), block_m=block_m, interpret=interpret
    )
    y, vjp = jax.vjp(matmul, x, blocks)
    return (y, *vjp(dy))


def _reference(x, w: BlockSparseMatrix, dy):
    """y = x @ W, dx = dy @ W.T, dW = x.T @ dy read at the present blocks, in float64."""
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    x, dy, dense = f64(x), f64(dy), f64(w.to_dense())
    (k, n), (bk, bn) = w.shape, w.block_size
    x2, dy2 = x.reshape(-1, k), dy.reshape(-1, n)
    tiles = (x2.T @ dy2).reshape(k // bk, bk, n // bn, bn).transpose(0, 2, 1, 3)
    return x @ dense, dy @ dense.T, tiles[np.asarray(w.rows), np.asarray(w.cols)]


def _check(shape, dtype, density, seed, block_m=128, interpret=None):
    lead, k, n, (bk, bn) = shape
    rng = np.random.default_rng(seed)
    mask = rng.random((k // bk, n // bn)) < density
    w = BlockSparseMatrix.from_dense(
        jnp.asarray(rng.standard_normal((k, n)), dtype), (bk, bn), mask
    )
    x = jnp.asarray(rng.standard_normal((*lead, k)), dtype)
    dy = jnp.asarray(rng.standard_normal((*lead, n)), dtype)
    got = _run(x, w.blocks, w, dy, block_m=block_m, interpret=interpret)
    for name, a, b in zip(("y", "dx", "dw"), got, _reference(x, w, dy), strict=True):
        assert a.dtype == dtype and a.shape == b.shape, name
        assert_kernel_close(a, b, TOL[dtype], name)


density = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.05, 0.95))


def test_a_jax_without_the_triton_lowering_computes_it_with_xla(without_pallas_triton):
    # What a GPU gets once jax drops the Pallas Triton backend: the same y, dx and dw (dense
    # cost), and a warning saying so; an empty matrix too.
    with pytest.warns(RuntimeWarning, match="no usable Pallas Triton lowering"):
        _check(SHAPES[0], jnp.float32, 0.5, seed=1, interpret=False)
    _check(SHAPES[1], jnp.bfloat16, 0.7, seed=2, interpret=False)
    _check(SHAPES[2], jnp.float32, 0.0, seed=3, interpret=False)


@pytest.mark.slow
@settings(max_examples=12, **SETTINGS)
@given(shape=st.sampled_from(SHAPES), density=density, seed=st.integers(0, 2**16))
def test_matches_dense_reference_fp32(shape, density, seed):
    _check(shape, jnp.float32, density, seed)


@settings(max_examples=5, **SETTINGS)
@given(shape=st.sampled_from(SHAPES), density=density, seed=st.integers(0, 2**16))
def test_matches_dense_reference_bf16(shape, density, seed):
    _check(shape, jnp.bfloat16, density, seed)


def test_several_row_tiles():
    """Rows of x split over several tiles (and a padded last one) still match."""
    _check(((40,), 16, 32, (8, 16)), jnp.float32, 0.6, seed=3, block_m=16)


def test_from_dense_to_dense_round_trip():
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((8, 12)).astype(np.float32)
    dense[:4, 4:8] = 0.0  # one all-zero block
    w = BlockSparseMatrix.from_dense(dense, (4, 4))
    assert w.grid == (2, 3) and w.nnz_blocks == 5 and w.blocks.shape == (5, 4, 4)
    np.testing.assert_array_equal(w.to_dense(), dense)
    mask = np.array([[True, True, False], [False, False, True]])
    kept = BlockSparseMatrix.from_dense(dense, 4, mask)  # keeps the zero block, drops others
    assert kept.nnz_blocks == 3 and kept.sparsity == 0.5
    np.testing.assert_array_equal(kept.to_dense(), dense * np.kron(mask, np.ones((4, 4))))


def test_gradient_reaches_dense_through_from_dense():
    mask = np.array([[True, False], [False, True]])
    x = jnp.ones((3, 8))
    grad = jax.grad(
        lambda d: block_sparse_matmul(x, BlockSparseMatrix.from_dense(d, 4, mask)).sum()
    )(jnp.ones((8, 8)))
    np.testing.assert_allclose(grad, 3.0 * np.kron(mask, np.ones((4, 4))))


def test_matrix_is_a_pytree_for_jit():
    w = BlockSparseMatrix.from_dense(jnp.eye(16), 8)
    leaves, treedef = jax.tree_util.tree_flatten(w)
    assert len(leaves) == 3 and jax.tree_util.tree_unflatten(treedef, leaves).shape == (16, 16)
    assert jax.tree_util.tree_structure(BlockSparseMatrix.from_dense(jnp.ones((16, 16)), 8)) == (
        treedef
    )
    y = jax.jit(block_sparse_matmul)(jnp.arange(32.0).reshape(2, 16), w)
    np.testing.assert_array_equal(y, jnp.arange(32.0).reshape(2, 16))


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="not divisible into blocks"):
        BlockSparseMatrix.from_dense(np.ones((10, 8)), 4)
    with pytest.raises(ValueError, match="mask must have shape"):
        BlockSparseMatrix.from_dense(np.ones((8, 8)), 4, np.ones((3, 2), bool))
    w = BlockSparseMatrix.from_dense(np.ones((8, 8), np.float32), 4)
    with pytest.raises(ValueError, match="cannot multiply"):
        block_sparse_matmul(jnp.ones((2, 6)), w)
