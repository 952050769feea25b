"""Multi-process Plan swaps (issue 15 §4): process 0 decides, every process compiles, all swap
at the same step. Processes are threads here, exchanging through an in-memory store with the
semantics of the coordinator's (`dynjax.launch.distributed`); the 2-process runs are in
tests/recompile/test_multiprocess.py."""

import threading
import time

import pytest

from dynjax.recompile import Budget, Compiler, Controller, Plan
from dynjax.recompile.agreement import Announcement, Status, verdict

from ..helpers import SetMicrobatches, Store, Toggle, ToyLowerer

GENEROUS = Budget(max_recompiles=100, window_steps=100)


def run_processes(lowerers, policies, steps=60, step_seconds=0.02, lag=1):
    """Train `steps` toy steps on one thread per process; returns per process the (step, Plan)
    of each swap and its events."""
    store = Store(len(lowerers))
    out = [None] * len(lowerers)

    def process(index):
        events = []
        compiler = Compiler(lowerers[index])
        controller = Controller(
            Plan(),
            compiler,
            policies[index],
            emit=events.append,
            validate=lambda p: None,
            budget=GENEROUS,
            peers=store.peers(index),
            lag=lag,
        )
        controller.start()
        swaps = []
        try:
            for step in range(steps):
                swap = controller.poll(step)
                if swap is not None:
                    swaps.append((step, swap.plan, time.perf_counter()))
                    controller.swap_done(swap)
                controller.observe(step, {"loss": 0.0})
                time.sleep(step_seconds)
        finally:
            controller.stop()
            compiler.shutdown()
        out[index] = (swaps, events)

    threads = [threading.Thread(target=process, args=(i,)) for i in range(len(lowerers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(o is not None for o in out), "a process did not finish"
    return out


@pytest.mark.parametrize("lag", [1, 3])
def test_every_process_swaps_to_the_leaders_plan_at_the_same_step_once_all_compiled(lag):
    slow = ToyLowerer(compile_delay=0.5)  # process 1 compiles for ~25 steps
    # Process 1's own policy would choose 3 microbatches: only the leader's (2) counts.
    (swaps0, events0), (swaps1, events1) = run_processes(
        [ToyLowerer(), slow], [[SetMicrobatches(2)], [SetMicrobatches(3)]], lag=lag
    )
    plans = [[(s, p.microbatches) for s, p, _ in swaps] for swaps in (swaps0, swaps1)]
    assert plans[0] == plans[1]
    [(step, plan, swapped_at)] = swaps0
    assert plan.microbatches == 2
    # Not before the slower process held its executable: the leader's own compile was done
    # ~25 steps earlier.
    [(_, compiled_at)] = slow.compile_spans
    assert swapped_at >= compiled_at and step >= 20
    for events in (events0, events1):
        [recompile] = [e for e in events if e["event"] == "recompile"]
        assert recompile["swap_step"] == step and recompile["plan"]["microbatches"] == 2
    assert not [e for e in events1 if e["event"] == "recompile_rejected"]  # it ran no policy


@pytest.mark.parametrize("lag", [1, 3])
def test_plans_that_follow_each_other_swap_at_the_same_steps_everywhere(lag):
    """A new Plan comes within `lag` boundaries of the last swap, whose statuses still say
    ready: they must not swap it again."""
    (swaps0, _), (swaps1, _) = run_processes(
        [ToyLowerer(), ToyLowerer()], [[Toggle()], [Toggle()]], steps=40, lag=lag
    )
    plans = [[(s, p.microbatches) for s, p, _ in swaps] for swaps in (swaps0, swaps1)]
    assert plans[0] == plans[1] and len(plans[0]) >= 3
    assert [m for _, m in plans[0]] == [2, 1, 2, 1, 2, 1, 2, 1, 2, 1][: len(plans[0])]


def test_a_plan_one_process_cannot_build_is_dropped_by_every_process():
    (swaps0, events0), (swaps1, events1) = run_processes(
        [ToyLowerer(), ToyLowerer(fail=True)],
        [[SetMicrobatches(2)], [SetMicrobatches(2)]],
        steps=20,
    )
    assert swaps0 == swaps1 == []
    failed = [[e for e in ev if e["event"] == "recompile_failed"] for ev in (events0, events1)]
    assert failed[0] and [e["step"] for e in failed[0]] == [e["step"] for e in failed[1]]
    assert all(e["process"] == 1 and "cannot trace" in e["error"] for e in failed[0] + failed[1])
    # The leader tried again after each drop (the policy still wants it): not stuck on the
    # first failure.
    assert len(failed[0]) >= 2


ANNOUNCED = Announcement(1, Plan(microbatches=2), 3, 2, "r", "p")


@pytest.mark.parametrize(
    "statuses, want",
    [
        ([Status(ANNOUNCED, ready=1), Status()], dict(announced=ANNOUNCED)),
        ([Status(ready=1), Status(ready=1), Status(ready=1)], dict(swap=1)),
        ([Status(ready=1), Status(), Status(ready=1)], {}),
        ([Status(ready=1), Status(failed=(1, "E"))], dict(failed=(1, 1, "E"))),
        ([Status(ANNOUNCED, failed=(1, "E")), Status()], dict(announced=ANNOUNCED,
                                                              failed=(1, 0, "E"))),
        ([Status(), Status()], {}),
    ],
)
def test_the_verdict_swaps_only_when_all_are_ready_and_a_failure_wins(statuses, want):
    found = verdict(statuses)
    assert (found.announced, found.swap, found.failed) == (
        want.get("announced"),
        want.get("swap"),
        want.get("failed"),
    )
