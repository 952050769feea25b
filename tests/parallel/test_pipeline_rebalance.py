"""Dynamic load balancing inside dynjax.train: layers move, learning does not change (DynMo)."""

import numpy as np
import pytest

from dynjax.train import train
from dynjax.writers import read_jsonl

from ..helpers import layer_moves
from ..tiny import tiny_config


@pytest.mark.slow
def test_rebalance_by_time_migrates_layers_and_keeps_the_losses(tmp_path):
    config = dict(
        model__num_layers=5, mesh__stage=2, mesh__data=2, train__steps=40,
        train__microbatches=4, train__log_every=1, train__eval_every=40,
        train__checkpoint_every=40, recompile__delta_launch=1,
        # the swap waits for its compile: it lands within a few steps on any machine
        recompile__blocking=True,
    )
    # Without balancing, on the balanced layout (migration is exact, so the layout changes no
    # loss).
    reference = tmp_path / "reference"
    train(tiny_config(**config, pipeline__stage_layers="(3,2)"), reference, progress=False)
    balanced = tmp_path / "balanced"
    summary = train(
        tiny_config(
            **config,
            pipeline__stage_layers="(4,1)",  # deliberately unbalanced
            # A fresh profile every 10 steps: one profile that a busy machine skewed (a unit can
            # measure several times its time while another test compiles) is not the last word.
            pipeline__profile_every=10,
            balance__enabled=True, balance__every=5, balance__by="time",
            balance__amortize_steps=10**9,
        ),
        balanced,
        progress=False,
    )
    events = read_jsonl(balanced / "events.jsonl")
    decisions = [e for e in events if e["event"] == "rebalance"]
    assert decisions[0]["old"] == [4, 1] and decisions[0]["profile_step"] == 0
    periods = [e["metrics_step"] // 5 for e in decisions if e["trigger"] == "every"]
    assert periods == sorted(set(periods))  # one periodic decision per balance.every steps
    # The best split depends on the measured layer times; any better one will do.
    first = next(e for e in decisions if e["accepted"])
    old, new = first["old"], first["new"]
    assert old == [4, 1] and new != old and sum(new) == 5, first
    assert first["predicted_new_seconds"] < first["predicted_old_seconds"]
    assert first["policy"] == "rebalance"
    migrate = [e for e in events if e["event"] == "migrate"]
    assert summary.recompiles >= 1 and migrate, events
    assert migrate[0]["moves"] == layer_moves(old, new) and migrate[0]["step"] < 40
    # Later decisions judge the new layout on its own profile, measured after the move.
    later = [e for e in decisions if e["profile_step"] >= migrate[0]["step"]]
    assert later and later[0]["old"] == new and later[0]["measured_seconds"] > 0
    losses = lambda w: [r["loss"] for r in read_jsonl(w / "metrics.jsonl") if "loss" in r]
    assert len(losses(balanced)) == 40
    np.testing.assert_allclose(losses(balanced), losses(reference), rtol=1e-5)
