"""Mixture of depths at evaluation (Raposo et al. §3.5; seed 000 §2.6): routing by the causal
predictor against a loop reference, its causality against top-k's look-ahead, the training path
untouched by it, and the evaluation of a run on one program and on a pipeline."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dynjax.config import gpt_config, validate_config
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.model import Block, fresh_params
from dynjax.model.hooks import LayerContext
from dynjax.model.mod import ROUTED, RoutedBlock
from dynjax.parallel.metrics import hook_metrics
from dynjax.train import train

from ..helpers import loss_terms, mod_config

S, D = 16, 32
INFERENCE = LayerContext(inference=True)


def routed_block(positions="learned"):
    cfg = gpt_config(mod_config(model__positions=positions, mod__predictor_hidden=8))
    return Block(cfg, 1, rngs=nnx.Rngs(3))


def inputs(seed=0, batch=4):
    return jax.random.normal(jax.random.key(seed), (batch, S, D))


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [4, 12])
def test_predictor_routing_equals_a_loop_reference(tokens):
    """Reference: per sequence, the positions with a positive predictor logit, the first
    ``tokens`` of them; the *unrouted* block run on those alone (learned positions: attention
    over the subset is plain causal attention), blended by the router weight; every other token
    passes unchanged."""
    block = routed_block()
    x = inputs()
    record = RoutedBlock(tokens, 0.01, "predictor")
    out, _, metrics = block(x, options=(("mod", record),), context=INFERENCE)
    logits = np.asarray(block.mod.predict(x))
    scores = np.asarray(block.mod.router(x)[..., 0])
    routed = []
    for b in range(x.shape[0]):
        members = np.flatnonzero(logits[b] > 0)
        chosen = members[:tokens]
        want = np.asarray(x[b]).copy()
        if len(chosen):
            alone, _, _ = block(x[b : b + 1, chosen])  # no options: the plain block
            w = 1 / (1 + np.exp(-scores[b, chosen]))[:, None]
            want[chosen] = x[b, chosen] + w * (alone[0] - x[b, chosen])
        np.testing.assert_allclose(out[b], want, rtol=2e-5, atol=2e-6)
        changed = np.sum(np.any(np.asarray(out[b]) != np.asarray(x[b]), axis=-1))
        assert changed == min(len(members), tokens)
        routed.append((len(members), len(chosen)))
    np.testing.assert_allclose(metrics[ROUTED], np.mean([c for _, c in routed]) / S, rtol=1e-6)
    # The cases the rule distinguishes both occur: more members than the bucket holds (the
    # later ones skip), and fewer (the bucket's spare slots change nothing).
    if tokens == 4:
        assert any(m > tokens for m, _ in routed)
    else:
        assert any(m < tokens for m, _ in routed)


def suffix_pushed(x, w, t):
    """``x`` with the tokens after ``t`` moved far along the router's direction ``w``: they then
    top every sequence's router scores."""
    return x.at[:, t + 1 :].add(20 * w / jnp.linalg.norm(w))


@pytest.mark.parametrize("tokens", [4, 12])
def test_predictor_routing_is_causal_and_topk_is_not(tokens):
    block = routed_block(positions="rope")
    x, t = inputs(1), 9
    changed = suffix_pushed(x, block.mod.router.kernel[...][:, 0], t)

    def run(routing, context, x):
        out, _, _ = block(x, options=(("mod", RoutedBlock(tokens, 0.01, routing)),),
                          context=context)
        return np.asarray(out[:, : t + 1])

    np.testing.assert_allclose(
        run("predictor", INFERENCE, changed), run("predictor", INFERENCE, x), atol=1e-6
    )
    # Top-k, at inference or in training, lets the later tokens change the earlier ones' outputs.
    for context in (INFERENCE, LayerContext()):
        assert np.abs(run("topk", context, changed) - run("topk", context, x)).max() > 1e-3
    assert np.abs(run("predictor", LayerContext(), changed) - run("predictor", LayerContext(), x)
                  ).max() > 1e-3  # training routes by top-k whatever the evaluation routing


