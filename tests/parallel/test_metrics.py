"""The one metric folder: microbatches by declared reductions, stages in layer order."""

import jax.numpy as jnp
import numpy as np

from dynjax.model.hooks import Hooks, HookSet
from dynjax.model.moe import MOE_HOOKS
from dynjax.parallel.metrics import fold_microbatches, fold_stages

# The MoE block's set declares the reductions of its metrics (moe/dropped: a sum).
HOOKS = Hooks((HookSet("h", reductions=(("h/rows", "rows"), ("h/sum", "sum"))), MOE_HOOKS))


def test_microbatches_fold_by_each_metrics_reduction():
    # Two microbatches of 2 rows: microbatch j holds rows j, j + 2 of the batch.
    mbs = [
        {"loss": jnp.float32(1.0), "h/rows": jnp.array([[0, 2]]), "h/sum": jnp.array([1]),
         "h/mean": jnp.array([1.0]), "moe/dropped": jnp.array([3])},
        {"loss": jnp.float32(3.0), "h/rows": jnp.array([[1, 3]]), "h/sum": jnp.array([2]),
         "h/mean": jnp.array([2.0]), "moe/dropped": jnp.array([4])},
    ]
    out = fold_microbatches(mbs, HOOKS)
    assert float(out["loss"]) == 2.0 and out["h/rows"].tolist() == [[0, 1, 2, 3]]
    assert out["h/sum"].tolist() == [3] and out["h/mean"].tolist() == [1.5]
    assert out["moe/dropped"].tolist() == [7]


def test_stages_fold_into_the_single_program_metrics():
    first = {"aux_loss": np.float32(1), "grad_norm": np.float32(5), "h/x": np.array([1.0]),
             "moe/group_loads": np.ones((1, 2, 2), np.int32), "moe/dropped": np.array([2])}
    last = {"aux_loss": np.float32(2), "grad_norm": np.float32(5), "loss": np.float32(7),
            "h/x": np.array([2.0, 3.0])}
    out = fold_stages([first, last], HOOKS)
    assert out["aux_loss"] == 3 and out["loss"] == 7 and out["grad_norm"] == 5
    assert out["h/x"].tolist() == [1.0, 2.0, 3.0]
    assert out["moe/tokens_per_expert"].tolist() == [[2, 2]]
    assert out["dropped_fraction"] == np.float32(0.5)
