"""The optimizer: grad_clip=0 means no clipping on both runtimes; the router is not decayed."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dynjax.config import gpt_config
from dynjax.experiment import Experiment
from dynjax.model import GPT
from dynjax.optim import make_optimizer
from dynjax.settings import optimizer_settings, read_run

from .tiny import tiny_config


def losses(steps: int = 3, **overrides) -> list[float]:
    """The training loss of ``steps`` steps of a tiny run on its first batch, again and again
    (without updates the loss would repeat exactly)."""
    exp = Experiment.from_config(tiny_config(**overrides))
    plan = exp.initial_plan()
    runtime = exp.runtime(plan)
    executable = exp.lower_train_step(plan).compile()
    batch, out = exp.order.batch(0), []
    for step in range(steps):
        metrics = runtime.step(executable, batch, None)
        out.append(float(runtime.host_metrics(step, jax.device_get(metrics))["loss"]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stages", [1, 2], ids=["single_program", "pipeline"])
def test_grad_clip_zero_means_no_clipping(stages):
    # No warm-up (the first step would have learning rate 0) and no decay (it moves the
    # parameters without gradients): the loss moves only through clipped-or-not gradients.
    common = dict(mesh__stage=stages, train__warmup_steps=0, train__weight_decay=0.0)
    unclipped = losses(train__grad_clip=0.0, **common)
    assert unclipped[-1] < unclipped[0] - 1e-3, unclipped  # the updates are not zeroed
    np.testing.assert_allclose(unclipped, losses(train__grad_clip=1e9, **common), rtol=1e-6)


def test_router_is_not_weight_decayed_but_matrices_are():
    cfg = tiny_config(moe__every=2, train__weight_decay=0.5, train__warmup_steps=0)
    params = nnx.to_pure_dict(nnx.state(GPT(gpt_config(cfg), rngs=nnx.Rngs(0))))
    optimizer = make_optimizer(optimizer_settings(read_run(cfg).train))

    @jax.jit
    def one_update_without_gradients(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        updates, _ = optimizer.update(zeros, optimizer.init(params), params)
        return optax.apply_updates(params, updates)

    new = one_update_without_gradients(params)
    moe = params["layers"][1]["moe"]
    router, w_in = new["layers"][1]["moe"]["router"], new["layers"][1]["moe"]["w_in"]
    np.testing.assert_array_equal(router, moe["router"])
    # AdamW's decoupled decay with zero gradients: p <- p * (1 - lr * weight_decay).
    np.testing.assert_allclose(w_in, moe["w_in"] * (1 - 3e-3 * 0.5), rtol=1e-6)
