"""Controller: background recompiles swapped in at step boundaries, rejections, budget, errors."""

import functools
import json
import threading
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dynjax.dynamism.moe.capacity import DynamicCapacity
from dynjax.dynamism.moe.part import (
    MoEContext,
    cached_routing_of,
    capacities_of,
    plan_problems,
    static_capacities,
)
from dynjax.recompile import (
    Budget,
    Compiler,
    Controller,
    EventLog,
    Monitor,
    Plan,
    PlanContext,
    Proposal,
    Rebalance,
)

from ..helpers import SetMicrobatches, Toggle, ToyLowerer, profile

CTX = PlanContext(batch_size=4)
GENEROUS = Budget(max_recompiles=10, window_steps=100)


class Broken:
    name = "broken"

    def propose(self, history, plan):
        raise ZeroDivisionError("policy bug")


@dataclass
class Run:
    events: list[dict] = field(default_factory=list)
    outputs: list[float] = field(default_factory=list)  # per step: which executable ran
    step_times: list[float] = field(default_factory=list)  # per step: when it was launched
    swap_times: list[float] = field(default_factory=list)
    plan: Plan | None = None

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["event"] == kind]


def train(
    policies,
    *,
    steps: int = 60,
    lowerer: ToyLowerer | None = None,
    budget: Budget = GENEROUS,
    step_seconds: float = 0.005,
    validate=lambda p: p.validate(CTX),
    emit=None,
    blocking: bool = False,
) -> Run:
    """A toy training loop wired as the lead's loop will be."""
    run = Run()
    lowerer = lowerer or ToyLowerer()
    compiler = Compiler(lowerer)
    plan = Plan()
    executable = compiler.get(plan).executable
    controller = Controller(
        plan,
        compiler,
        policies,
        emit=emit or run.events.append,
        validate=validate,
        budget=budget,
        blocking=blocking,
    )
    monitor = Monitor(delta=2)
    controller.start()
    x = jnp.ones(4)
    try:
        for step in range(steps):
            swap = controller.poll(step)
            if swap is not None:
                run.swap_times.append(time.perf_counter())
                executable = swap.executable
                controller.swap_done(swap)
            run.step_times.append(time.perf_counter())
            out = executable(x)
            monitor.push(step, {"out": out[0]})
            for s, metrics in monitor.pop_ready(step):
                controller.observe(s, metrics)
            run.outputs.append(float(out[0]))
            time.sleep(step_seconds)
        for s, metrics in monitor.drain():
            controller.observe(s, metrics)
        assert controller.wait_idle(timeout=30)
    finally:
        controller.stop()
        compiler.shutdown()
    run.plan = controller.plan
    return run


def test_slow_compile_overlaps_training_and_swaps_at_a_boundary():
    lowerer = ToyLowerer(compile_delay=0.5)
    run = train([SetMicrobatches(2, after=3)], steps=200, lowerer=lowerer)
    (event,) = run.of("recompile")
    assert run.plan == Plan(microbatches=2)
    proposed, swapped = event["step"], event["swap_step"]
    # the old executable kept training while the new one compiled
    assert event["steps_during_compile"] == swapped - proposed > 0
    assert set(run.outputs[proposed:swapped]) == {1.0}
    # from the swap step on, every step ran the new executable
    assert set(run.outputs[swapped:]) == {2.0} and run.outputs[swapped - 1] == 1.0
    # steps were launched while the compile ran, and the swap came only after it
    start, end = lowerer.compile_spans[-1]
    assert sum(start < t < end for t in run.step_times) >= 5
    assert run.swap_times[0] >= end
    assert event["compile_seconds"] >= 0.5 and event["lower_seconds"] > 0
    assert 0 <= event["swap_stall_seconds"] < 0.5
    assert event["plan_diff"] == {"microbatches": (1, 2)}
    assert event["reason"] == "set_microbatches: test wants it"
    assert event["plan"] == Plan(microbatches=2).to_dict()
    assert not event["cache_hit"]
    assert event["metrics_step"] <= proposed - 2  # the policy saw metrics Δ = 2 steps old
    # lowering ran on the policy thread, not on the training thread
    assert lowerer.lower_threads[-1] == "dynjax-controller"


@pytest.mark.parametrize("compile_delay, step_seconds", [(0.3, 0.0), (0.0, 0.02)])
def test_blocking_swaps_at_the_step_the_metrics_decide_whatever_the_timing(
    compile_delay, step_seconds
):
    """recompile.blocking: the step after the policy's metrics arrive waits for the round and
    the compile, on a slow compile and on a slow step alike."""
    lowerer = ToyLowerer(compile_delay=compile_delay)
    run = train([SetMicrobatches(2, after=3)], steps=12, lowerer=lowerer,
                step_seconds=step_seconds, blocking=True)
    (event,) = run.of("recompile")
    # step 3's metrics are observed after step 5 (delta 2): the boundary before step 6 waits
    assert (event["metrics_step"], event["step"], event["swap_step"]) == (3, 5, 6)
    assert event["swap_stall_seconds"] >= compile_delay
    assert run.outputs == [1.0] * 6 + [2.0] * 6


