"""``train.nonfinite="skip"`` (issue 32 §5): a step whose global gradient norm is not finite
keeps the parameters and optimizer state it had, in the single program and on every stage of a
pipeline alike, and says so in its ``skipped`` metric; a finite step updates as before."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dynjax.experiment import Experiment

from ..tiny import tiny_config


def host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.mark.parametrize("stages", [1, 2], ids=["single", "pipeline"])
def test_a_step_with_a_non_finite_gradient_keeps_the_state(stages):
    cfg = tiny_config(train__nonfinite="skip", mesh__stage=stages, mesh__data=8 // stages)
    exp = Experiment.from_config(cfg)
    plan = exp.initial_plan()
    exe = exp.lower_train_step(plan).compile()
    runtime = exp.runtime(plan)
    batch = exp.order.batch(0)
    first = runtime.stage_states()[0]["params"]
    embed = first["embed"]
    first["embed"] = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), embed)
    before = [host(s) for s in runtime.stage_states()]
    metrics = runtime.host_metrics(0, host(runtime.step(exe, batch, None)))
    assert metrics["skipped"] == 1 and not np.isfinite(metrics["grad_norm"])
    for was, now in zip(before, runtime.stage_states(), strict=True):
        jax.tree.map(np.testing.assert_array_equal, was, host(now))  # kept, NaN and all

    runtime.stage_states()[0]["params"]["embed"] = embed
    before = [host(s) for s in runtime.stage_states()]
    metrics = runtime.host_metrics(1, host(runtime.step(exe, exp.order.batch(1), None)))
    assert metrics["skipped"] == 0 and np.isfinite(metrics["loss"])
    for was, now in zip(before, runtime.stage_states(), strict=True):  # the moments moved
        changed = jax.tree.leaves(jax.tree.map(
            lambda a, b: not np.array_equal(a, b), was["opt_state"], host(now["opt_state"])))
        assert any(changed)
