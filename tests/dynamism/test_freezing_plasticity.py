"""Freezing by Egeria's plasticity (seed 000 §4.2.3): the probe forward is the model's own, its
plasticity is the relative change of each layer's output and the same over pipeline stages as
in one program, and a run freezes a prefix by it within its limits; bad settings are named."""

import threading

import jax
import numpy as np
import pytest
from flax import nnx

from dynjax.config import gpt_config, validate_config
from dynjax.dynamism.freezing import PLASTICITY
from dynjax.dynamism.plasticity import PlasticityProbe
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.parallel.peers import Rounds
from dynjax.train import train
from dynjax.writers import read_jsonl

from ..helpers import Store, moe_options
from ..tiny import tiny_config


def probe_of(exp, size=2):
    return PlasticityProbe(gpt_config(exp.cfg), exp.order.batch(0).inputs[:size])


@pytest.mark.slow
def test_the_probe_forward_is_the_model_forward():
    """The last layer's probe output, through the final norm and head, gives the model's logits
    (MoE layers with capacities no pair overflows)."""
    exp = Experiment.from_config(tiny_config(model__num_layers=4, moe__every=2))
    host = exp.init_host_state()
    probe = probe_of(exp)
    outputs = probe.outputs(exp.runtime(exp.initial_plan(), host).stage_states())
    assert sorted(outputs) == [0, 1, 2, 3]
    h0, h3 = outputs[0], outputs[3]
    model = nnx.merge(exp.graphdef, host["params"])
    seq = probe.tokens.shape[1]
    want, _ = model(probe.tokens, options=moe_options(exp.model_cfg, ((seq,) * 4, (seq,) * 4)))
    got = model.head(model.norm(h3))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert h0.shape == (2, seq, 32)


def perturbed(host, layer, scale=1.1):
    """``host`` with every weight of ``layer`` scaled."""
    params = dict(host["params"], layers=dict(host["params"]["layers"]))
    params["layers"][layer] = jax.tree.map(lambda w: w * scale, params["layers"][layer])
    return {**host, "params": params}


@pytest.mark.slow
def test_plasticity_is_each_layers_relative_change_in_both_runtimes():
    measured = {}
    for name, mesh in (("single", {}), ("pipeline", {"mesh__stage": 4, "mesh__data": 2})):
        exp = Experiment.from_config(tiny_config(model__num_layers=4, moe__every=2, **mesh))
        host = exp.init_host_state()
        probe = probe_of(exp)
        before = exp.runtime(exp.initial_plan(), host)
        assert len(before.stage_states()) == (4 if mesh else 1)
        probe.refresh(before.stage_states())
        ref = [probe.reference[i] for i in range(4)]
        after = exp.runtime(exp.initial_plan(), perturbed(host, 2)).stage_states()
        measured[name] = probe.plasticity(after)
        now = [np.asarray(probe.outputs(after)[i]) for i in range(4)]
        want = [np.linalg.norm(h - r) / np.linalg.norm(r) for h, r in zip(now, ref, strict=True)]
        np.testing.assert_allclose(measured[name], want, rtol=1e-4)
    np.testing.assert_allclose(measured["pipeline"], measured["single"], rtol=1e-4, atol=1e-7)
    single = measured["single"]
    assert single[0] == 0 and single[1] == 0  # before the changed layer, nothing moves
    assert single[2] > 1e-3 and single[3] > 1e-3


