"""RECOMPILE inside the real train loop: capacity recompiles, caching, rejected proposals."""

import jax
import numpy as np
import pytest

from dynjax.dynamism.moe.part import capacities_of
from dynjax.experiment import Experiment
from dynjax.recompile import Proposal
from dynjax.train import train
from dynjax.writers import read_jsonl

from ..helpers import events_of, train_with_warm_cache
from ..tiny import tiny_config

ROUTING = "parts.moe.cached_routing"  # its key in a Plan diff


@pytest.mark.slow
def test_capacity_change_without_drops_keeps_outputs_and_state():
    """Two Plans that differ only in (ample) capacities compute the same step."""
    exp = Experiment.from_config(tiny_config(moe__every=1, moe__capacity__factor=2.0))
    ample = exp.initial_plan()  # factor 2 with E=4, k=2: C = seq_len, nothing can drop
    batch = exp.device_batch(exp.order.batch(0))
    state = jax.device_get(exp.init_state())

    def run(plan):
        placed = exp.place_state(state)
        step = exp.lower_train_step(plan).compile()
        return jax.device_get(step(placed["params"], placed["opt_state"], batch))

    params_a, opt_a, metrics_a = run(ample)
    tight = np.maximum(metrics_a["moe/group_loads"].max(axis=1), 1)  # [L, E]: the most needed
    plan_b = ample.with_part("moe", capacities=tuple(map(tuple, tight.tolist())))
    assert plan_b != ample
    params_b, opt_b, metrics_b = run(plan_b)
    assert metrics_a["moe/dropped"].sum() == metrics_b["moe/dropped"].sum() == 0
    np.testing.assert_allclose(metrics_b["loss"], metrics_a["loss"], rtol=1e-6)
    for a, b in zip(
        jax.tree.leaves((params_a, opt_a)), jax.tree.leaves((params_b, opt_b)), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_dynamic_capacity_recompiles_in_the_background(tmp_path):
    # Start at 4 slots per expert against an average load of 16, so every expert drops in any
    # window; min = max factor leaves one bucket, so the policy always proposes the same Plan.
    cfg = tiny_config(
        moe__every=1,
        train__steps=300,
        moe__capacity__policy="dynamic",
        moe__capacity__window=2,
        moe__capacity__factor=0.25,
        moe__capacity__min_factor=1.5,
        moe__capacity__max_factor=1.5,
        train__log_every=10,
        train__checkpoint_every=300,
        train__eval_every=300,
        recompile__delta_launch=1,
    )
    workdir, summary = train_with_warm_cache(cfg, tmp_path)
    recompiles = events_of(workdir, "recompile")
    assert recompiles and summary.recompiles == len(recompiles)
    assert summary.compiled == sum(not r["cache_hit"] for r in recompiles)
    first = recompiles[0]
    assert first["steps_during_compile"] > 0 and first["swap_step"] > first["step"]
    assert any(k.startswith("parts.moe.capacities[") for k in first["plan_diff"])
    assert first["swap_stall_seconds"] < 1.0
    records = [r for r in read_jsonl(workdir / "metrics.jsonl") if "loss" in r]
    assert records[0]["capacity_factor"] == 0.25 and records[0]["dropped_fraction"] > 0.01
    assert records[-1]["capacity_factor"] == 1.5  # the run ended on the recompiled Plan


class InvalidPlan:
    """A user policy that asks for an expert capacity of zero."""

    name = "broken"

    def propose(self, history, plan):
        if history.latest_step is not None and history.latest_step >= 2:
            bad = tuple((0,) + caps[1:] for caps in capacities_of(plan))
            return Proposal(plan.with_part("moe", capacities=bad), "test")
        return None


@pytest.mark.slow
def test_invalid_proposal_is_rejected_and_training_finishes(tmp_path):
    cfg = tiny_config(moe__every=2, train__steps=8)
    summary = train(cfg, tmp_path, policies=[InvalidPlan()], progress=False)
    assert summary.final_step == 8 and summary.recompiles == 0
    rejected = events_of(tmp_path, "recompile_rejected")
    assert rejected and "capacities[0][0] = 0 is below 1" in rejected[0]["reason"]
    assert rejected[0]["policy"] == "broken"


@pytest.mark.slow
def test_caching_switches_on_when_routing_is_stable(tmp_path):
    # 48 training windows and a batch of 8: every sample comes back every 6 steps.
    cfg = tiny_config(
        moe__every=2,
        train__steps=300,
        data__max_tokens=1600,
        data__val_fraction=0.05,
        moe__caching__enabled=True,
        moe__caching__warmup_steps=0,
        moe__caching__window=2,
        moe__caching__on_threshold=0.5,
        moe__caching__off_threshold=0.1,
        train__learning_rate=1e-4,
        train__checkpoint_every=300,
        train__log_every=10,
        recompile__delta_launch=1,
    )
    workdir, _ = train_with_warm_cache(cfg, tmp_path)
    switches = [e for e in events_of(workdir, "recompile") if ROUTING in e["plan_diff"]]
    assert switches and switches[0]["plan_diff"][ROUTING] == [False, True]
    records = [r for r in read_jsonl(workdir / "metrics.jsonl") if "routing_stability" in r]
    assert records and all(0.0 <= r["routing_stability"] <= 1.0 for r in records)
    assert any(r["cached_routing"] for r in records)
    assert np.isfinite(records[-1]["loss"])
