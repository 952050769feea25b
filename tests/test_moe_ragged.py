"""The ragged MoE path (``moe.dispatch="ragged"``) against the static path: same outputs,
gradients and dropped (token, choice) pairs for the same per-expert capacities, and runtime
capacities that change without a recompile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dynjax.model import MoE, RaggedCapacities
from dynjax.parallel import expert_parallel, make_mesh

D, H, E, K, S, G = 16, 24, 4, 2, 12, 8
CAPACITIES = [(S,) * E, (1, 3, 2, 5), (4, 4, 4, 4), (0, 6, 2, 3)]


@pytest.fixture(scope="module")
def moe():
    return MoE(D, H, E, K, out_std=0.1, rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(0).normal(size=(G, S, D)).astype(np.float32)


def shard_total(capacities, shards):
    """The largest expert shard's summed capacities: the least buffer that holds its pairs."""
    return int(np.asarray(capacities).reshape(shards, -1).sum(axis=1).max())


def _loss_and_grads(moe, x, parallel=None, ragged=False, capacities=None, total=None):
    graphdef, params = nnx.split(moe)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=(G, S, D)), jnp.float32)

    def loss(p, v, caps):
        caps = RaggedCapacities(caps, total) if ragged else caps
        y, stats = nnx.merge(graphdef, p)(v, capacities=caps, parallel=parallel)
        return jnp.sum(y * cot) + 0.1 * jnp.mean(stats.aux_loss), (y, stats)

    caps = jnp.asarray(capacities, jnp.int32) if ragged else tuple(capacities)
    fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    if ragged:
        fn = jax.jit(fn)
    else:
        fn = jax.jit(fn, static_argnums=2)
    (_, (y, stats)), grads = fn(params, jnp.asarray(x), caps)
    return y, stats, grads


def _assert_same(a, b):
    (y1, s1, g1), (y2, s2, g2) = a, b
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y2), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(s1.dropped), np.asarray(s2.dropped))
    np.testing.assert_array_equal(np.asarray(s1.group_loads), np.asarray(s2.group_loads))
    for u, v in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("capacities", CAPACITIES)
def test_ragged_equals_static(moe, x, capacities):
    static = _loss_and_grads(moe, x, capacities=capacities)
    total = shard_total(capacities, 1)
    ragged = _loss_and_grads(moe, x, ragged=True, capacities=capacities, total=total)
    _assert_same(ragged, static)
    assert (int(np.asarray(static[1].dropped).sum()) > 0) == (capacities[0] < S)


@pytest.mark.parametrize("capacities", CAPACITIES)
def test_ragged_equals_static_with_expert_parallelism(moe, x, capacities):
    """4-way expert and 2-way data sharding (8 fake CPU devices)."""
    par = expert_parallel(make_mesh(1, 2, 4))
    static = _loss_and_grads(moe, x, parallel=par, capacities=capacities)
    total = shard_total(capacities, 4)
    ragged = _loss_and_grads(moe, x, parallel=par, ragged=True, capacities=capacities, total=total)
    _assert_same(ragged, static)


def test_runtime_capacities_change_drops_without_recompile(moe, x):
    """Within one total the capacities are a runtime input: one compile serves them all, and
    each gives the static path's drops."""
    total = 12
    graphdef, params = nnx.split(moe)
    fn = jax.jit(
        lambda p, v, caps: nnx.merge(graphdef, p)(v, capacities=RaggedCapacities(caps, total))[1]
    )
    for caps in [(3, 3, 3, 3), (1, 5, 2, 4), (6, 2, 2, 2), (0, 0, 6, 6)]:
        stats = fn(params, jnp.asarray(x), jnp.asarray(caps, jnp.int32))
        _, ref = moe(jnp.asarray(x), capacities=caps)
        np.testing.assert_array_equal(np.asarray(stats.dropped), np.asarray(ref.dropped))
    assert fn._cache_size() == 1


@pytest.mark.parametrize("shards", [1, 4])
def test_dropless_worst_case_buffer_equals_no_drop(moe, x, shards):
    """Dropless: every capacity = group tokens, and the buffer only the worst case a shard can
    receive (S * min(k, local experts) rows per group, below the summed capacities)."""
    par = expert_parallel(make_mesh(1, 8 // shards, shards)) if shards > 1 else None
    total = S * min(K, E // shards)
    static = _loss_and_grads(moe, x, parallel=par, capacities=(S,) * E)
    ragged = _loss_and_grads(moe, x, parallel=par, ragged=True, capacities=(S,) * E, total=total)
    _assert_same(ragged, static)
    assert int(np.asarray(ragged[1].dropped).sum()) == 0
