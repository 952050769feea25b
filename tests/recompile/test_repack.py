"""The re-pack policy on synthetic profile histories (no devices, no training)."""

import numpy as np
import pytest

from dynjax.balance import simulate
from dynjax.recompile import History, Plan, Repack
from dynjax.recompile.memory import (
    LAYER_ACTIVATIONS,
    MICROBATCH_INPUT,
    STAGE_INPUTS,
    STAGE_MEMORY,
    STAGE_TEMP,
    layer_memory,
)
from dynjax.recompile.rebalance import (
    LAYER_BACKWARD,
    LAYER_FORWARD,
    STAGE_BACKWARD,
    STAGE_FORWARD,
    STAGE_LAYERS,
)

M = 4
PLAN = Plan(stage_layers=(2, 2, 2, 2), microbatches=M)
FROZEN_FRONT = [0.01] * 4 + [1.0] * 4  # layer freezing: the first half does (almost) nothing


def profile(fwd, counts, *, layer_bytes=10.0, input_bytes=1.0, temp=0.0, activations=None):
    """Profile metrics of a 1F1B step that ran ``counts``; backward = 2 x forward; every layer
    holds ``layer_bytes``, stage s keeps min(M, S - s) stage inputs of ``input_bytes``; of a
    stage's bytes ``temp`` are its programs' temporaries, shared by ``activations`` [L] (the
    layers' kept activations; default: none)."""
    fwd = np.asarray(fwd, dtype=float)
    bounds = np.concatenate(([0], np.cumsum(counts)))[:-1]
    kept = np.array([min(M, len(counts) - s) for s in range(len(counts))]) * input_bytes
    return {
        "loss": 1.0,
        LAYER_FORWARD: fwd,
        LAYER_BACKWARD: 2 * fwd,
        STAGE_FORWARD: np.add.reduceat(fwd, bounds),
        STAGE_BACKWARD: np.add.reduceat(2 * fwd, bounds),
        STAGE_LAYERS: np.array(counts),
        STAGE_MEMORY: np.array(counts) * layer_bytes + kept,
        STAGE_INPUTS: kept,
        MICROBATCH_INPUT: np.full(len(counts), input_bytes),
        STAGE_TEMP: np.full(len(counts), temp),
        LAYER_ACTIVATIONS: np.zeros(len(fwd)) if activations is None else np.array(activations),
    }


def history(fwd=FROZEN_FRONT, counts=(2, 2, 2, 2), latest=10, **kw):
    """Steps 0..latest with a profile of ``counts`` at step 0."""
    return History.of(
        (s, profile(fwd, counts, **kw) if s == 0 else {"loss": 1.0}) for s in range(latest + 1)
    )


def policy(**kw):
    args = dict(memory_bytes=1000.0, layer_state_bytes=[1.0] * 8, every=10)
    return Repack(**{**args, **kw})


def seconds(counts, fwd=FROZEN_FRONT):
    bounds = np.concatenate(([0], np.cumsum(counts)))[:-1]
    fwd = np.asarray(fwd)
    return simulate(np.add.reduceat(fwd, bounds), np.add.reduceat(2 * fwd, bounds), M)


def test_packs_idle_frozen_stages_without_slowing_the_step():
    proposal = policy().propose(history(), PLAN)
    assert proposal.plan == PLAN.replace(stage_layers=(4, 2, 2))
    (record,) = proposal.records
    assert record["event"] == "repack" and record["accepted"] and record["new"] == [4, 2, 2]
    assert record["predicted_new_seconds"] == seconds((4, 2, 2)).iteration_time
    assert record["predicted_new_seconds"] <= record["predicted_old_seconds"]
    assert record["moved_layers"] == [2, 3, 4, 5, 6, 7]
    # 1 and 2 stages were tried first and refused because the step would get slower
    assert [t["stages"] for t in record["tried"]] == [1, 2]
    assert all(t["why"].startswith("step") for t in record["tried"])
    # memory per new stage: its layers' bytes plus the stage inputs 1F1B keeps there (3, 2, 1)
    assert record["predicted_stage_memory_bytes"] == [43.0, 22.0, 21.0]


def test_an_allowed_slowdown_buys_fewer_devices():
    proposal = policy(max_slowdown=0.5).propose(history(), PLAN)
    assert proposal.plan.stage_layers == (6, 2)
    assert seconds((6, 2)).iteration_time <= 1.5 * seconds((2, 2, 2, 2)).iteration_time


