"""simulate / schedules: textbook bubbles, schedule data, dependency-exact timelines."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynjax.balance import SCHEDULES, Task, peak_in_flight, schedule_tasks, simulate


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.integers(1, 5), st.integers(1, 5),
       st.sampled_from(SCHEDULES))
def test_equal_stages_give_the_textbook_bubble(stages, micro, f, b, schedule):
    """GPipe and 1F1B: (M + S - 1)(f + b) per iteration, bubble (S - 1) / (M + S - 1)."""
    sim = simulate([float(f)] * stages, [float(b)] * stages, micro, schedule=schedule)
    assert sim.iteration_time == (micro + stages - 1) * (f + b)
    assert sim.bubble_ratio == pytest.approx((stages - 1) / (micro + stages - 1))
    assert sim.idle == ((stages - 1) * (f + b),) * stages


@pytest.mark.parametrize(("stages", "micro"), [(4, 8), (4, 2), (1, 3), (6, 6)])
def test_1f1b_stores_fewer_activations_than_gpipe(stages, micro):
    gpipe = simulate([1.0] * stages, [2.0] * stages, micro, schedule="gpipe")
    one_f = simulate([1.0] * stages, [2.0] * stages, micro, schedule="1f1b")
    assert gpipe.peak_in_flight == (micro,) * stages
    assert one_f.peak_in_flight == tuple(min(stages - s, micro) for s in range(stages))
    assert one_f.iteration_time == gpipe.iteration_time


def test_schedules_are_frozen_hashable_data():
    one_f = schedule_tasks("1f1b", 3, 4)
    assert [" ".join(map(str, stage)) for stage in one_f] == [
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]
    assert [" ".join(map(str, s)) for s in schedule_tasks("gpipe", 2, 2)] == ["F0 F1 B0 B1"] * 2
    assert hash(one_f) == hash(schedule_tasks("1f1b", 3, 4))
    assert peak_in_flight(one_f[0]) == 3
    with pytest.raises(ValueError, match="unknown schedule"):
        schedule_tasks("zero-bubble", 2, 2)


def test_comm_adds_two_hops_per_boundary_for_one_microbatch():
    fwd, bwd = [1.0, 2.0, 3.0], [2.0, 4.0, 6.0]
    base = simulate(fwd, bwd, 1).iteration_time
    assert base == 18.0
    assert simulate(fwd, bwd, 1, comm=0.5).iteration_time == 18.0 + 2 * 2 * 0.5
    assert simulate(fwd, bwd, 1, comm=[0.0, 3.0]).iteration_time == 18.0 + 2 * 3.0


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=5),
    st.integers(1, 8),
    st.integers(0, 3),
    st.sampled_from(SCHEDULES),
)
def test_timeline_respects_dependencies_and_starts_asap(times, micro, comm, schedule):
    fwd = [float(f) for f, _ in times]
    bwd = [float(b) for _, b in times]
    stages = len(times)
    sim = simulate(fwd, bwd, micro, schedule=schedule, comm=float(comm))
    end = {(e.kind, s, e.microbatch): e.end for s, row in enumerate(sim.timeline) for e in row}
    tasks = schedule_tasks(schedule, stages, micro)
    for s, row in enumerate(sim.timeline):
        assert [Task(e.kind, e.microbatch) for e in row] == list(tasks[s])
        free = 0.0
        for e in row:
            if e.kind == "F":
                ready = 0.0 if s == 0 else end[("F", s - 1, e.microbatch)] + comm
            elif s == stages - 1:
                ready = end[("F", s, e.microbatch)]
            else:
                ready = end[("B", s + 1, e.microbatch)] + comm
            assert e.start == max(free, ready)  # no overlap, no dependency broken, no dawdling
            assert e.end == e.start + (fwd[s] if e.kind == "F" else bwd[s])
            free = e.end
    assert sim.iteration_time == max(end.values())
    busy = micro * (np.array(fwd) + np.array(bwd))
    assert np.allclose(sim.idle, sim.iteration_time - busy)
    assert sim.iteration_time >= busy.max()
    slower = simulate(fwd, bwd, micro, schedule=schedule, comm=float(comm) + 1.0)
    assert slower.iteration_time >= sim.iteration_time


def test_explicit_task_lists_run_like_named_ones():
    named = simulate([1.0, 2.0], [2.0, 1.0], 3, schedule="1f1b")
    explicit = simulate([1.0, 2.0], [2.0, 1.0], 3, schedule=schedule_tasks("1f1b", 2, 3))
    assert named == explicit


def test_bad_schedules_are_rejected():
    f, b = Task("F", 0), Task("B", 0)
    with pytest.raises(ValueError, match="backward before"):
        simulate([1.0], [1.0], 1, schedule=((b, f),))
    with pytest.raises(ValueError, match="exactly once"):
        simulate([1.0], [1.0], 1, schedule=((f,),))
    f1, b1 = Task("F", 1), Task("B", 1)
    deadlock = ((f, b, f1, b1), (f1, b1, f, b))
    with pytest.raises(ValueError, match="deadlocks"):
        simulate([1.0, 1.0], [1.0, 1.0], 2, schedule=deadlock)
    with pytest.raises(ValueError):
        simulate([1.0, 1.0], [1.0], 2)
    with pytest.raises(ValueError):
        simulate([1.0, 1.0], [1.0, 1.0], 2, comm=[1.0, 1.0])
    with pytest.raises(ValueError):
        simulate([1.0], [1.0], 0)
