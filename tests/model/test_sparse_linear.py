"""Block-pruned matmul: outputs and gradients against the masked dense product in float64 NumPy."""

from __future__ import annotations

import doctest
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynjax.model import sparse_linear
from dynjax.model.sparse_linear import (
    block_mask_of,
    block_pruned_matmul,
    bucket_blocks,
    column_block_index,
    column_groups,
    group_blocks,
    group_widths,
)

BS = 8


def _mask(n_rows: int, n_cols: int, density: float, seed: int) -> np.ndarray:
    """A random block mask with an empty first column and a full last one."""
    mask = np.random.default_rng(seed).random((n_rows, n_cols)) < density
    mask[:, 0], mask[:, -1] = False, True
    return mask


def _problem(lead, d_in, d_out, density, seed, dtype=jnp.float32):
    """x, a w holding junk in its pruned blocks (the product must ignore it), dy, mask."""
    rng = np.random.default_rng(seed)
    mask = _mask(d_in // BS, d_out // BS, density, seed)
    x = jnp.asarray(rng.standard_normal((*lead, d_in)), dtype)
    w = jnp.asarray(rng.standard_normal((d_in, d_out)), dtype)
    dy = jnp.asarray(rng.standard_normal((*lead, d_out)), dtype)
    return x, w, dy, mask


def _reference(x, w, dy, mask):
    """y = x @ (w * M), dx = dy @ (w * M).T, dw = (x.T @ dy) * M, in float64."""
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    dense_mask = np.kron(mask, np.ones((BS, BS)))
    x2, dy2 = f64(x).reshape(-1, w.shape[0]), f64(dy).reshape(-1, w.shape[1])
    wm = f64(w) * dense_mask
    return (
        (x2 @ wm).reshape(dy.shape),
        (dy2 @ wm.T).reshape(x.shape),
        (x2.T @ dy2) * dense_mask,
    )


@functools.partial(jax.jit, static_argnames=("impl", "loop"))
def _run(x, w, dy, index, impl="xla", loop=True):
    matmul = lambda x, w: block_pruned_matmul(
        x, w, index, block_size=BS, impl=impl, interpret=True, loop=loop
    )
    y, vjp = jax.vjp(matmul, x, w)
    return (y, *vjp(dy))


def _assert_close(actual, expected, name, tol=1e-5):
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    scale = np.max(np.abs(expected), initial=0.0)
    err = np.max(np.abs(actual - expected), initial=0.0) / max(scale, 1.0)
    assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"


def _check(lead, d_in, d_out, density, seed, dtype=jnp.float32, tol=1e-5, groups=0, **kw):
    """``groups``: 0 for one index of every column, else `group_widths`' most groups."""
    x, w, dy, mask = _problem(lead, d_in, d_out, density, seed, dtype)
    if groups:
        index = column_groups(mask, group_widths(mask.sum(axis=0), groups))
    else:
        index = jnp.asarray(column_block_index(mask))
    got = _run(x, w, dy, index, **kw)
    for name, a, b in zip(("y", "dx", "dw"), got, _reference(x, w, dy, mask), strict=True):
        assert a.shape == b.shape and a.dtype == dtype, name
        _assert_close(a, b, name, tol)
    # dw is exactly zero on pruned blocks, not merely small.
    dw_blocks = np.asarray(got[2]).reshape(d_in // BS, BS, d_out // BS, BS)
    assert not np.abs(dw_blocks).max(axis=(1, 3))[~mask].any()


@settings(max_examples=10, deadline=None, derandomize=True)
@given(density=st.sampled_from([0.1, 0.25, 0.5, 0.9]), seed=st.integers(0, 2**16),
       lead=st.sampled_from([(24,), (2, 5)]))
def test_matches_masked_dense(density, seed, lead):
    _check(lead, 64, 48, density, seed)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(density=st.sampled_from([0.1, 0.3, 0.7]), seed=st.integers(0, 2**16),
       groups=st.integers(1, 4), loop=st.booleans())
def test_column_groups_match_masked_dense(density, seed, groups, loop):
    """Columns sorted into groups of their own widths (an empty column's group computes
    nothing) give the masked dense product and its gradients, looped or batched."""
    _check((24,), 64, 80, density, seed, groups=groups, loop=loop)


def test_pallas_path_matches_with_groups():
    _check((16,), 32, 48, 0.5, seed=4, groups=3, impl="pallas")


def test_bf16_accumulates_in_fp32():
    """dx sums one product per block-column: 128 of them here, too many for bf16 sums."""
    _check((16,), 32, 1024, 0.9, seed=5, dtype=jnp.bfloat16, tol=1e-2)


def test_unrolled_loop_with_a_remainder_matches():
    """35 block-columns of small slabs unroll 8 to a body: the last body holds 3 columns."""
    assert sparse_linear._unroll(35, 1 << 10) == 8
    _check((24,), 64, 35 * BS, 0.4, seed=11)


def test_unroll_bounds_the_gathered_slabs_in_flight():
    assert [sparse_linear._unroll(128, mib << 20) for mib in (0, 1, 2, 4, 8, 64)] == [
        8, 8, 4, 2, 1, 1]
    assert [sparse_linear._unroll(n, 1) for n in (3, 8, 13)] == [1, 2, 3]  # a quarter at most


def test_scatter_blocks_places_each_block_and_zeros_the_rest():
    rng = np.random.default_rng(2)
    mask = _mask(5, 4, 0.5, seed=2)
    index = column_block_index(mask)  # sentinel-padded: column 0 is empty
    blocks = rng.standard_normal((4, index.shape[1], BS, BS)).astype(np.float32)
    groups = ((jnp.arange(4, dtype=jnp.int32), jnp.asarray(index)),)
    dense = np.asarray(sparse_linear._scatter_blocks([jnp.asarray(blocks)], groups, 5, 4))
    expected = np.zeros((5 * BS, 4 * BS), np.float32)
    for j, t in np.ndindex(index.shape):
        if index[j, t] < 5:
            expected[index[j, t] * BS:(index[j, t] + 1) * BS, j * BS:(j + 1) * BS] = blocks[j, t]
    np.testing.assert_array_equal(dense, expected)


def test_one_batched_step_matches_too():
    _check((24,), 64, 48, 0.4, seed=7, loop=False)


def test_pallas_path_matches_xla_path():
    """The GPU path (Pallas, interpreted here) gives the same y, dx, dw as the XLA path."""
    x, w, dy, mask = _problem((16,), 32, 32, 0.5, seed=3)
    index = jnp.asarray(column_block_index(mask))
    xla = _run(x, w, dy, index, impl="xla")
    pallas = _run(x, w, dy, index, impl="pallas")
    for name, a, b in zip(("y", "dx", "dw"), pallas, xla, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
    _assert_close(pallas[0], _reference(x, w, dy, mask)[0], "y")


def test_auto_picks_pallas_on_gpu_and_xla_elsewhere(monkeypatch):
    x, w, _, mask = _problem((4,), 16, 16, 0.5, seed=0)
    index = jnp.asarray(column_block_index(mask))
    calls = []
    real = sparse_linear._pallas_matmul
    monkeypatch.setattr(sparse_linear, "_pallas_matmul",
                        lambda *a: calls.append("pallas") or real(*a[:-1], True))
    block_pruned_matmul(x, w, index, block_size=BS)
    assert calls == []
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    y = block_pruned_matmul(x, w, index, block_size=BS)
    assert calls == ["pallas"]
    _assert_close(y, _reference(x, w, x @ w, mask)[0], "y")


def test_all_blocks_pruned_gives_zeros():
    x, w, dy, _ = _problem((4,), 16, 24, 0.0, seed=0)
    index = jnp.asarray(column_block_index(np.zeros((2, 3), bool)))
    assert index.shape == (3, 0)
    y, dx, dw = _run(x, w, dy, index)
    assert not (np.any(y) or np.any(dx) or np.any(dw))


def test_new_mask_with_the_same_k_reuses_the_compile():
    traces = []

    @jax.jit
    def step(x, w, index):
        traces.append(index.shape)
        return jax.grad(lambda w: block_pruned_matmul(x, w, index, block_size=BS).sum())(w)

    x, w, _, _ = _problem((8,), 32, 32, 0.5, seed=0)
    masks = [np.eye(4, dtype=bool), np.roll(np.eye(4, dtype=bool), 1, axis=0),
             np.ones((4, 4), bool)]
    grads = [step(x, w, jnp.asarray(column_block_index(m, k=2 if i < 2 else None)))
             for i, m in enumerate(masks)]
    assert traces == [(4, 2), (4, 4)]  # the second mask (same K) reused the first trace
    for m, g in zip(masks, grads, strict=True):
        np.testing.assert_array_equal(np.asarray(g) != 0, np.kron(m, np.ones((BS, BS), bool)))


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_cost_analysis_flops_scale_with_k(k):
    """Compiled forward and forward+backward FLOPs are K / (in/bs) of the dense ones."""
    d_in, d_out, bs = 256, 256, 32
    x, w = jnp.ones((64, d_in)), jnp.ones((d_in, d_out))
    index = jnp.zeros((d_out // bs, k), jnp.int32)
    sparse = lambda x, w: block_pruned_matmul(x, w, index, block_size=bs, loop=False)
    flops = lambda f: jax.jit(f).lower(x, w).compile().cost_analysis()["flops"]
    grad = lambda f: jax.grad(lambda x, w: f(x, w).sum(), argnums=(0, 1))
    assert flops(sparse) / flops(jnp.matmul) == pytest.approx(k / (d_in // bs), rel=0.05)
    assert flops(grad(sparse)) / flops(grad(jnp.matmul)) == pytest.approx(k / (d_in // bs),
                                                                           rel=0.05)


def test_cost_analysis_flops_follow_the_groups():
    """Compiled FLOPs are the groups' blocks over the dense blocks: each column's own width,
    not the busiest column's."""
    d_in, bs = 256, 32
    counts = np.array([8, 6, 2, 2, 1, 1, 0, 0])  # of 8 block-rows, 8 block-columns
    mask = np.arange(8)[:, None] < counts[None, :]
    widths = group_widths(counts, 3)
    assert widths == ((8, 1), (6, 1), (2, 4), (0, 2)) and group_blocks(widths) == 22
    x, w = jnp.ones((64, d_in)), jnp.ones((d_in, d_in))
    groups = column_groups(mask, widths)
    sparse = lambda x, w: block_pruned_matmul(x, w, groups, block_size=bs, loop=False)
    flops = lambda f: jax.jit(f).lower(x, w).compile().cost_analysis()["flops"]
    grad = lambda f: jax.grad(lambda x, w: f(x, w).sum(), argnums=(0, 1))
    assert flops(sparse) / flops(jnp.matmul) == pytest.approx(22 / 64, rel=0.05)
    assert flops(grad(sparse)) / flops(grad(jnp.matmul)) == pytest.approx(22 / 64, rel=0.05)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(counts=st.lists(st.integers(0, 6), min_size=1, max_size=7), groups=st.integers(1, 3))
def test_group_widths_are_the_fewest_blocks(counts, groups):
    """Against every cut of the sorted columns into at most ``groups`` nonzero runs."""
    import itertools

    widths = group_widths(counts, groups)
    c = sorted(counts, reverse=True)
    assert sum(n for _, n in widths) == len(c) and len([k for k, _ in widths if k]) <= groups
    start = 0
    for k, n in widths:  # each group is as wide as its busiest column
        assert n > 0 and (k == c[start] if k else not any(c[start:start + n]))
        start += n
    nonzero = [v for v in c if v]
    best = group_blocks(((0, 0),))
    if nonzero:
        best = min(
            sum(nonzero[i] * (j - i) for i, j in itertools.pairwise((0, *cuts, len(nonzero))))
            for r in range(min(groups, len(nonzero)))
            for cuts in itertools.combinations(range(1, len(nonzero)), r)
        )
    assert group_blocks(widths) == best


def test_column_groups_reject_a_column_wider_than_its_group():
    mask = np.array([[1, 1, 0], [1, 0, 0], [1, 0, 0]], bool)  # counts 3, 1, 0
    cols, rows = column_groups(mask, ((3, 1), (1, 2)))[1]
    assert cols.tolist() == [1, 2] and rows.tolist() == [[0], [3]]
    with pytest.raises(ValueError, match="more than k=2"):
        column_groups(mask, ((2, 1), (1, 2)))
    with pytest.raises(ValueError, match="sum to 3"):
        column_groups(mask, ((3, 1), (1, 1)))


def test_column_block_index_matches_numpy_loop():
    mask = _mask(8, 6, 0.4, seed=1)
    index = column_block_index(mask)
    counts = mask.sum(axis=0)
    assert index.dtype == np.int32 and index.shape == (6, bucket_blocks(counts.max(), 8))
    for j in range(6):
        rows = np.flatnonzero(mask[:, j])
        np.testing.assert_array_equal(index[j, :len(rows)], rows)
        assert (index[j, len(rows):] == 8).all()  # the sentinel pads
    np.testing.assert_array_equal(block_mask_of(jnp.asarray(index), 8), mask)
    with pytest.raises(ValueError, match="more than k=1"):
        column_block_index(mask, k=1)


def test_docstring_examples():
    result = doctest.testmod(sparse_linear)
    assert result.attempted > 0 and result.failed == 0


def test_bucket_blocks_values():
    assert [bucket_blocks(c, 16) for c in range(17)] == [
        0, 1, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14, 16, 16]
    assert [bucket_blocks(c, 64) for c in (1, 3, 5, 8, 9, 17, 64)] == [1, 4, 8, 8, 16, 24, 64]
    with pytest.raises(ValueError):
        bucket_blocks(17, 16)


@given(n_rows=st.integers(1, 512), data=st.data())
def test_bucket_blocks_bounds_padding_and_recompiles(n_rows, data):
    count = data.draw(st.integers(0, n_rows))
    k = bucket_blocks(count, n_rows)
    assert count <= k <= n_rows
    step = -(-n_rows // 8)
    assert k - count < step and (k == count or k < 2 * count)  # < 1/8 dense, < 2x exact
    assert bucket_blocks(k, n_rows) == k  # buckets are fixed points
    buckets = {bucket_blocks(c, n_rows) for c in range(n_rows + 1)}
    assert len(buckets) <= 9 + (step - 1).bit_length()


def test_rejects_mismatched_shapes():
    x, w = jnp.ones((2, 16)), jnp.ones((16, 24))
    with pytest.raises(ValueError, match="do not match"):
        block_pruned_matmul(x, w, jnp.zeros((2, 1), jnp.int32), block_size=BS)
    with pytest.raises(ValueError, match="not divisible"):
        block_pruned_matmul(x, w, jnp.zeros((3, 1), jnp.int32), block_size=5)
    with pytest.raises(ValueError, match="impl"):
        block_pruned_matmul(x, w, jnp.zeros((3, 1), jnp.int32), block_size=BS, impl="cuda")
