"""The freezing plugin: its policy on measured gradient norms, its costs, its checks, and a
run that freezes layers whose parameters then stop changing (both runtimes)."""

import jax
import numpy as np
import pytest

from dynjax.checkpoint import Checkpointer
from dynjax.config import validate_config
from dynjax.dynamism import layer_costs
from dynjax.dynamism.freezing import GradientFreezing
from dynjax.dynamism.moe.checkpoint import EXPERT_STACKS
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.recompile import History, Plan
from dynjax.train import train
from dynjax.writers import read_jsonl

from ..tiny import tiny_config


def history(changes_per_interval, every=10):
    """Gradient norms that are 1 in the first interval and 1 + change in the second."""
    entries = []
    for step in range(2 * every):
        second = step >= every
        norms = [1.0 + (c if second else 0.0) for c in changes_per_interval]
        entries.append((step, {"layer_grad_norm": np.array(norms)}))
    return History.of(entries)


def policy(**kwargs):
    settings = dict(num_layers=4, every=10, percentile=75.0, start_step=0, max_fraction=0.75)
    return GradientFreezing(**{**settings, **kwargs})


def test_the_policy_freezes_converged_layers_front_to_back():
    # Layers 0 and 1 barely change, layer 2 changes a lot, layer 3 barely: only 0 and 1 freeze
    # (a converged layer behind a changing one waits for it).
    proposal = policy().propose(history([0.01, 0.02, 0.9, 0.01]), Plan())
    assert proposal.plan.frozen_layers == (0, 1)
    assert proposal.records[0]["frozen_prefix"] == [0, 2]
    assert policy().propose(history([0.9, 0.01, 0.01, 0.01]), Plan()) is None  # layer 0 moves


def test_the_policy_respects_its_limits():
    converged = history([0.01, 0.01, 0.01, 0.9])
    assert policy(start_step=100).propose(converged, Plan()) is None  # too early
    capped = policy(max_fraction=0.25).propose(converged, Plan())
    assert capped.plan.frozen_layers == (0,)  # at most a quarter of the 4 layers
    assert policy(max_fraction=0.25).propose(converged, capped.plan) is None  # never more
    half = History.of(history([0.01] * 4).entries[:15])  # one and a half intervals
    assert policy().propose(half, Plan()) is None


def test_frozen_layers_cost_their_forward_and_bad_settings_are_named():
    exp = Experiment.from_config(tiny_config(model__num_layers=4, freezing__enabled=True))
    plan = exp.initial_plan().replace(frozen_layers=(0, 1, 3))
    # The run's own plugins, as train.py passes them: a plugin another test module registered
    # (tests/dynamism/test_base.py's toy) is disabled here and has no Plan part to cost.
    costs = layer_costs(exp.plugins, plan)
    assert costs == pytest.approx([1 / 3, 1 / 3, 1.0, 2 / 3])
    with pytest.raises(ConfigError, match="freezing.percentile"):
        validate_config(tiny_config(freezing__enabled=True, freezing__percentile=0.0), 1)
    with pytest.raises(ConfigError, match="freezing.max_fraction=0.2 .* allows no frozen layer"):
        validate_config(tiny_config(freezing__enabled=True, freezing__max_fraction=0.2), 1)


def params_at(workdir, step, exp):
    ckpt = Checkpointer(workdir / "checkpoints", stacks=EXPERT_STACKS, keep=10)
    state, _ = ckpt.restore(step, exp.abstract_state)
    ckpt.close()
    return state["params"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [{}, {"mesh__stage": 2}], ids=["single", "pipeline"])
def test_a_run_freezes_layers_and_their_parameters_stop_changing(tmp_path, mesh):
    cfg = tiny_config(
        model__num_layers=4,
        train__steps=200,
        train__checkpoint_every=20,
        train__keep_checkpoints=10,
        train__eval_every=1000,
        freezing__enabled=True,
        freezing__every=10,
        freezing__start_step=10,
        freezing__percentile=100.0,  # every layer below the largest change counts as converged
        freezing__max_fraction=0.25,  # one layer of four: one decision, one swap
        **mesh,
    )
    train(cfg, tmp_path / "warm", progress=False)  # fills the compile cache (see test_resume)
    run = tmp_path / "run"
    train(cfg, run, progress=False)
    events = read_jsonl(run / "events.jsonl")
    [freeze] = [e for e in events if e["event"] == "freeze"]
    [swap] = [e for e in events if e["event"] == "recompile"]
    assert freeze["frozen_prefix"] == [0, 1] and swap["plan"]["frozen_layers"] == [0]
    frozen = swap["plan"]["frozen_layers"]
    assert swap["swap_step"] < 160, "the background compile outlasted the run"
    first = min(s for s in range(20, 200, 20) if s > swap["swap_step"])
    exp = Experiment.from_config(cfg)
    before, after = params_at(run, first, exp), params_at(run, 200, exp)
    for i in range(4):
        pairs = zip(jax.tree.leaves(before["layers"][i]), jax.tree.leaves(after["layers"][i]),
                    strict=True)
        assert all(np.array_equal(a, b) for a, b in pairs) == (i in frozen), i
    embed_kept = np.array_equal(before["embed"]["embedding"], after["embed"]["embedding"])
    assert embed_kept == (0 in frozen)  # layer 0 freezes the embedding with it
    costs = read_jsonl(run / "layer_costs.jsonl")
    assert costs[-1]["layer_cost"] == pytest.approx([1 / 3, 1, 1, 1])
