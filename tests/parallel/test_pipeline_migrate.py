"""Layer migration forced by a policy through the Controller, inside dynjax.train.

(The runtime-level exactness of migration is in test_pipeline_runtime.py.)
"""

import jax
import numpy as np
import pytest

from dynjax.experiment import Experiment
from dynjax.recompile import Proposal
from dynjax.train import train
from dynjax.writers import read_jsonl

from ..tiny import tiny_config


class MoveLayerOne:
    """A test policy: once training has started, move layer 1 from stage 0 to stage 1."""

    name = "move-layer"

    def propose(self, history, plan):
        if history.latest_step is not None and plan.stage_layers == (2, 1, 1):
            return Proposal(plan.replace(stage_layers=(1, 2, 1)), "test")
        return None


@pytest.mark.slow
def test_controller_policy_migrates_a_layer_during_training(tmp_path):
    config = dict(
        model__num_layers=4, mesh__stage=3, mesh__data=2, train__steps=30,
        train__microbatches=2, train__log_every=1, train__eval_every=30,
        train__checkpoint_every=30, recompile__delta_launch=1,
        recompile__blocking=True,  # the swap lands within a few steps on any machine
        # The moved layer 1 is an MoE layer whose router sends every token to both of its
        # experts (top_k = num_experts; capacity factor 1.25 >= 1, so none is dropped): routing
        # then has no discontinuity. The two layouts' programs sum in different orders (~1e-7
        # apart); with top-2 of 4 experts that flipped a routing decision within 120 steps on
        # one corpus and the losses drifted ~1e-3 apart. Without a discontinuity the difference
        # stays at float32 rounding (measured <= 5e-7 absolute), so rtol 1e-5 holds for the
        # whole run while a migration that lost or misplaced any state would break it.
        moe__every=2, moe__num_experts=2, moe__top_k=2,
    )
    # Never changes its assignment.
    reference = tmp_path / "reference"
    train(tiny_config(**config, pipeline__stage_layers="(1,2,1)"), reference, progress=False)
    changed = tmp_path / "changed"
    summary = train(
        tiny_config(**config, pipeline__stage_layers="(2,1,1)"),
        changed,
        policies=[MoveLayerOne()],
        progress=False,
    )
    events = read_jsonl(changed / "events.jsonl")
    migrate = [e for e in events if e["event"] == "migrate"]
    assert summary.recompiles == 1 and len(migrate) == 1, events
    assert migrate[0]["moves"] == [[1, 0, 1]]
    # Layer 1 moved with its optimizer state: its parameters and Adam's two moments.
    exp = Experiment.from_config(tiny_config(**config, pipeline__stage_layers="(2,1,1)"))
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(exp.init_state()["params"]["layers"][1]))
    assert migrate[0]["bytes"] == 3 * layer_bytes
    assert migrate[0]["recompiled_stages"] == [0, 1] and migrate[0]["seconds"] > 0  # measured
    recompile = next(e for e in events if e["event"] == "recompile")
    assert recompile["plan_diff"] == {"stage_layers": [[2, 1, 1], [1, 2, 1]]}
    assert recompile["swap_step"] == migrate[0]["step"] < 30
    # The first step of each Plan is profiled (seed 000 §3.1): the new layout's costs.
    profiles = [e for e in events if e["event"] == "profile"]
    assert [e["step"] for e in profiles] == [0, migrate[0]["step"]]
    losses = lambda w: [r["loss"] for r in read_jsonl(w / "metrics.jsonl") if "loss" in r]
    np.testing.assert_allclose(losses(changed), losses(reference), rtol=1e-5)
