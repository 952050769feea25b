"""The rebalance policy on synthetic profile histories (no devices, no training)."""

import doctest

import numpy as np
import pytest

from dynjax.balance import simulate
from dynjax.recompile import History, Plan, Rebalance, moved_layers
from dynjax.recompile import rebalance as rebalance_module
from dynjax.recompile.memory import (
    LAYER_ACTIVATIONS,
    MICROBATCH_INPUT,
    STAGE_INPUTS,
    STAGE_MEMORY,
    STAGE_TEMP,
)

from ..helpers import profile

PLAN = Plan(stage_layers=(3, 1), microbatches=4)


def history(profiled, latest, counts=(3, 1), fwd=(1.0, 1.0, 1.0, 1.0)):
    """Steps 0..latest, with a profile of ``counts`` at step ``profiled``."""
    return History.of(
        (s, profile(fwd, counts) if s == profiled else {"loss": 1.0}) for s in range(latest + 1)
    )


def policy(**kw):
    args = dict(total_steps=1000, layer_bytes=[100] * 4, every=10, amortize_steps=10**9)
    return Rebalance(**{**args, **kw})


def test_large_gain_proposes_the_optimum_and_records_the_decision():
    proposal = policy().propose(history(0, 10), PLAN)
    assert proposal.plan == PLAN.replace(stage_layers=(2, 2))
    (record,) = proposal.records
    assert record["event"] == "rebalance" and record["accepted"]
    assert record["old"] == [3, 1] and record["new"] == [2, 2] and record["moved_layers"] == [2]
    assert record["moved_bytes"] == 100 and record["profile_step"] == 0
    # the simulator's 1F1B times of both layouts, from the profiled per-layer times
    assert record["predicted_old_seconds"] == simulate([3, 1], [6, 2], 4).iteration_time
    assert record["predicted_new_seconds"] == simulate([2, 2], [4, 4], 4).iteration_time
    assert record["predicted_new_seconds"] < record["predicted_old_seconds"]
    assert record["measured_seconds"] == 1.0 and record["measured_imbalance"] == 1.0


def test_gain_below_the_move_cost_keeps_the_plan_and_says_so():
    old = simulate([3, 1], [6, 2], 4).iteration_time
    new = simulate([2, 2], [4, 4], 4).iteration_time
    steps = 1  # a gain of (old - new) = 6 s against 1 s of copying plus 10 s of recompiling
    assert (old - new) * steps < 11
    rebalance = policy(amortize_steps=steps, bandwidth_bytes_per_sec=100, recompile_seconds=10)
    proposal = rebalance.propose(history(0, 10), PLAN)
    assert proposal.plan == PLAN
    (record,) = proposal.records
    assert not record["accepted"] and record["new"] == [2, 2]
    assert record["move_cost_seconds"] == 11 and record["gain_seconds"] == (old - new) * steps
    # the same move pays off when the rest of a long run amortizes it (amortize_steps = 0)
    assert policy(amortize_steps=0).propose(history(0, 10), PLAN).plan != PLAN


def test_balanced_layout_records_a_decision_without_a_move():
    proposal = policy().propose(history(0, 10, counts=(2, 2)), PLAN.replace(stage_layers=(2, 2)))
    (record,) = proposal.records
    assert proposal.plan.stage_layers == (2, 2) and not record["accepted"]
    assert record["moved_layers"] == [] and record["move_cost_seconds"] == 0


def test_decides_once_per_period_in_the_first_round_after_its_multiple():
    rebalance = policy(every=10)
    assert rebalance.propose(history(0, 3), PLAN) is not None  # period 0: the first round
    assert rebalance.propose(history(0, 9), PLAN) is None  # decided in this period already
    # No round saw step 10 as its newest (metrics observed in a batch, or a compile pending):
    # the first round after it decides, not the one after step 20.
    assert rebalance.propose(history(0, 13), PLAN).records[0]["trigger"] == "every"
    assert rebalance.propose(history(0, 19), PLAN) is None
    assert rebalance.propose(history(0, 35), PLAN) is not None  # 20 and 30 unseen: once
    assert rebalance.propose(history(0, 39), PLAN) is None
    # At the round after step 40 the new layout's profile had not arrived: it decides when it
    # does, in the same period.
    moved = PLAN.replace(stage_layers=(2, 2))
    assert rebalance.propose(history(0, 41), moved) is None
    assert rebalance.propose(history(42, 43, counts=(2, 2)), moved).records[0]["old"] == [2, 2]
    assert rebalance.propose(history(42, 49, counts=(2, 2)), moved) is None


def test_decides_only_on_a_profile_of_the_current_layout():
    # the newest profile ran another layout (the new Plan's profile has not arrived yet)
    assert policy().propose(history(0, 10, counts=(2, 2)), PLAN) is None
    assert policy().propose(History(), PLAN) is None
    assert policy().propose(history(0, 10), Plan()) is None  # no pipeline


def test_threshold_decides_once_on_each_unbalanced_profile():
    rebalance = policy(every=0, threshold=0.5)  # measured imbalance of (3, 1) is 1.0
    proposal = rebalance.propose(history(7, 7), PLAN)
    assert proposal.plan.stage_layers == (2, 2) and proposal.records[0]["trigger"] == "threshold"
    assert rebalance.propose(history(7, 8), PLAN) is None  # decided on that profile already
    # A profile first seen in a round whose newest step is later (metrics observed in a batch).
    late = policy(every=0, threshold=0.5).propose(history(7, 9), PLAN)
    assert late.records[0]["profile_step"] == 7 and late.records[0]["trigger"] == "threshold"
    assert policy(every=0, threshold=1.5).propose(history(7, 7), PLAN) is None


