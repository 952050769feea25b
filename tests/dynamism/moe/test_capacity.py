"""DynamicCapacity on synthetic expert loads (seed 001 §4.1, §5.2)."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dynjax.dynamism.moe.capacity import (
    LOADS,
    DynamicCapacity,
    drop_fraction,
    required_capacity,
)
from dynjax.dynamism.moe.part import MoEContext, capacities_of, static_capacities, with_capacities
from dynjax.recompile import History, Plan

# 2 MoE layers, 8 experts, top-2, 128-token groups: factor 1.0 is 32 slots per expert
CTX = MoEContext(num_moe_layers=2, num_experts=8, top_k=2, group_tokens=128)
GROUPS = 16  # dispatch groups (sequences) per step
BASE = 32


def skewed_loads(steps: int, seed: int = 0, share=None) -> list[np.ndarray]:
    """Per step [L, G, E] loads: top-2 routing of 128 tokens per group with a skewed router."""
    rng = np.random.default_rng(seed)
    share = np.array(share if share is not None else [6, 4, 3, 2, 2, 1, 1, 1], float)
    share /= share.sum()
    return [
        rng.multinomial(2 * 128, share, size=(CTX.num_moe_layers, GROUPS))
        for _ in range(steps)
    ]


def history(loads: list[np.ndarray], start: int = 0) -> History:
    return History.of((start + i, {LOADS: x, "loss": 1.0}) for i, x in enumerate(loads))


def baseline() -> Plan:
    return with_capacities(Plan(), static_capacities(CTX, 1.0))


def policy(**kwargs) -> DynamicCapacity:
    """The policy with room above the hottest expert of `skewed_loads` (factor ~2.6)."""
    return DynamicCapacity(CTX, **{"max_factor": 3.0, **kwargs})


def window_loads(loads: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(loads, axis=1)


def test_hot_experts_get_more_capacity_cold_ones_less():
    loads = skewed_loads(20)
    proposal = policy().propose(history(loads), baseline())
    caps = np.asarray(capacities_of(proposal.plan))
    assert (caps[:, 0] > BASE).all()
    assert (caps[:, 5:] <= BASE).all() and caps[:, 5:].mean() < BASE
    assert (np.diff(caps[:, [0, 1, 2, 5]], axis=1) <= 0).all()  # ordered like the load
    assert "grow" in proposal.reason and "mean capacity factor 1.00 ->" in proposal.reason


@pytest.mark.parametrize("target", [0.0, 0.01, 0.05])
def test_drop_rate_on_the_window_meets_the_target(target):
    loads = skewed_loads(20, seed=1)
    capacity = policy(target_drop_rate=target, max_factor=4.0)  # no expert capped
    plan = capacity.propose(history(loads), baseline()).plan
    dropped = drop_fraction(window_loads(loads), np.asarray(capacities_of(plan)))
    assert (dropped <= target).all()
    assert (drop_fraction(window_loads(loads), np.asarray(capacities_of(baseline()))) > 0.05).all()


def test_capacities_are_bucketed_and_clipped():
    capacity = policy(min_factor=0.5, max_factor=2.0, bucket=0.25)
    assert capacity.buckets.tolist() == [16, 24, 32, 40, 48, 56, 64]
    share = [40, 4, 3, 2, 2, 1, 1, 0]  # expert 0 needs more than max_factor, expert 7 nothing
    plan = capacity.propose(history(skewed_loads(20, share=share)), baseline()).plan
    caps = np.asarray(capacities_of(plan))
    assert set(caps.ravel()) <= set(capacity.buckets.tolist())
    assert (caps[:, 0] == 64).all() and (caps[:, 7] == 16).all()


def test_stable_loads_give_no_new_proposal():
    capacity = policy()
    plan = baseline()
    for seed in range(2):  # settle: the first windows move capacities off the baseline
        proposal = capacity.propose(history(skewed_loads(20, seed=seed)), plan)
        plan = proposal.plan if proposal else plan
    assert plan != baseline()
    for seed in range(2, 40):  # fresh windows of the same distribution: noise only
        assert capacity.propose(history(skewed_loads(20, seed=seed)), plan) is None


def test_growing_load_grows_capacity_at_once():
    capacity = policy()
    plan = capacity.propose(history(skewed_loads(20)), baseline()).plan
    hotter = skewed_loads(20, seed=3, share=[6, 4, 3, 2, 2, 1, 1, 4])  # expert 7 heats up
    proposal = capacity.propose(history(hotter), plan)
    old, new = np.asarray(capacities_of(plan)), np.asarray(capacities_of(proposal.plan))
    assert (new[:, 7] > old[:, 7]).all()
    assert (drop_fraction(window_loads(hotter), new) <= 0.01).all()


def test_small_decrease_keeps_capacity_large_one_shrinks_it():
    capacity = policy(hysteresis=0.25)
    plan = capacity.propose(history(skewed_loads(20)), baseline()).plan
    caps = np.asarray(capacities_of(plan))
    slightly = skewed_loads(20, seed=5, share=[5.6, 4, 3, 2, 2, 1, 1, 1])
    assert capacity.propose(history(slightly), plan) is None
    much = skewed_loads(20, seed=5, share=[2, 4, 3, 2, 2, 1, 1, 1])
    shrunk = np.asarray(capacities_of(capacity.propose(history(much), plan).plan))
    assert (shrunk[:, 0] < caps[:, 0]).all()


def test_needs_a_full_window_and_moe_layers():
    capacity = policy(window=20)
    assert capacity.propose(history(skewed_loads(19)), baseline()) is None
    assert capacity.propose(history(skewed_loads(20)), Plan()) is None


def test_loads_of_the_wrong_shape_raise():
    bad = [x[:, :, :4] for x in skewed_loads(20)]
    with pytest.raises(ValueError, match="shape"):
        policy().propose(history(bad), baseline())


@settings(max_examples=60, deadline=None)
@given(
    loads=hnp.arrays(np.int64, (1, 4, 3), elements=st.integers(0, 6)),
    target=st.sampled_from([0.0, 0.05, 0.1, 0.3]),
)
def test_required_capacity_is_the_least_total_within_the_target(loads, target):
    need = required_capacity(loads, target)
    assert drop_fraction(loads, need)[0] <= target + 1e-12
    routed = loads.sum()
    best = min(
        sum(caps)
        for caps in itertools.product(range(7), repeat=3)
        if np.maximum(loads[0] - np.array(caps), 0).sum() <= target * routed
    )
    assert need.sum() == best