def test_invalid_proposal_is_rejected_and_training_goes_on():
    run = train([SetMicrobatches(3)], steps=30)  # 3 does not divide the batch of 4
    assert run.plan == Plan() and not run.of("recompile")
    rejected = run.of("recompile_rejected")
    assert len(rejected) == 1 and "does not divide" in rejected[0]["reason"]  # logged once
    assert rejected[0]["policy"] == "set_microbatches"
    assert rejected[0]["plan_diff"] == {"microbatches": (1, 3)}
    assert run.outputs == [1.0] * 30


def test_budget_rejects_the_recompile_after_the_last_allowed():
    run = train([Toggle()], steps=60, budget=Budget(max_recompiles=2, window_steps=1000))
    assert len(run.of("recompile")) == 2
    over = [e for e in run.of("recompile_rejected") if e["reason"] == "budget"]
    # Toggle asks for the same Plan every round: refused and logged once, not once per round.
    assert len(over) == 1 and over[0]["policy"] == "toggle"
    assert run.of("recompile")[0]["reason"] == "toggle"  # a bare Plan states no reason
    assert len(run.outputs) == 60


def test_budget_counts_only_recompiles_inside_the_window():
    budget = Budget(max_recompiles=2, window_steps=10)
    assert budget.allows([], 0)
    assert budget.allows([0], 5)
    assert not budget.allows([0, 5], 9)
    assert budget.allows([0, 5], 10)  # step 0 has left the window
    with pytest.raises(ValueError):
        Budget(1, 0)


def test_policy_exception_is_reported_and_other_policies_still_work():
    run = train([Broken(), SetMicrobatches(2)], steps=60)
    errors = run.of("policy_error")
    assert errors and errors[0]["policy"] == "broken" and "policy bug" in errors[0]["error"]
    assert run.plan == Plan(microbatches=2) and len(run.of("recompile")) == 1


def test_one_round_compiles_the_changes_of_all_policies_together():
    @dataclass
    class Cached:
        name: str = "cache"

        def propose(self, history, plan):
            return None if cached_routing_of(plan) else plan.with_part("moe", cached_routing=True)

    run = train([SetMicrobatches(2), Cached()], steps=60)
    (event,) = run.of("recompile")
    assert event["plan_diff"] == {
        "microbatches": (1, 2),
        "parts.moe.cached_routing": (None, True),
    }
    assert event["policy"] == "set_microbatches+cache"
    assert event["reason"] == "set_microbatches: test wants it; cache"


def test_returning_to_a_cached_plan_is_a_cache_hit():
    run = train([Toggle()], steps=80, budget=Budget(max_recompiles=3, window_steps=1000))
    hits = [e["cache_hit"] for e in run.of("recompile")]
    assert hits == [False, True, True]  # Plan() was compiled before training started


def test_lowering_failure_is_an_event_not_a_crash():
    run = train([SetMicrobatches(2)], steps=20, lowerer=ToyLowerer(fail=True))
    failed = run.of("recompile_failed")
    assert failed and "cannot trace" in failed[0]["error"]
    assert run.outputs == [1.0] * 20


def test_controller_bugs_surface_on_the_training_thread():
    def validate(plan):
        raise KeyError("not a ValueError: a bug in validate, not a rejection")

    with pytest.raises(RuntimeError, match="controller thread failed"):
        train([SetMicrobatches(2)], steps=40, validate=validate)


