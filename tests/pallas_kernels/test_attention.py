"""Block-sparse flash attention (interpret mode) against a dense float64 reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental import pallas as pl

from pallas_kernels import block_sparse_attention

from ..helpers import assert_kernel_close

# (batch, heads, seq, head_dim, block_size): tiny, few distinct shapes so compiles are reused.
SHAPES = [(1, 1, 16, 8, 8), (1, 2, 32, 8, 8), (2, 1, 48, 16, 16), (1, 1, 32, 16, 4)]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def _inputs(shape, dtype, seed):
    b, h, s, d, _ = shape
    rng = np.random.default_rng(seed)
    q, k, v, do = (jnp.asarray(rng.standard_normal((b, h, s, d)), dtype) for _ in range(4))
    return q, k, v, do


def _block_mask(shape, density, seed):
    b, h, s, _, bs = shape
    n = s // bs
    return np.random.default_rng(seed + 1).random((b, h, n, n)) < density


def _reference(q, k, v, do, block_mask, block_size, causal):
    """Dense masked softmax attention and its VJP in float64 (rows without keys give zeros)."""
    with jax.enable_x64(True):
        q, k, v, do = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, do))
        seq = q.shape[2]
        allowed = np.repeat(np.repeat(block_mask, block_size, -2), block_size, -1)
        if causal:
            allowed = allowed & np.tril(np.ones((seq, seq), bool))

        def attend(q, k, v):
            s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
            s = jnp.where(allowed, s, -jnp.inf)
            m = jnp.max(s, axis=-1, keepdims=True)
            p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
            denom = jnp.sum(p, axis=-1, keepdims=True)
            return jnp.einsum("bhqk,bhkd->bhqd", p / jnp.where(denom == 0, 1.0, denom), v)

        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(do))


@functools.partial(jax.jit, static_argnames=("block_size", "causal", "interpret"))
def _run(q, k, v, do, block_mask, block_size, causal, interpret=None):
    attend = functools.partial(
        block_sparse_attention, block_size=block_size, causal=causal, interpret=interpret
    )
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, block_mask), q, k, v)
    return (out, *vjp(do))


def _check(shape, dtype, density, causal, seed, interpret=None):
    q, k, v, do = _inputs(shape, dtype, seed)
    mask = _block_mask(shape, density, seed)
    bs = shape[-1]
    got = _run(q, k, v, do, jnp.asarray(mask), bs, causal, interpret)
    want = _reference(q, k, v, do, mask, bs, causal)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == dtype
        assert_kernel_close(a, b, TOL[dtype], name)


density = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.05, 0.95))


@pytest.mark.slow
@settings(max_examples=16, **SETTINGS)
@given(shape=st.sampled_from(SHAPES), density=density, causal=st.booleans(),
       seed=st.integers(0, 2**16))
def test_matches_dense_reference_fp32(shape, density, causal, seed):
    _check(shape, jnp.float32, density, causal, seed)


@settings(max_examples=6, **SETTINGS)
@given(shape=st.sampled_from(SHAPES[:3]), density=density, seed=st.integers(0, 2**16))
def test_matches_dense_reference_bf16(shape, density, seed):
    _check(shape, jnp.bfloat16, density, True, seed)


def test_a_jax_without_the_triton_lowering_computes_it_with_xla(without_pallas_triton):
    # What a GPU gets once jax drops the Pallas Triton backend: the same values and gradients
    # (dense cost), and a warning saying so. Causal and not, rows without keys included.
    with pytest.warns(RuntimeWarning, match="no usable Pallas Triton lowering"):
        _check(SHAPES[2], jnp.float32, 0.5, True, seed=3, interpret=False)
    _check(SHAPES[1], jnp.float32, 0.3, False, seed=4, interpret=False)
    _check(SHAPES[0], jnp.bfloat16, 0.0, True, seed=5, interpret=False)


def test_interpreter_poisons_unwritten_outputs():
    """The finite-output checks above mean something: a skipped block stays NaN."""

    def writes_first_block_only(x_ref, o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = x_ref[...]

    out = pl.pallas_call(
        writes_first_block_only,
        grid=(2,),
        in_specs=[pl.BlockSpec((8,), lambda i: (i,))],
        out_specs=pl.BlockSpec((8,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
        interpret=True,
    )(jnp.ones(16))
    assert np.isfinite(out[:8]).all() and np.isnan(out[8:]).all()


def test_fully_masked_rows_are_zero():
    shape = (1, 1, 32, 8, 8)
    q, k, v, do = _inputs(shape, jnp.float32, 0)
    mask = np.ones((1, 1, 4, 4), bool)
    mask[..., 2, :] = False  # query block 2 sees no key at all
    got = _run(q, k, v, do, jnp.asarray(mask), 8, True)
    want = _reference(q, k, v, do, mask, 8, True)
    np.testing.assert_array_equal(got[0][..., 16:24, :], 0.0)
    np.testing.assert_array_equal(got[1][..., 16:24, :], 0.0)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert_kernel_close(a, b, TOL[jnp.float32], name)


def test_absent_blocks_are_never_read():
    """NaN keys/values in a block nobody attends to must not reach any output or gradient."""
    shape = (1, 1, 32, 8, 8)
    q, k, v, do = _inputs(shape, jnp.float32, 1)
    mask = np.ones((1, 1, 4, 4), bool)
    mask[..., :, 1] = False  # key block 1 is absent for every query block
    k, v = (x.at[..., 8:16, :].set(jnp.nan) for x in (k, v))
    for causal in (True, False):
        out, dq, dk, dv = _run(q, k, v, do, jnp.asarray(mask), 8, causal)
        assert all(np.isfinite(x).all() for x in (out, dq, dk, dv))
        np.testing.assert_array_equal(dk[..., 8:16, :], 0.0)
        np.testing.assert_array_equal(dv[..., 8:16, :], 0.0)
        clean = [x.at[..., 8:16, :].set(0.0) for x in (k, v)]
        want = _reference(q, *clean, do, mask, 8, causal)
        for name, a, b in zip(("out", "dq"), (out, dq), want[:2], strict=True):
            assert_kernel_close(a, b, TOL[jnp.float32], name)


def test_block_mask_broadcasts_and_may_be_traced():
    shape = (2, 2, 16, 8, 8)
    q, k, v, _ = _inputs(shape, jnp.float32, 2)
    mask = jnp.array([[True, False], [True, True]])
    hashed = jax.jit(lambda m: block_sparse_attention(q, k, v, m, block_size=8))(mask)
    full = block_sparse_attention(q, k, v, jnp.broadcast_to(mask, (2, 2, 2, 2)), block_size=8)
    np.testing.assert_array_equal(hashed, full)


def test_rejects_non_divisible_sequence():
    q = jnp.zeros((1, 1, 20, 8))
    with pytest.raises(ValueError, match="not a multiple of block_size 8"):
        block_sparse_attention(q, q, q, jnp.ones((1, 1, 2, 2), bool), block_size=8)


def test_rejects_bad_mask_shape_and_mismatched_inputs():
    q = jnp.zeros((1, 1, 16, 8))
    with pytest.raises(ValueError, match="does not broadcast"):
        block_sparse_attention(q, q, q, jnp.ones((1, 1, 3, 3), bool), block_size=8)
    with pytest.raises(ValueError, match="share one shape"):
        block_sparse_attention(q, q[..., :4], q, jnp.ones((2, 2), bool), block_size=8)


def test_compiled_mode_rejects_tiles_triton_cannot_lower():
    q = jnp.zeros((1, 1, 24, 8))
    with pytest.raises(ValueError, match="power of two"):
        block_sparse_attention(q, q, q, jnp.ones((2, 2), bool), block_size=12, interpret=False)
