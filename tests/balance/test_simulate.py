"""simulate / schedules: textbook bubbles, schedule data, dependency-exact timelines."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynjax.balance import SCHEDULES, Task, peak_in_flight, schedule_tasks, simulate

ONE_CHUNK_FULL_BACKWARD = ("gpipe", "1f1b")  # the schedules whose backward is one task


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.integers(1, 5), st.integers(1, 5),
       st.sampled_from(ONE_CHUNK_FULL_BACKWARD))
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
    st.sampled_from(ONE_CHUNK_FULL_BACKWARD),
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


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6), st.integers(0, 6), st.integers(1, 4), st.integers(1, 4),
       st.integers(1, 4))
def test_zb_h1_idles_s_minus_1_times_f_plus_b_minus_w(stages, extra, f, b, w):
    """Qi et al. 2024 §3: with W no longer than F or B and M >= S, ZB-H1 idles (S-1)(F+B-W) per
    stage against 1F1B's (S-1)(F+B+W), and stores no more activations than 1F1B at its peak."""
    micro, w = stages + extra, min(w, f, b)
    sim = simulate([float(f)] * stages, [float(b + w)] * stages, micro, schedule="zb_h1",
                   weight_grad=[float(w)] * stages)
    assert sim.iteration_time == micro * (f + b + w) + (stages - 1) * (f + b - w)
    assert sim.idle == ((stages - 1) * (f + b - w),) * stages
    one_f = simulate([float(f)] * stages, [float(b + w)] * stages, micro, schedule="1f1b")
    assert max(sim.peak_in_flight) == max(one_f.peak_in_flight) == stages


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.integers(2, 4), st.integers(1, 4),
       st.integers(1, 4))
def test_interleaving_divides_the_bubble_by_the_chunks(stages, groups, chunks, f, b):
    """Narayanan et al. 2021 §2.2: v chunks of f + b each per device idle (S-1)(f+b), 1/v of the
    non-interleaved bubble of the same layers (S-1) v (f+b)."""
    micro = stages * groups
    sim = simulate([float(f)] * (stages * chunks), [float(b)] * (stages * chunks), micro,
                   schedule="interleaved_1f1b", virtual_stages=chunks)
    assert sim.iteration_time == micro * chunks * (f + b) + (stages - 1) * (f + b)
    plain = simulate([float(f * chunks)] * stages, [float(b * chunks)] * stages, micro)
    assert sum(sim.idle) * chunks == pytest.approx(sum(plain.idle))


@pytest.mark.parametrize(
    ("schedule", "chunks"), [("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2),
                             ("interleaved_1f1b", 3)]
)
@pytest.mark.parametrize("comm", [0.0, 0.5])
def test_every_schedule_respects_dependencies_and_starts_asap(schedule, chunks, comm):
    rng = np.random.default_rng(0)
    stages, micro = 3, 6
    fwd = rng.uniform(1, 3, stages * chunks)
    bwd = fwd * 2
    wgrad = bwd * rng.uniform(0.2, 0.6, stages * chunks)
    sim = simulate(fwd, bwd, micro, schedule=schedule, comm=comm, virtual_stages=chunks,
                   weight_grad=wgrad)
    split = schedule == "zb_h1"
    tasks = schedule_tasks(schedule, stages, micro, chunks)
    last = stages * chunks - 1
    end = {(e.kind, e.chunk * stages + d, e.microbatch): e.end
           for d, row in enumerate(sim.timeline) for e in row}
    for d, row in enumerate(sim.timeline):
        assert [Task(e.kind, e.microbatch, e.chunk) for e in row] == list(tasks[d])
        free = 0.0
        for e in row:
            j, m = e.chunk * stages + d, e.microbatch
            if e.kind == "W":
                ready, took = end[("B", j, m)], wgrad[j]
            elif e.kind == "F":
                ready, took = (0.0 if j == 0 else end[("F", j - 1, m)] + comm), fwd[j]
            else:
                ready = end[("F", j, m)] if j == last else end[("B", j + 1, m)] + comm
                took = bwd[j] - wgrad[j] if split else bwd[j]
            assert e.start == pytest.approx(max(free, ready))
            assert e.end == pytest.approx(e.start + took)
            free = e.end
    busy = micro * (fwd + bwd).reshape(chunks, stages).sum(axis=0)
    assert np.allclose(sim.idle, sim.iteration_time - busy)


def test_schedule_task_lists_and_their_errors():
    assert [" ".join(map(str, s)) for s in schedule_tasks("interleaved_1f1b", 2, 2, 2)] == [
        "F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1",
        "F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1",
    ]
    zb = schedule_tasks("zb_h1", 3, 4)
    assert [" ".join(map(str, s)) for s in zb] == [
        "F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3",
        "F0 F1 B0 F2 B1 W0 F3 B2 W1 B3 W2 W3",
        "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3",
    ]
    assert set(SCHEDULES) >= {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1"}
    with pytest.raises(ValueError, match="not a multiple of 2 stages"):
        schedule_tasks("interleaved_1f1b", 2, 3, 2)
    with pytest.raises(ValueError, match="virtual_stages >= 2"):
        schedule_tasks("interleaved_1f1b", 2, 2)
    with pytest.raises(ValueError, match="one chunk per device"):
        schedule_tasks("1f1b", 2, 2, 2)
    with pytest.raises(ValueError, match="at most its bwd"):
        simulate([1.0], [1.0], 1, schedule="zb_h1", weight_grad=[2.0])
    f, b, w = Task("F", 0), Task("B", 0), Task("W", 0)
    simulate([1.0], [1.0], 1, schedule=((f, b, w),))  # one stage, split: fine
    with pytest.raises(ValueError, match="exactly once"):  # a split schedule needs every W
        simulate([1.0, 1.0], [1.0, 1.0], 1, schedule=((f, b, w), (f, b)))
    with pytest.raises(ValueError, match="backward before"):
        simulate([1.0], [1.0], 1, schedule=((f, w, b),))
