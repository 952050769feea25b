"""repack: merged neighbours only, never over capacity, fewest workers, balanced among packings."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynjax.balance import InfeasibleError, repack, stage_costs


def coarsenings(counts, groups):
    """Every way to merge runs of neighbouring stages of ``counts`` into ``groups`` stages."""
    n = len(counts)
    for cuts in itertools.combinations(range(1, n), groups - 1):
        bounds = (0, *cuts, n)
        yield tuple(sum(counts[bounds[i]:bounds[i + 1]]) for i in range(groups))


@st.composite
def pipelines(draw):
    num_stages = draw(st.integers(1, 6))
    counts = draw(st.lists(st.integers(1, 3), min_size=num_stages, max_size=num_stages))
    layers = sum(counts)
    costs = draw(st.lists(st.integers(0, 9).map(float), min_size=layers, max_size=layers))
    memory = draw(st.lists(st.integers(0, 4).map(float), min_size=layers, max_size=layers))
    capacity = float(stage_costs(memory, counts).max() + draw(st.integers(0, 8)))
    return costs, tuple(counts), memory, capacity


@settings(max_examples=300, deadline=None)
@given(pipelines())
def test_fewest_workers_within_capacity_and_balanced(pipeline):
    costs, counts, memory, capacity = pipeline
    packed = repack(costs, counts, memory=memory, capacity=capacity)
    assert np.all(stage_costs(memory, packed) <= capacity)
    fits = {g: [c for c in coarsenings(counts, g) if np.all(stage_costs(memory, c) <= capacity)]
            for g in range(1, len(counts) + 1)}
    fewest = min(g for g, options in fits.items() if options)
    assert len(packed) == fewest
    assert packed in fits[fewest]  # a coarsening: only whole stages moved
    assert stage_costs(costs, packed).max() == min(stage_costs(costs, c).max()
                                                   for c in fits[fewest])
    if any(a + b <= capacity for a, b in itertools.pairwise(stage_costs(memory, counts))):
        assert len(packed) < len(counts)


@settings(max_examples=100, deadline=None)
@given(pipelines(), st.data())
def test_target_is_met_or_refused(pipeline, data):
    costs, counts, memory, capacity = pipeline
    fewest = len(repack(costs, counts, memory=memory, capacity=capacity))
    target = data.draw(st.integers(1, len(counts)))
    if target < fewest:
        with pytest.raises(InfeasibleError, match="at least"):
            repack(costs, counts, memory=memory, capacity=capacity, target=target)
        return
    packed = repack(costs, counts, memory=memory, capacity=capacity, target=target)
    assert len(packed) == target
    assert np.all(stage_costs(memory, packed) <= capacity)


def test_packs_a_pruned_pipeline_onto_fewer_workers():
    """Memory shrank (pruning): three old stages fit one worker; costs pick the grouping."""
    counts = (2,) * 8
    memory = [0.25] * 16
    costs = [4.0, 4.0] + [1.0] * 14  # old stage 0 costs 8, the others 2
    packed = repack(costs, counts, memory=memory, capacity=1.5)
    assert packed == (4, 6, 6)  # 10 | 6 | 6: the heavy stage takes the fewest partners
    assert repack(costs, counts, memory=memory, capacity=1.5, target=4) == (2, 6, 4, 4)


def test_refuses_what_merging_cannot_fix():
    with pytest.raises(InfeasibleError, match="already needs"):
        repack([1.0] * 4, (3, 1), memory=[1.0] * 4, capacity=2.0)
    with pytest.raises(ValueError):
        repack([1.0] * 4, (2, 2), memory=[1.0] * 4, capacity=4.0, target=3)
    with pytest.raises(ValueError, match="one capacity"):
        repack([1.0] * 4, (2, 2), memory=[1.0] * 4, capacity=[4.0, 4.0])