def test_events_are_json_lines(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    train([SetMicrobatches(3), Broken()], steps=10, emit=log)
    train([SetMicrobatches(2)], steps=40, emit=log)
    events = log.read()
    kinds = {e["event"] for e in events}
    assert {"recompile", "recompile_rejected", "policy_error"} <= kinds
    assert all("time" in e for e in events)
    (recompile,) = [e for e in events if e["event"] == "recompile"]
    assert recompile["plan_diff"] == {"microbatches": [1, 2]}
    assert Plan.from_dict(recompile["plan"]) == Plan(microbatches=2)
    for line in open(log.path):
        json.loads(line)


def test_dynamic_capacity_end_to_end_on_a_toy_moe_step():
    """The capacity policy drives recompiles of a step whose shapes depend on capacities."""
    ctx = MoEContext(num_moe_layers=1, num_experts=4, top_k=1, group_tokens=64)
    moe_check = functools.partial(plan_problems, ctx=ctx)
    rng = np.random.default_rng(0)
    share = np.array([0.45, 0.3, 0.2, 0.05])
    loads = rng.multinomial(64, share, size=(400, 1, 8))  # [steps, L, G, E]

    def lower_fn(plan):
        caps = np.asarray(capacities_of(plan))

        def step(group_loads):  # [L, G, E]: a stand-in for MoE layers compiled for `caps`
            kept = jnp.minimum(group_loads, caps[:, None, :]).sum()
            return {"moe/group_loads": group_loads, "dropped": group_loads.sum() - kept}

        return jax.jit(step).lower(jax.ShapeDtypeStruct((1, 8, 4), jnp.int32))

    plan = Plan().with_part("moe", capacities=static_capacities(ctx, 1.0))
    compiler = Compiler(lower_fn)
    executable = compiler.get(plan).executable
    events: list[dict] = []
    policy = DynamicCapacity(ctx, target_drop_rate=0.01, window=10, max_factor=3.0)
    controller = Controller(
        plan,
        compiler,
        [policy],
        emit=events.append,
        validate=lambda p: p.validate(PlanContext(batch_size=8, checks=(moe_check,))),
        budget=Budget(4, 1000),
    )
    monitor = Monitor(delta=2)
    dropped = []
    controller.start()
    try:
        for step in range(len(loads)):
            swap = controller.poll(step)
            if swap is not None:
                executable = swap.executable
                controller.swap_done(swap)
            monitor.push(step, executable(jnp.asarray(loads[step], jnp.int32)))
            for s, metrics in monitor.pop_ready(step):
                controller.observe(s, metrics)
                dropped.append(float(metrics["dropped"]) / loads[s].sum())
            time.sleep(0.002)
        assert controller.wait_idle(timeout=30)
    finally:
        controller.stop()
        compiler.shutdown()
    recompiles = [e for e in events if e["event"] == "recompile"]
    assert 1 <= len(recompiles) <= 2, events
    caps = np.asarray(capacities_of(controller.plan)[0])
    assert caps[0] > 16 > caps[3]  # the hot expert grew, the cold one shrank
    assert np.mean(dropped[-100:]) <= 0.01 < np.mean(dropped[:10])


def test_policy_records_are_emitted_whether_or_not_the_plan_changes():
    @dataclass
    class Decides:
        """Records a decision every round until it has moved; moves from metrics step 10."""

        name: str = "decides"

        def propose(self, history, plan):
            if plan.microbatches == 2:
                return None
            move = history.latest_step >= 10
            new = plan.replace(microbatches=2) if move else plan
            return Proposal(new, "why", records=({"event": "decision", "moved": move},))

    run = train([Decides()], steps=60)
    decisions = run.of("decision")
    kept = [e for e in decisions if not e["moved"]]
    assert kept and all(e["metrics_step"] < 10 and e["policy"] == "decides" for e in kept)
    (moved,) = [e for e in decisions if e["moved"]]
    assert moved["metrics_step"] >= 10
    (recompile,) = run.of("recompile")
    assert recompile["plan_diff"] == {"microbatches": (1, 2)} and run.plan.microbatches == 2
    assert recompile["metrics_step"] == moved["metrics_step"]


class Gate:
    """A slow policy round on purpose: `propose` waits until the gate is open."""

    name = "gate"

    def __init__(self):
        self.entered, self.open = threading.Event(), threading.Event()
        self.open.set()

    def propose(self, history, plan):
        self.entered.set()
        assert self.open.wait(timeout=30)
        return None


def test_a_periodic_decision_comes_in_the_first_round_after_its_step():
    """Rebalance every 10 metrics steps, though no round's newest step is a multiple of 10: no
    round runs while a compile is pending, and steps arrive while a round is busy."""
    plan = Plan(stage_layers=(3, 1), microbatches=4)
    compiler = Compiler(ToyLowerer())
    compiler.get(plan)
    events: list[dict] = []
    gate = Gate()
    rebalance = Rebalance(
        total_steps=1000, layer_bytes=[100] * 4, every=10, amortize_steps=10**9
    )
    controller = Controller(
        plan,
        compiler,
        [gate, rebalance],
        emit=events.append,
        validate=lambda p: None,
        budget=GENEROUS,
    )
    ones = [1.0] * 4

    def observe(steps, profiled=None, counts=(3, 1)):
        for s in steps:
            controller.observe(s, profile(ones, counts) if s == profiled else {"loss": 1.0})

    controller.start()
    try:
        observe([0], profiled=0)  # the first Plan's profile: (3, 1) -> (2, 2), compiled
        assert controller.wait_idle(timeout=30) and controller.pending is not None
        for s in range(1, 13):  # step 10 passes while the compile is pending: no round
            observe([s])
            assert controller.wait_idle(timeout=30)
        deadline = time.monotonic() + 30
        while (swap := controller.poll(13)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        controller.swap_done(swap)
        observe([13], profiled=13, counts=(2, 2))  # the new Plan's first step is profiled
        assert controller.wait_idle(timeout=30)
        gate.open.clear()
        gate.entered.clear()
        observe([14])
        assert gate.entered.wait(timeout=30)  # a round on steps up to 14 is busy ...
        observe(range(15, 26))  # ... while steps 15-25 arrive: step 20 is never the newest
        gate.open.set()
        assert controller.wait_idle(timeout=30)
    finally:
        controller.stop()
        compiler.shutdown()
    decisions = [e for e in events if e["event"] == "rebalance"]
    assert [e["metrics_step"] for e in decisions] == [0, 13, 25]
    assert [e["old"] for e in decisions] == [[3, 1], [2, 2], [2, 2]]
    assert [e["profile_step"] for e in decisions] == [0, 13, 13]
    assert all(e["trigger"] == "every" for e in decisions)
    assert controller.plan.stage_layers == (2, 2)
