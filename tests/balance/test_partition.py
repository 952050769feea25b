"""partition / uniform / by_param against brute force over every layout of small pipelines."""

import importlib
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynjax.balance import InfeasibleError, by_param, partition, stage_costs, uniform


def layouts(num_layers: int, num_stages: int):
    """Every split of ``num_layers`` consecutive layers into ``num_stages`` non-empty stages."""
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = (0, *cuts, num_layers)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(num_stages))


def brute_force(costs, num_stages, memory=None, capacity=None, comm=0.0):
    """(optimal bottleneck, all optimal layouts) or (None, []) when nothing fits."""
    caps = np.broadcast_to(np.asarray(capacity if capacity is not None else np.inf, float),
                           (num_stages,))
    scored = []
    for counts in layouts(len(costs), num_stages):
        if memory is not None:
            used = stage_costs(memory, counts)
            if np.any(used > caps):
                continue
        scored.append((float(stage_costs(costs, counts, comm=comm).max()), counts))
    if not scored:
        return None, []
    best = min(v for v, _ in scored)
    return best, [c for v, c in scored if v == best]


def shift(a, b) -> int:
    """Total boundary shift between two layouts."""
    return int(np.abs(np.cumsum(a) - np.cumsum(b)).sum())


@st.composite
def problems(draw, *, with_memory: bool):
    num_layers = draw(st.integers(1, 9))
    num_stages = draw(st.integers(1, num_layers))
    integer = draw(st.booleans())
    cost = st.integers(0, 9).map(float) if integer else st.floats(0, 10, allow_subnormal=False)
    costs = draw(st.lists(cost, min_size=num_layers, max_size=num_layers))
    memory = capacity = None
    if with_memory:
        memory = draw(st.lists(st.integers(0, 5).map(float), min_size=num_layers,
                               max_size=num_layers))
        cap = st.integers(1, 14).map(float)
        capacity = draw(cap | st.lists(cap, min_size=num_stages, max_size=num_stages))
    comm = draw(st.just(0.0) | st.lists(st.integers(0, 4).map(float), min_size=num_stages - 1,
                                        max_size=num_stages - 1))
    return costs, num_stages, memory, capacity, comm


@settings(max_examples=300, deadline=None)
@given(problems(with_memory=False))
def test_partition_is_optimal(problem):
    costs, num_stages, _, _, comm = problem
    best, optimal = brute_force(costs, num_stages, comm=comm)
    counts = partition(costs, num_stages, comm=comm)
    assert counts in optimal, (counts, best)


@settings(max_examples=300, deadline=None)
@given(problems(with_memory=True))
def test_partition_honours_memory_or_raises(problem):
    costs, num_stages, memory, capacity, comm = problem
    best, optimal = brute_force(costs, num_stages, memory, capacity, comm)
    if best is None:
        with pytest.raises(InfeasibleError, match=r"\w"):
            partition(costs, num_stages, memory=memory, capacity=capacity, comm=comm)
        return
    counts = partition(costs, num_stages, memory=memory, capacity=capacity, comm=comm)
    assert counts in optimal
    caps = np.broadcast_to(np.asarray(capacity, float), (num_stages,))
    assert np.all(stage_costs(memory, counts) <= caps)


@settings(max_examples=300, deadline=None)
@given(problems(with_memory=True), st.data())
def test_tie_break_moves_fewest_layers(problem, data):
    costs, num_stages, memory, capacity, comm = problem
    best, optimal = brute_force(costs, num_stages, memory, capacity, comm)
    if best is None:
        return
    current = data.draw(st.sampled_from(list(layouts(len(costs), num_stages))))
    counts = partition(costs, num_stages, memory=memory, capacity=capacity, comm=comm,
                       current=current)
    assert counts in optimal
    assert shift(counts, current) == min(shift(o, current) for o in optimal)
    if current in optimal:
        assert counts == current


def test_tie_break_prefers_current_among_equal_optima():
    costs = [1.0] * 6
    for current in [(2, 2, 2), (3, 2, 1), (1, 3, 2)]:
        assert partition(costs, 3, current=current) == (2, 2, 2)
    costs = [1.0, 0.0, 1.0, 0.0, 1.0]  # zero-cost layers make several optima
    for current in [(1, 2, 2), (2, 1, 2), (2, 2, 1), (1, 3, 1)]:
        assert partition(costs, 3, current=current) == current


def test_default_tie_break_is_the_even_split():
    assert partition([0.0] * 7, 3) == uniform(7, 3) == (3, 2, 2)


def test_comm_pushes_work_off_the_sender():
    costs = [1.0] * 8
    assert partition(costs, 2) == (4, 4)
    assert partition(costs, 2, comm=2.0) == (3, 5)  # stage 0 pays 2 to send: 3 + 2 = 5
    assert partition(costs, 3, comm=[0.0, 3.0]) == (3, 1, 4)  # 3 | 1 + 3 | 4


