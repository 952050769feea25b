"""Layer freezing in the single-program step: no update, no backward for a frozen prefix."""

import jax
import numpy as np
import optax
import pytest

from dynjax.dynamism.moe.part import capacities_of
from dynjax.experiment import Experiment
from dynjax.model import lm_loss
from dynjax.parallel.stage import cast_floats

from ..helpers import moe_options
from ..tiny import tiny_config

CFG = tiny_config(model__num_layers=4, moe__every=2)


@pytest.fixture(scope="module")
def exp():
    return Experiment.from_config(CFG)


def run_step(exp, plan, state):
    placed = exp.place_state(state)
    step = exp.lower_train_step(plan).compile()
    return jax.device_get(step(placed["params"], placed["opt_state"], exp.device_batch(
        exp.order.batch(0))))


def flops(exp, plan) -> float:
    cost = exp.lower_train_step(plan).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


@pytest.mark.slow
def test_frozen_layers_keep_parameters_and_moments_the_others_match_stopped_gradients(exp):
    state = jax.device_get(exp.init_state())
    plan = exp.initial_plan().replace(frozen_layers=(0, 2))
    # One step first so the moments are non-zero: frozen layers must keep them as they are.
    warm = run_step(exp, exp.initial_plan(), state)
    state = {"params": warm[0], "opt_state": warm[1]}
    params, opt_state, metrics = run_step(exp, plan, state)
    for i in (0, 2):
        for a, b in zip(jax.tree.leaves(state["params"]["layers"][i]),
                        jax.tree.leaves(params["layers"][i]), strict=True):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(state["params"]["embed"]["embedding"],
                                  params["embed"]["embedding"])
    mu_before, mu_after = state["opt_state"][1][0].mu, opt_state[1][0].mu
    for a, b in zip(jax.tree.leaves(mu_before["layers"][2]), jax.tree.leaves(mu_after["layers"][2]),
                    strict=True):
        np.testing.assert_array_equal(a, b)

    # Reference: an ordinary optimizer step whose loss stops the frozen units' gradients.
    frozen = lambda path: (path[0].key == "embed"
                           or (path[0].key == "layers" and path[1].key in (0, 2)))
    batch = exp.order.batch(0)

    def loss(p):
        p = jax.tree_util.tree_map_with_path(
            lambda path, x: jax.lax.stop_gradient(x) if frozen(path) else x, p)
        from flax import nnx
        model = nnx.merge(exp.graphdef, cast_floats(p, np.float32, exp.model_cfg.hooks))
        caps = capacities_of(exp.initial_plan())
        logits, stats = model(batch.inputs, options=moe_options(exp.model_cfg, caps))
        aux = sum(np.float32(0) + s.aux_loss.mean() for s in stats)
        return lm_loss(logits, batch.targets) + CFG.moe.aux_loss_weight * aux

    grads = jax.grad(loss)(state["params"])
    updates, _ = exp.optimizer.update(grads, state["opt_state"], state["params"])
    want = optax.apply_updates(state["params"], updates)
    for i in (1, 3):
        for a, b in zip(jax.tree.leaves(want["layers"][i]), jax.tree.leaves(params["layers"][i]),
                        strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=5e-6)  # Adam amplifies noise


@pytest.mark.slow
def test_a_frozen_prefix_compiles_no_backward_for_it(exp):
    plan = exp.initial_plan()
    full = flops(exp, plan)
    middle = flops(exp, plan.replace(frozen_layers=(1,)))  # input gradients still flow through
    prefix = flops(exp, plan.replace(frozen_layers=(0, 1)))
    assert prefix < middle < full
    # A frozen prefix of two of four layers drops their backward (about 2/3 of their cost).
    assert prefix < 0.85 * full, (prefix, middle, full)
