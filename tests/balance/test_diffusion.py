"""diffusion: decentralised, never raises the variance, converges, respects memory."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynjax.balance import diffusion, diffusion_with_info, partition, stage_costs, uniform


@st.composite
def layouts(draw, *, with_memory: bool = False):
    num_layers = draw(st.integers(1, 12))
    num_stages = draw(st.integers(1, min(num_layers, 5)))
    costs = draw(st.lists(st.integers(0, 9).map(float), min_size=num_layers, max_size=num_layers))
    cuts = draw(st.lists(st.integers(1, num_layers - 1), min_size=num_stages - 1,
                         max_size=num_stages - 1, unique=True)) if num_stages > 1 else []
    bounds = [0, *sorted(cuts), num_layers]
    counts = tuple(bounds[i + 1] - bounds[i] for i in range(num_stages))
    memory = capacity = None
    if with_memory:
        memory = draw(st.lists(st.integers(0, 4).map(float), min_size=num_layers,
                               max_size=num_layers))
        start = stage_costs(memory, counts)
        capacity = [float(u) + draw(st.integers(0, 4)) for u in start]  # the start fits
    return costs, counts, memory, capacity


def replay(costs, counts, moves, memory=None):
    """Apply moves one by one; yield stage loads (and memory) after each, checking adjacency."""
    owner = np.repeat(np.arange(len(counts)), counts)
    yield stage_costs(costs, counts), None if memory is None else stage_costs(memory, counts)
    for move in moves:
        for src, dst, layer in move:
            assert abs(src - dst) == 1 and owner[layer] == src
            owner[layer] = dst
        assert np.all(np.diff(owner) >= 0), "stages must stay consecutive"
        now = tuple(np.bincount(owner, minlength=len(counts)))
        assert min(now) >= 1
        yield (stage_costs(costs, now),
               None if memory is None else stage_costs(memory, now))


@settings(max_examples=300, deadline=None)
@given(layouts(with_memory=True), st.integers(0, 12))
def test_never_raises_variance_and_fits_memory(layout, max_iters):
    costs, counts, memory, capacity = layout
    result = diffusion_with_info(costs, counts, memory=memory, capacity=capacity,
                                 max_iters=max_iters)
    assert result.iterations <= max_iters
    variances, final = [], None
    for loads, used in replay(costs, counts, result.moves, memory):
        variances.append(np.var(loads))
        assert np.all(used <= np.asarray(capacity))
        final = loads
    assert all(b < a for a, b in zip(variances, variances[1:], strict=False))
    assert np.array_equal(final, stage_costs(costs, result.counts))
    assert diffusion(costs, counts, memory=memory, capacity=capacity,
                     max_iters=max_iters) == result.counts


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_converges_within_max_iters(layout):
    """Each round strictly lowers the variance, so no layout repeats: rounds <= layouts."""
    costs, counts, _, _ = layout
    bound = math.comb(len(costs) - 1, len(counts) - 1)
    result = diffusion_with_info(costs, counts, max_iters=bound + 1)
    assert result.converged
    assert result.iterations <= bound
    # converged means no neighbour hand-over (boundary layer plus zero-cost layers before it)
    # lowers the variance
    loads = stage_costs(costs, result.counts)
    bounds = np.cumsum((0, *result.counts))
    for s in range(len(counts) - 1):
        for src, dst in ((s, s + 1), (s + 1, s)):
            layers = range(bounds[src + 1] - 1, bounds[src], -1) if dst > src else range(
                bounds[src], bounds[src + 1] - 1)
            moved = 0.0
            for i in layers:
                moved += costs[i]
                if moved > 0:
                    break
            assert not 0 < moved < loads[src] - loads[dst]


def test_relays_dissolve_staircases():
    """(4, 5, 6) in unit layers: no pair can improve alone, a relay through the middle can."""
    result = diffusion_with_info([1.0] * 15, (4, 5, 6))
    assert result.counts == (5, 5, 5) and result.converged
    assert result.moves == (((2, 1, 9), (1, 0, 4)),)  # one move relayed 2 -> 1 -> 0


def test_frozen_front_reaches_the_optimum_in_few_rounds():
    """Layer freezing (seed 000 §2.3): zero-cost layers in front; uniform start is 1.5x optimal."""
    costs = [0.0] * 20 + [1.0] * 28
    start = uniform(48, 8)
    result = diffusion_with_info(costs, start)
    optimum = stage_costs(costs, partition(costs, 8)).max()
    assert stage_costs(costs, start).max() == 1.5 * optimum
    assert result.converged and result.iterations <= 5
    assert stage_costs(costs, result.counts).max() == optimum


def test_comm_counts_in_the_sender_load():
    costs = [1.0] * 8
    assert diffusion(costs, (4, 4)) == (4, 4)
    assert diffusion(costs, (4, 4), comm=2.0) == (3, 5)


def test_memory_blocks_a_move():
    costs = [1.0, 1.0, 1.0, 1.0]
    assert diffusion(costs, (3, 1)) == (2, 2)
    assert diffusion(costs, (3, 1), memory=[1, 1, 1, 1], capacity=[3, 1]) == (3, 1)


def test_max_iters_zero_reports_without_moving():
    result = diffusion_with_info([1.0] * 4, (3, 1), max_iters=0)
    assert result.counts == (3, 1) and result.iterations == 0 and not result.converged
    with pytest.raises(ValueError):
        diffusion([1.0], (1,), max_iters=-1)
