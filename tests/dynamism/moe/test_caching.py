"""Sample-assignment caching: stability measure and the on/off policy (seed 001 §4.2, §5.3)."""

import math

import numpy as np
import pytest

from dynjax.dynamism.moe.caching import STABILITY, AssignmentCache, CachingPolicy
from dynjax.dynamism.moe.part import cached_routing_of
from dynjax.recompile import History, Plan

OFF = Plan().with_part("moe", cached_routing=False)  # a Plan with MoE's part, routing uncached
ON = OFF.with_part("moe", cached_routing=True)


def test_stability_counts_tokens_whose_expert_set_did_not_change():
    cache = AssignmentCache(num_moe_layers=2, seq_len=2, top_k=2, num_experts=4)
    first = np.array(  # [L=2, B=2, S=2, k=2]
        [
            [[[0, 1], [2, 3]], [[1, 2], [0, 3]]],
            [[[3, 0], [1, 2]], [[0, 2], [1, 3]]],
        ]
    )
    assert cache.update(np.array([10, 11]), first) is None  # nothing seen before
    second = np.array(  # sample 11 again (now first in the batch) and a new sample 12
        [
            [[[2, 1], [3, 0]], [[9, 9], [9, 9]]],  # layer 0: {1,2} same, {0,3} same
            [[[0, 2], [1, 2]], [[9, 9], [9, 9]]],  # layer 1: {0,2} same, {1,2} != {1,3}
        ]
    )
    assert cache.update(np.array([11, 12]), second) == pytest.approx(3 / 4)
    # the cache now holds the newest assignment of 11: seeing it again unchanged is 100%
    third = second[:, :1]
    assert cache.update(np.array([11]), third) == 1.0


def test_lookup_returns_cached_sets_and_minus_one_for_unknown_samples():
    cache = AssignmentCache(num_moe_layers=1, seq_len=3, top_k=1, num_experts=8)
    cache.update(np.array([5]), np.array([[[[7], [0], [3]]]]))
    out = cache.lookup(np.array([4, 5]))
    assert out.shape == (1, 2, 3, 1) and out.dtype == np.int32
    assert (out[0, 0] == -1).all()
    assert out[0, 1, :, 0].tolist() == [7, 0, 3]
    cache.update(np.array([6]), np.array([[[[2], [1], [5]]]]))
    assert cache.lookup(np.array([6]))[0, 0, :, 0].tolist() == [2, 1, 5]


def test_lookup_keeps_the_routers_order_within_the_top_k():
    cache = AssignmentCache(num_moe_layers=1, seq_len=1, top_k=2, num_experts=8)
    cache.update(np.array([0]), np.array([[[[6, 2]]]]))
    assert cache.lookup(np.array([0])).ravel().tolist() == [6, 2]


def test_cache_memory_is_bounded_least_recently_seen_first():
    cache = AssignmentCache(num_moe_layers=1, seq_len=1, top_k=1, num_experts=4, max_entries=2)
    one = np.zeros((1, 1, 1, 1), int)
    for sid in (1, 2, 1, 3):  # 1 is refreshed, so 2 is the least recently seen
        cache.update(np.array([sid]), one)
    assert len(cache) == 2
    assert cache.lookup(np.array([1, 2, 3]))[0, :, 0, 0].tolist() == [0, -1, 0]


def test_mismatched_shapes_raise():
    cache = AssignmentCache(num_moe_layers=1, seq_len=4, top_k=2, num_experts=4)
    with pytest.raises(ValueError, match="do not match"):
        cache.update(np.array([0]), np.zeros((1, 1, 3, 2), int))


def stability_history(values, start=0):
    return History.of((start + i, {STABILITY: v}) for i, v in enumerate(values))


def test_switches_on_at_96_percent_only_after_warmup():
    policy = CachingPolicy(warmup_steps=50, window=3)
    stable = [0.97, 0.98, 0.99]
    assert policy.propose(stability_history(stable, start=10), OFF) is None  # warm-up
    proposal = policy.propose(stability_history(stable, start=60), OFF)
    assert proposal.plan == ON and "98.0%" in proposal.reason
    almost = [0.95, 0.96, 0.96]  # mean 0.9567 < 0.96
    assert policy.propose(stability_history(almost, start=60), OFF) is None


def test_switches_off_below_90_percent_and_holds_in_between():
    policy = CachingPolicy(warmup_steps=0, window=2)
    on = ON
    between = stability_history([0.93, 0.91])
    assert policy.propose(between, on) is None  # stays on
    assert policy.propose(between, OFF) is None  # stays off
    proposal = policy.propose(stability_history([0.91, 0.88]), on)
    assert proposal.plan == OFF and "< 90%" in proposal.reason


def test_steps_without_repeats_are_ignored():
    policy = CachingPolicy(warmup_steps=0, window=2)
    values = [0.99, 0.99, math.nan, math.nan, math.nan]
    assert cached_routing_of(policy.propose(stability_history(values), OFF).plan)
    assert policy.propose(History.of([(0, {"loss": 1.0})]), OFF) is None
    assert policy.propose(stability_history([math.nan] * 3), OFF) is None


def test_stability_from_the_cache_drives_the_policy():
    """Converging router: assignments change less each epoch until caching switches on."""
    rng = np.random.default_rng(0)
    L, B, S, k, E = 2, 4, 16, 2, 8
    ids = np.arange(8)
    route = rng.integers(0, E, size=(L, len(ids), S))
    cache = AssignmentCache(L, S, k, E)
    policy = CachingPolicy(warmup_steps=0, window=2)
    plan, entries, switched_at = OFF, [], None
    for epoch in range(12):
        flip = 0.5 / (epoch + 1) ** 2  # the share of tokens whose expert changes
        changed = rng.random(route.shape) < flip
        route = np.where(changed, (route + 1) % E, route)
        for batch in range(2):
            step = 2 * epoch + batch
            sel = ids[batch * B : (batch + 1) * B]
            top2 = np.stack([route[:, sel], (route[:, sel] + 3) % E], axis=-1)
            stability = cache.update(sel, top2)
            entries.append((step, {STABILITY: math.nan if stability is None else stability}))
            proposal = policy.propose(History.of(entries), plan)
            if proposal is not None:
                plan, switched_at = proposal.plan, step
    assert cached_routing_of(plan) and switched_at > 3
