"""The optimizer: grad_clip=0 means no clipping on both runtimes."""

import jax
import numpy as np
import pytest

from dynjax.experiment import Experiment

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


@pytest.mark.parametrize("stages", [1, 2], ids=["single_program", "pipeline"])
def test_grad_clip_zero_means_no_clipping(stages):
    # No warm-up (the first step would have learning rate 0) and no decay (it moves the
    # parameters without gradients): the loss moves only through clipped-or-not gradients.
    common = dict(mesh__stage=stages, train__warmup_steps=0, train__weight_decay=0.0)
    unclipped = losses(train__grad_clip=0.0, **common)
    assert unclipped[-1] < unclipped[0] - 1e-3, unclipped  # the updates are not zeroed
    np.testing.assert_allclose(unclipped, losses(train__grad_clip=1e9, **common), rtol=1e-6)