def probe_over_processes(exp, owners, refresh_plan, measure_plan, host):
    """Refresh a probe under ``refresh_plan`` and measure it under ``measure_plan`` with the
    stages held by thread 'processes' (``owners[p]``: process p's stages), as in a pipeline
    over processes (`Experiment.stage_rounds`); each process's plasticity array."""
    states = {}
    for when, plan in (("refresh", refresh_plan), ("measure", measure_plan)):
        states[when] = exp.runtime(plan, perturbed(host, 2) if when == "measure" else host)
    store = Store(len(owners))
    got = [None] * len(owners)

    def process(p):
        probe, rounds = probe_of(exp), Rounds(store.peers(p), "plasticity")
        mine = lambda when: [states[when].stage_states()[s] for s in owners[p]]
        probe.refresh(mine("refresh"), rounds)
        got[p] = probe.plasticity(mine("measure"), rounds)

    threads = [threading.Thread(target=process, args=(p,)) for p in range(len(owners))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return got


@pytest.mark.parametrize("owners", [[[0, 1]], [[0], [1]], [[], [0, 1]]],
                         ids=["one-process", "stage-per-process", "first-holds-none"])
def test_a_layer_that_moved_since_the_refresh_is_measured_against_its_reference(owners):
    """Layer 2 moves from stage 1 to stage 0 between the refresh and the measurement (a
    rebalance), on one process or across two: every process measures what the unmoved
    layout does, and the same array (the reference stays on the host and the moved layer's
    output goes where its reference is)."""
    exp = Experiment.from_config(
        tiny_config(model__num_layers=4, moe__every=2, mesh__stage=2, mesh__data=4)
    )
    host = exp.init_host_state()
    plan = exp.initial_plan()
    assert plan.stage_layers == (2, 2)
    [want] = probe_over_processes(exp, [[0, 1]], plan, plan, host)
    assert want[:2].tolist() == [0, 0] and (want[2:] > 1e-3).all()
    moved = plan.replace(stage_layers=(3, 1))
    for got in probe_over_processes(exp, owners, plan, moved, host):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [{}, {"mesh__stage": 2}], ids=["single", "pipeline"])
def test_a_run_freezes_a_prefix_by_plasticity(tmp_path, mesh):
    cfg = tiny_config(
        model__num_layers=4,
        train__steps=200,
        train__checkpoint_every=1000,
        train__eval_every=1000,
        freezing__enabled=True,
        freezing__metric="plasticity",
        freezing__every=5,
        freezing__reference_every=20,
        freezing__patience=1,
        freezing__threshold=10.0,  # every layer moves less than 10x its output: all converge
        freezing__start_step=50,
        freezing__max_fraction=0.5,
        **mesh,
    )
    train(cfg, tmp_path / "warm", progress=False)  # fills the compile cache (see test_resume)
    run = tmp_path / "run"
    train(cfg, run, progress=False)
    events = read_jsonl(run / "events.jsonl")
    [freeze] = [e for e in events if e["event"] == "freeze"]
    # Judged on the first complete period whose last measurement is at or after step 50.
    assert freeze["frozen_prefix"] == [0, 2] and freeze["step"] >= 50
    assert len(freeze["plasticity"]) == 4 and all(0 < p < 10 for p in freeze["plasticity"])
    [swap] = [e for e in events if e["event"] == "recompile"]
    assert swap["plan"]["frozen_layers"] == [0, 1]
    assert swap["swap_step"] < 180, "the background compile outlasted the run"
    logged = [r for r in read_jsonl(run / "metrics.jsonl") if PLASTICITY in r]
    # Measured every 5 steps except at the refreshes (multiples of 20); logged one step later.
    assert [r["step"] for r in logged] == [s + 1 for s in range(5, 200, 5) if s % 20]
    after = [r[PLASTICITY] for r in logged if r["step"] > swap["swap_step"] + 1]
    assert after and all(r[0] is None and r[1] is None for r in after)  # the frozen prefix


@pytest.mark.parametrize(
    "overrides, key",
    [
        (dict(freezing__metric="plastic"), "freezing.metric"),
        (dict(freezing__metric="plasticity", freezing__threshold=0.0), "freezing.threshold"),
        (dict(freezing__metric="plasticity", freezing__every=200), "freezing.every"),
        (dict(freezing__metric="plasticity", freezing__patience=5), "freezing.patience"),
        (dict(freezing__metric="plasticity", freezing__probe_size=9), "freezing.probe_size"),
    ],
)
def test_bad_plasticity_settings_are_named(overrides, key):
    with pytest.raises(ConfigError, match=key):
        validate_config(tiny_config(freezing__enabled=True, **overrides), 1)
