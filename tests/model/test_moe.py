"""MoE routing, capacity-based dispatch and combine against a per-token NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dynjax.model import MoE, SlotLayout
from dynjax.parallel import expert_parallel, make_mesh

from ..helpers import gelu

D, H, E, K, S, G = 16, 24, 4, 2, 12, 8


def reference(moe: MoE, x: np.ndarray, capacities, cached=None):
    """Per-token loop: choice-major priority, drop beyond each expert's capacity."""
    router, w_in, w_out = (
        np.asarray(v[...], np.float64) for v in (moe.router, moe.w_in, moe.w_out)
    )
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    y = np.zeros_like(x)
    kept = np.zeros((x.shape[0], x.shape[1], K), bool)
    for g in range(x.shape[0]):
        experts = np.argsort(-probs[g], axis=-1, kind="stable")[:, :K]
        if cached is not None:
            experts = np.where(cached[g] >= 0, cached[g], experts)
        gates = np.take_along_axis(probs[g], experts, -1)
        gates /= gates.sum(-1, keepdims=True)
        used = np.zeros(E, int)
        for c in range(K):
            for s in range(x.shape[1]):
                e = experts[s, c]
                used[e] += 1
                if used[e] <= capacities[e]:
                    kept[g, s, c] = True
                    y[g, s] += gates[s, c] * (gelu(x[g, s] @ w_in[e]) @ w_out[e])
    return y, kept


@pytest.fixture(scope="module")
def moe():
    return MoE(D, H, E, K, out_std=0.1, rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(0).normal(size=(G, S, D)).astype(np.float32)


@pytest.mark.parametrize("capacities", [(S,) * E, (1, 3, 2, 5), (4, 4, 4, 4)])
def test_dispatch_matches_per_token_reference(moe, x, capacities):
    y, stats = jax.jit(lambda v: moe(v, capacities=capacities))(x)
    y_ref, kept = reference(moe, x.astype(np.float64), capacities)
    np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(stats.dropped), (~kept).sum(axis=(1, 2)))
    assert int(np.asarray(stats.group_loads).sum()) == G * S * K
    if capacities[0] == S:
        assert int(np.asarray(stats.dropped).sum()) == 0
    else:
        assert int(np.asarray(stats.dropped).sum()) > 0


@pytest.mark.slow
def test_expert_parallel_layer_equals_local(moe, x):
    """4-way expert and 2-way data sharding with uneven capacities gives the local result."""
    capacities = (2, 5, 3, 4)
    local, local_stats = moe(jnp.asarray(x), capacities=capacities)
    par = expert_parallel(make_mesh(1, 2, 4))
    sharded, stats = jax.jit(lambda v: moe(v, capacities=capacities, parallel=par))(x)
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(local), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(stats.dropped), np.asarray(local_stats.dropped))


def test_cached_routing_equals_router_when_assignments_unchanged(moe, x):
    capacities = (3, 5, 4, 6)
    y, stats = moe(jnp.asarray(x), capacities=capacities)
    y_cached, _ = moe(jnp.asarray(x), capacities=capacities, cached=stats.router_experts)
    np.testing.assert_array_equal(np.asarray(y_cached), np.asarray(y))


def test_cached_routing_dispatches_cached_experts_with_current_gates(moe, x):
    capacities = (S,) * E
    rng = np.random.default_rng(1)
    cached = np.stack([rng.permutation(E)[:K] for _ in range(G * S)]).reshape(G, S, K)
    cached[0] = -1  # a sample never seen: its tokens use the router
    y, _ = moe(jnp.asarray(x), capacities=capacities, cached=jnp.asarray(cached))
    y_ref, _ = reference(moe, x.astype(np.float64), capacities, cached)
    np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-4, atol=1e-5)


def aux_loss_reference(moe: MoE, x: np.ndarray, cached=None) -> np.ndarray:
    """docs/schemes/moe.md, per group: aux = E * sum_e f_e * P_e with f_e the fraction
    of the group's S*k (token, choice) pairs dispatched to e before dropping (sums to 1) and
    P_e the mean router probability of e over the group's tokens."""
    logits = x @ np.asarray(moe.router[...], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)  # [G, S, E]
    experts = np.argsort(-probs, axis=-1, kind="stable")[..., :K]  # [G, S, k]
    if cached is not None:
        experts = np.where(cached >= 0, cached, experts)
    f = (experts[..., None] == np.arange(E)).sum(axis=(1, 2)) / (S * K)  # [G, E]
    p = probs.mean(axis=1)  # [G, E]
    return E * (f * p).sum(axis=-1)


@pytest.mark.parametrize("with_cache", [False, True])
def test_aux_loss_is_the_documented_formula(moe, x, with_cache):
    """Fractions sum to 1 over the top-k choices (HF Mixtral and MaxText: to k); with cached
    routing they count the cached experts, the ones dispatched. Drops do not change it."""
    cached = None
    if with_cache:
        rng = np.random.default_rng(2)
        cached = np.stack([rng.permutation(E)[:K] for _ in range(G * S)]).reshape(G, S, K)
        cached[0] = -1
    dispatch = None if cached is None else jnp.asarray(cached)
    _, stats = moe(jnp.asarray(x), capacities=(1, 3, 2, 5), cached=dispatch)
    want = aux_loss_reference(moe, x.astype(np.float64), cached)
    np.testing.assert_allclose(np.asarray(stats.aux_loss), want, rtol=1e-5)


def test_slot_layout_places_experts_by_shard():
    layout = SlotLayout((2, 5, 3, 1), shards=2)  # shard 0: experts 0, 1; shard 1: experts 2, 3
    assert layout.slot_sizes == (3, 5)  # local slot i sized by the largest expert sitting in it
    assert layout.total == 16
    np.testing.assert_array_equal(layout.expert_base(), [0, 3, 8, 11])
    with pytest.raises(ValueError, match="cannot be split"):
        SlotLayout((1, 1, 1), shards=2)


def test_wrong_number_of_capacities_is_rejected(moe, x):
    with pytest.raises(ValueError, match="3 capacities given for 4 experts"):
        moe(jnp.asarray(x), capacities=(1, 2, 3))
