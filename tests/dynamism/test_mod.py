"""Mixture of depths: the routed block against references, its loss term, its smaller compiled
step, and the plugin in training (single program, pipeline, resume in another layout)."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dynjax.config import gpt_config, validate_config
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.model import Block, fresh_params
from dynjax.model.attention import rotary
from dynjax.model.mod import ACCURACY, LOSS, PREDICTOR_LOSS, RoutedBlock
from dynjax.train import train

from ..helpers import logged, loss_terms, mod_config
from ..tiny import tiny_config

S, D = 16, 32


def routed_block(positions="learned", hidden=8):
    cfg = gpt_config(mod_config(model__positions=positions, mod__predictor_hidden=hidden))
    return Block(cfg, 1, rngs=nnx.Rngs(3)), cfg


def inputs(seed=0, batch=3):
    return jax.random.normal(jax.random.key(seed), (batch, S, D))


def test_rotary_of_a_subset_at_its_positions_is_the_full_rotary_gathered():
    x = jax.random.normal(jax.random.key(1), (2, S, 2, 8))
    chosen = jnp.array([[0, 3, 4, 9], [2, 5, 14, 15]])
    full = jnp.take_along_axis(rotary(x), chosen[:, :, None, None], axis=1)
    subset = rotary(jnp.take_along_axis(x, chosen[:, :, None, None], axis=1), chosen)
    np.testing.assert_allclose(subset, full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tokens", [4, S])
def test_a_routed_block_computes_its_top_tokens_as_the_plain_block_would(tokens):
    """Reference: the router's top-k by NumPy, the *unrouted* block run on each sequence's
    chosen tokens alone (learned positions: attention over the subset is plain causal
    attention), blended by the router weight; every other token passes unchanged."""
    block, _ = routed_block()
    x = inputs()
    record = RoutedBlock(tokens, 0.01, "predictor")
    out, _, metrics = block(x, options=(("mod", record),))
    scores = np.asarray(block.mod.router(x)[..., 0])
    for b in range(x.shape[0]):
        chosen = np.sort(np.argsort(-scores[b], kind="stable")[:tokens])
        alone, _, _ = block(x[b : b + 1, chosen])  # no options: the plain block
        w = 1 / (1 + np.exp(-scores[b, chosen]))[:, None]
        want = np.asarray(x[b]).copy()
        want[chosen] = x[b, chosen] + w * (alone[0] - x[b, chosen])
        np.testing.assert_allclose(out[b], want, rtol=2e-5, atol=2e-6)
        untouched = np.setdiff1d(np.arange(S), chosen)
        np.testing.assert_array_equal(out[b, untouched], x[b, untouched])
        assert np.sum(np.any(np.asarray(out[b]) != np.asarray(x[b]), axis=-1)) == tokens
    assert 0 <= float(metrics[ACCURACY]) <= 1 and float(metrics[PREDICTOR_LOSS]) > 0


@pytest.mark.slow
def test_the_router_learns_through_the_weight_and_the_predictor_through_its_loss():
    block, _ = routed_block(positions="rope")
    x = inputs(1)
    graphdef, state = nnx.split(block)
    record = RoutedBlock(4, 0.5, "predictor")

    def grads(of):
        def f(state):
            out, _, metrics = nnx.merge(graphdef, state)(x, options=(("mod", record),))
            return jnp.sum(out**2) if of == "output" else metrics[LOSS]
        return nnx.to_pure_dict(jax.grad(f)(state))["mod"]

    from_output, from_loss = grads("output"), grads("loss")
    norm = lambda t: float(sum(jnp.sum(a**2) for a in jax.tree.leaves(t)))
    assert norm(from_output["router"]) > 0
    # The predictor reads a stop-gradient input and feeds nothing back into the block.
    assert norm(from_output["predictor_hidden"]) == 0 and norm(from_output["predictor_out"]) == 0
    assert norm(from_loss["predictor_hidden"]) > 0 and norm(from_loss["router"]) == 0


def test_the_predictor_loss_is_a_term_of_the_training_loss():
    def loss_at(weight):
        exp = Experiment.from_config(mod_config(mod__predictor_weight=weight))
        plan = exp.initial_plan()
        batch = exp.order.batch(0)
        params = fresh_params(exp.model_cfg, exp.settings.seed)
        total, layers = loss_terms(
            exp.stage_setup, exp.step_spec(plan), None, params, batch.inputs, batch.targets
        )
        ce = layers["loss"]
        return float(total), float(ce), np.asarray(layers[PREDICTOR_LOSS])

    total, ce, predictor = loss_at(0.25)
    assert predictor.shape == (2,) and np.all(predictor > 0)
    np.testing.assert_allclose(total, ce + 0.25 * predictor.sum(), rtol=1e-6)
    total_off, ce_off, _ = loss_at(0.0)
    np.testing.assert_allclose(total_off, ce_off, rtol=1e-7)
    np.testing.assert_allclose(ce_off, ce, rtol=1e-6)


def step_flops(**overrides):
    exp = Experiment.from_config(tiny_config(model__num_layers=4, data__seq_len=128, **overrides))
    return exp.lower_train_step(exp.initial_plan()).compile().cost_analysis()["flops"]


@pytest.mark.slow
def test_routing_shrinks_the_compiled_step():
    dense = step_flops()
    eighth = step_flops(mod__enabled=True, mod__capacity=0.125)
    half = step_flops(mod__enabled=True, mod__capacity=0.5)
    assert eighth < half < dense
    # Two of four blocks at 1/8 of the tokens: the step's FLOPs fall by well over a quarter.
    assert eighth < 0.75 * dense, (eighth, dense)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (dict(mod__every=0), "mod.every"),
        (dict(mod__capacity=0.0), "mod.capacity"),
        (dict(mod__capacity=1.5), "mod.capacity"),
        (dict(mod__predictor_hidden=0), "mod.predictor_hidden"),
        (dict(mod__predictor_weight=-1.0), "mod.predictor_weight"),
        (dict(mod__every=8), "mod.every"),
        (dict(moe__every=2), "moe.every"),
    ],
)
def test_bad_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_config(mod_config(**overrides), 8)


@pytest.mark.slow
def test_training_on_a_pipeline_equals_one_program_and_resumes_in_another_layout(tmp_path):
    base = dict(train__steps=8, train__microbatches=2, train__checkpoint_every=4,
                pipeline__profile_on_change=False)
    single = tmp_path / "single"
    train(mod_config(**base), single, progress=False)
    staged = tmp_path / "staged"
    train(mod_config(**base, mesh__stage=2, pipeline__stage_layers="(1,3)"), staged,
          progress=False)
    moved = tmp_path / "moved"  # the routed layers' routers restore onto other stages
    shutil.copytree(staged / "checkpoints" / "4", moved / "checkpoints" / "4")
    resumed = train(mod_config(**base, mesh__stage=2, pipeline__stage_layers="(3,1)"), moved,
                    progress=False)
    assert resumed.start_step == 4
    want = logged(single, "loss")
    for run, steps in ((staged, range(1, 9)), (moved, range(5, 9))):
        got = logged(run, "loss")
        for step in steps:
            assert abs(got[step] - want[step]) <= 1e-4 * want[step], (run.name, step)
    a, b = logged(single, ACCURACY), logged(staged, ACCURACY)
    assert a.keys() == b.keys() and len(a[8]) == 2
    np.testing.assert_allclose(a[8], b[8], atol=1e-6)
    # A resume may not change which layers have routers: they are parameters.
    with pytest.raises(ConfigError, match=r"mod\.every"):
        train(mod_config(**{**base, "train__steps": 9}, mod__every=4), moved, progress=False)