def test_exact_on_awkward_floats():
    rng = np.random.default_rng(0)
    for _ in range(50):
        costs = rng.random(9) * 10.0 ** rng.integers(-3, 4, 9)
        best, optimal = brute_force(costs.tolist(), 4)
        assert partition(costs, 4) in optimal


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(costs=[1, 1], num_stages=3), "only 2 layers"),
        (dict(costs=[1, 1], num_stages=0), ">= 1"),
        (dict(costs=[1, 1, 1], num_stages=2, memory=[1, 5, 1], capacity=4), "layer 1 needs"),
        (dict(costs=[1, 1, 1], num_stages=2, memory=[2, 2, 2], capacity=2.5), "total memory"),
        (dict(costs=[1, 1, 1], num_stages=2, memory=[1, 2, 1], capacity=[2, 2]), "no split"),
    ],
)
def test_infeasible_says_why(kwargs, message):
    with pytest.raises(InfeasibleError, match=message):
        partition(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(costs=[1, -1], num_stages=1),
        dict(costs=[1, float("nan")], num_stages=1),
        dict(costs=[1, 1], num_stages=1, memory=[1, 1]),
        dict(costs=[1, 1], num_stages=1, capacity=3),
        dict(costs=[1, 1], num_stages=1, memory=[1], capacity=3),
        dict(costs=[1, 1], num_stages=2, capacity=[3], memory=[1, 1]),
        dict(costs=[1, 1], num_stages=2, current=(1, 1, 0)),
        dict(costs=[1, 1], num_stages=2, current=(2,)),
        dict(costs=[1, 1], num_stages=2, comm=[1.0, 1.0]),
    ],
)
def test_malformed_input_is_a_plain_value_error(kwargs):
    with pytest.raises(ValueError) as err:
        partition(**kwargs)
    assert not isinstance(err.value, InfeasibleError)


def test_large_instance_matches_lower_bounds():
    """10,000 x 1,024: the optimum of integer costs is the smallest feasible integer bottleneck."""
    rng = np.random.default_rng(1)
    costs = rng.integers(1, 100, 10_000).astype(float)
    counts = partition(costs, 1024)
    assert len(counts) == 1024 and sum(counts) == 10_000 and min(counts) >= 1
    best = stage_costs(costs, counts).max()
    # a bottleneck one below the optimum must be infeasible for the plain greedy packer
    stages, used = 1, 0.0
    for c in costs:
        if used + c > best - 1:
            stages, used = stages + 1, 0.0
        used += c
    assert stages > 1024


def test_uniform_and_by_param():
    assert uniform(10, 4) == (3, 3, 2, 2)
    assert uniform(8, 8) == (1,) * 8
    with pytest.raises(InfeasibleError):
        uniform(3, 4)
    params = [10, 1, 1, 1, 1, 1, 1, 4]
    best, optimal = brute_force([float(p) for p in params], 3)
    assert by_param(params, 3) in optimal


def min_shift_reference(costs, num_stages, bottleneck, current):
    """Plain O(S L^2) programme: least boundary shift over layouts with bottleneck <= given."""
    prefix = np.concatenate(([0.0], np.cumsum(costs)))
    target = np.concatenate(([0], np.cumsum(current)))
    num_layers = len(costs)
    inf = float("inf")
    best = {0: 0}
    for k in range(1, num_stages + 1):
        ends = [num_layers] if k == num_stages else range(k, num_layers - num_stages + k + 1)
        best = {
            e: min((d for b, d in best.items() if b < e and prefix[e] - prefix[b] <= bottleneck),
                   default=inf) + (abs(e - target[k]) if k < num_stages else 0)
            for e in ends
        }
    return best[num_layers]


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_tie_break_on_wide_windows(seed):
    """One heavy layer fixes the bottleneck and leaves the other boundaries hundreds of positions
    of freedom, far from ``current``: the wide (NumPy) path of the tie-break programme."""
    rng = np.random.default_rng(seed)
    num_layers, num_stages = 240, 4
    costs = (rng.random(num_layers) < 0.4).astype(float)
    costs[rng.integers(num_layers)] = 100.0
    cuts = np.sort(rng.choice(np.arange(1, num_layers), num_stages - 1, replace=False))
    current = tuple(np.diff(np.concatenate(([0], cuts, [num_layers]))).tolist())
    counts = partition(costs, num_stages, current=current)
    bottleneck = stage_costs(costs, counts).max()
    assert bottleneck == brute_force_bottleneck(costs, num_stages)
    assert shift(counts, current) == min_shift_reference(costs, num_stages, bottleneck, current)


def brute_force_bottleneck(costs, num_stages):
    """Smallest integer bottleneck a greedy packer fits into num_stages (integer costs)."""
    for cap in range(int(max(costs)), int(sum(costs)) + 1):
        stages, used = 1, 0.0
        for c in costs:
            if used + c > cap:
                stages, used = stages + 1, 0.0
            used += c
        if stages <= num_stages:
            return cap
    raise AssertionError("unreachable")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=300), st.data())
def test_sparse_table_window_minimum(values, data):
    """The range-minimum behind wide tie-break levels, against a plain scan."""
    window_min = importlib.import_module("dynjax.balance.partition")._window_min
    n = len(values)
    pairs = data.draw(st.lists(st.tuples(st.integers(0, n), st.integers(0, n)), min_size=1,
                               max_size=40))
    lo = np.array([a for a, _ in pairs])
    hi = np.array([b for _, b in pairs])
    got = window_min(np.array(values, dtype=np.int64), lo, hi)
    for (a, b), g in zip(pairs, got, strict=True):
        assert g == (min(values[a:b]) if a < b else 2**62)