def test_balanced_stages_are_not_packed_by_default():
    proposal = policy().propose(history(fwd=[1.0] * 8), PLAN)
    assert proposal.plan == PLAN and proposal.records[0]["accepted"] is False
    assert proposal.records[0]["new"] is None
    assert [t["stages"] for t in proposal.records[0]["tried"]] == [1, 2, 3]


def test_memory_decides_how_few_stages_fit():
    # 10 bytes per layer and up to 4 kept inputs of 1 byte: 3 stages need 33 bytes, 2 need 44
    proposal = policy(memory_bytes=40.0, max_slowdown=10.0).propose(history(), PLAN)
    (record,) = proposal.records
    assert len(proposal.plan.stage_layers) == 3
    assert [t["stages"] for t in record["tried"]] == [1, 2]
    assert all(t["why"].startswith("memory") for t in record["tried"])
    assert max(record["predicted_stage_memory_bytes"]) <= 40.0


def test_layer_memory_shares_a_stage_by_state_bytes():
    metrics = profile(FROZEN_FRONT, (2, 2, 2, 2), layer_bytes=10.0)
    weights = [1.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    shares = layer_memory(metrics, (2, 2, 2, 2), np.array(weights))
    np.testing.assert_allclose(shares, [5, 15, 10, 10, 10, 10, 10, 10])


def test_layer_memory_shares_temporaries_by_kept_activations():
    """A layer that recomputes its forward (`model.remat`) keeps less for its backward: its
    share of the stage's program temporaries is smaller, whatever its state bytes."""
    # Each stage holds 20 bytes: 8 of temporaries and 12 of state, over two equal-state layers;
    # layer 0 keeps 3 bytes of activations (rematerialised), layer 1 keeps 1 (more so), ...
    kept = [3.0, 1.0, 1.0, 1.0, 0.0, 0.0, 2.0, 6.0]
    metrics = profile(FROZEN_FRONT, (2, 2, 2, 2), temp=8.0, activations=kept)
    shares = layer_memory(metrics, (2, 2, 2, 2), np.ones(8))
    np.testing.assert_allclose(shares, [12, 8, 10, 10, 10, 10, 8, 12])


def test_target_asks_for_a_stage_count_and_device_seconds_must_not_grow():
    three = Plan(stage_layers=(1, 1, 1), microbatches=8)
    fwd = [1.0, 1.0, 1.0]
    entries = [(0, profile(fwd, (1, 1, 1))), (10, {"loss": 1.0})]
    # two stages hold 2 + 1 layers: twice the step on 2/3 of the devices costs more per step
    proposal = policy(layer_state_bytes=[1.0] * 3, target=2, max_slowdown=10.0).propose(
        History.of(entries), three
    )
    (record,) = proposal.records
    assert proposal.plan == three and record["tried"][0]["why"].startswith("device-seconds")
    one = policy(layer_state_bytes=[1.0] * 3, target=1, max_slowdown=10.0)
    assert one.propose(History.of(entries), three).plan.stage_layers == (3,)


def test_decides_once_per_period_in_the_first_round_after_its_multiple():
    repack = policy(every=10)
    assert repack.propose(history(latest=3), PLAN) is not None  # period 0: the first round
    assert repack.propose(history(latest=9), PLAN) is None  # decided in this period already
    # No round saw step 10 as its newest (metrics observed in a batch, or a compile pending):
    # the first round after it decides, not the one after step 20.
    assert repack.propose(history(latest=13), PLAN).records[0]["event"] == "repack"
    assert repack.propose(history(latest=19), PLAN) is None
    # Without a profile of the current layout at the round after step 20, it decides when one
    # arrives, in the same period.
    assert repack.propose(history(latest=21, counts=(4, 2, 1, 1)), PLAN) is None
    assert repack.propose(history(latest=22), PLAN) is not None


def test_decides_only_on_a_profile_of_the_current_layout():
    assert policy().propose(history(counts=(4, 2, 1, 1)), PLAN) is None  # another layout
    assert policy().propose(history(), Plan(stage_layers=(8,))) is None  # nothing to merge
    without_memory = History.of(
        (s, {k: v for k, v in m.items() if k != STAGE_MEMORY}) for s, m in history().entries
    )
    assert policy().propose(without_memory, PLAN) is None


def test_bad_arguments_fail_clearly():
    with pytest.raises(ValueError, match="memory_bytes"):
        policy(memory_bytes=0)
    with pytest.raises(ValueError, match="max_slowdown"):
        policy(max_slowdown=-1)