def model_logits(routing, tokens, inference):
    exp = Experiment.from_config(mod_config(mod__eval_routing=routing, mod__capacity=0.25))
    model = nnx.merge(exp.graphdef, fresh_params(exp.model_cfg, 0))
    logits, _, _ = model.forward(
        tokens, options=exp.layer_options(exp.initial_plan()), inference=inference
    )
    return np.asarray(logits)


@pytest.mark.slow
def test_a_model_evaluated_with_the_predictor_is_causal():
    """Two sequences equal up to position t: the causal evaluation gives the same logits there;
    top-k routing, for some random suffix, does not."""
    t, seq = 13, 32
    base = jax.random.randint(jax.random.key(0), (2, seq), 0, 256)
    suffixes = [
        base.at[:, t + 1 :].set(jax.random.randint(jax.random.key(k), (2, seq - t - 1), 0, 256))
        for k in range(1, 4)
    ]
    want = model_logits("predictor", base, True)[:, : t + 1]
    topk = model_logits("topk", base, True)[:, : t + 1]
    assert np.abs(want - topk).max() > 1e-4  # the two routings differ on this model
    gaps = []
    for tokens in suffixes:
        got = model_logits("predictor", tokens, True)[:, : t + 1]
        np.testing.assert_allclose(got, want, atol=1e-5)
        gaps.append(np.abs(model_logits("topk", tokens, True)[:, : t + 1] - topk).max())
    assert max(gaps) > 1e-4, gaps


def test_the_training_path_does_not_see_the_evaluation_routing():
    """The training forward (loss, every layer metric) is the same under either evaluation
    routing; at inference top-k is that same forward and the predictor's routing another."""

    def loss(routing, inference):
        exp = Experiment.from_config(mod_config(mod__eval_routing=routing))
        batch = exp.order.batch(0)
        opts = dataclasses.replace(exp.step_spec(exp.initial_plan()), inference=inference)
        total, metrics = loss_terms(
            exp.stage_setup, opts, None, fresh_params(exp.model_cfg, 0), batch.inputs,
            batch.targets,
        )
        layers = hook_metrics(metrics, exp.model_cfg.hooks)
        return float(total), float(metrics["loss"]), {k: np.asarray(v) for k, v in layers.items()}

    total, ce, layers = loss("predictor", False)
    total_topk, ce_topk, layers_topk = loss("topk", False)
    assert (total, ce) == (total_topk, ce_topk)
    assert layers.keys() == layers_topk.keys()
    for name in layers:
        np.testing.assert_array_equal(layers[name], layers_topk[name])
    assert loss("topk", True)[1] == ce
    _, causal, causal_layers = loss("predictor", True)
    assert abs(causal - ce) > 1e-5
    assert set(causal_layers) == {ROUTED, "mod/router_weight"}


def test_a_bad_evaluation_routing_names_the_key():
    with pytest.raises(ConfigError, match=r"mod\.eval_routing"):
        validate_config(mod_config(mod__eval_routing="causal"), 8)


@pytest.mark.slow
def test_a_run_evaluates_causally_on_one_program_and_on_a_pipeline(tmp_path):
    base = dict(train__steps=6, train__microbatches=2, pipeline__profile_on_change=False)
    single = train(mod_config(**base), tmp_path / "single", progress=False)
    topk = train(mod_config(**base, mod__eval_routing="topk"), tmp_path / "topk", progress=False)
    staged = train(mod_config(**base, mesh__stage=2, pipeline__stage_layers="(1,3)"),
                   tmp_path / "staged", progress=False)
    assert single.final_loss == topk.final_loss  # the same training
    assert np.isfinite(single.eval_loss) and abs(single.eval_loss - topk.eval_loss) > 1e-5
    assert staged.eval_loss == pytest.approx(single.eval_loss, rel=1e-4)