def test_a_profile_whose_timeline_measured_nothing_triggers_no_decision():
    """Without stage times (`Profile.timeline_measured` False) the threshold has nothing to
    judge; a periodic decision still runs on the profile's unit times."""
    unmeasured = lambda latest: History.of(
        (s, _without_timeline(profile((1.0,) * 4, (3, 1))) if s == 7 else {"loss": 1.0})
        for s in range(latest + 1)
    )
    assert policy(every=0, threshold=0.5).propose(unmeasured(7), PLAN) is None
    periodic = policy(every=10).propose(unmeasured(10), PLAN)
    assert periodic.plan.stage_layers == (2, 2)
    assert periodic.records[0]["measured_imbalance"] is None
    assert periodic.records[0]["measured_seconds"] is None


def _without_timeline(metrics):
    gone = (rebalance_module.STAGE_FORWARD, rebalance_module.STAGE_BACKWARD,
            rebalance_module.ITERATION)
    return {k: v for k, v in metrics.items() if k not in gone}


def test_by_param_partitions_parameter_counts():
    # times say (2, 2); parameter counts put the heavy last layer alone
    rebalance = policy(by="param", layer_params=[1, 1, 1, 5])
    proposal = rebalance.propose(history(0, 10, counts=(2, 2)), PLAN.replace(stage_layers=(2, 2)))
    assert proposal.records[0]["new"] == [3, 1]
    assert proposal.plan.stage_layers == (2, 2)  # by times, (3, 1) is slower: refused
    with pytest.raises(ValueError, match="layer_params"):
        policy(by="param")


def test_diffusion_moves_towards_the_less_loaded_neighbour():
    plan = Plan(stage_layers=(4, 1, 1), microbatches=4)
    fwd = [1.0] * 6
    proposal = policy(method="diffusion", layer_bytes=[100] * 6).propose(
        history(0, 10, counts=(4, 1, 1), fwd=fwd), plan
    )
    assert proposal.plan.stage_layers == (2, 2, 2)
    assert proposal.records[0]["method"] == "diffusion"


def test_comm_is_counted_in_stage_costs():
    # a costly hop is part of the sender's cost: (2, 2) costs max(6 + 4, 6), (1, 3) max(3 + 4, 9)
    fwd = [1.0, 1.0, 1.0, 1.0]
    plan = PLAN.replace(stage_layers=(2, 2))
    proposal = policy(comm_seconds=4.0).propose(history(0, 10, counts=(2, 2), fwd=fwd), plan)
    assert proposal.records[0]["new"] == [1, 3]


def test_docstring_examples():
    result = doctest.testmod(rebalance_module)
    assert result.attempted > 0 and result.failed == 0


def test_moved_layers():
    assert moved_layers((2, 1, 1), (1, 2, 1)) == [1]
    assert moved_layers((1, 1, 4), (3, 2, 1)) == [1, 2, 3, 4]
    assert moved_layers((2, 2), (2, 2)) == []


def test_embedding_and_head_times_count_in_their_stages():
    metrics = profile([1.0, 1.0, 1.0, 1.0], (2, 2))
    # A head (norm, large-vocabulary projection, loss) as costly as two layers.
    metrics[rebalance_module.HEAD] = np.array([2.0, 4.0])
    metrics[rebalance_module.EMBED] = np.array([0.1, 0.2])
    fwd, bwd = rebalance_module.layer_times(metrics)
    np.testing.assert_allclose(fwd, [1.1, 1.0, 1.0, 3.0])
    np.testing.assert_allclose(bwd, [2.2, 2.0, 2.0, 6.0])
    entries = [(0, metrics), (10, {"loss": 1.0})]
    proposal = policy().propose(History.of(entries), PLAN.replace(stage_layers=(2, 2)))
    assert proposal.plan.stage_layers == (3, 1)  # the head's stage gives up a layer


def test_a_faster_layout_that_overflows_memory_is_not_proposed():
    metrics = profile([1.0, 1.0, 1.0, 1.0], (3, 1))
    # Measured per device: three 10-byte layers on stage 0, one 50-byte layer on stage 1, and
    # the stage inputs 1F1B keeps (2 and 1 microbatches of 1 byte).
    metrics[STAGE_MEMORY] = np.array([32.0, 51.0])
    metrics[STAGE_INPUTS] = np.array([2.0, 1.0])
    metrics[MICROBATCH_INPUT] = np.array([1.0, 1.0])
    metrics[STAGE_TEMP] = np.zeros(2)  # every byte shared by state
    metrics[LAYER_ACTIVATIONS] = np.zeros(4)
    entries = History.of([(0, metrics), (10, {"loss": 1.0})])
    state = [1.0, 1.0, 1.0, 5.0]
    # (2, 2) would put 10 + 50 bytes and 1 kept input on stage 1: over a 55-byte device.
    tight = policy(memory_bytes=55.0, layer_state_bytes=state).propose(entries, PLAN)
    (record,) = tight.records
    assert tight.plan == PLAN and record["new"] == [3, 1] and not record["accepted"]
    assert record["memory_checked"]
    roomy = policy(memory_bytes=100.0, layer_state_bytes=state).propose(entries, PLAN)
    assert roomy.plan.stage_layers == (2, 2)
    with pytest.raises(ValueError, match="go together"):
        policy(memory_bytes=55.0)
