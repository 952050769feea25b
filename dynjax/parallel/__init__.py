"""Mesh, shardings and the compiled steps (the pipeline runtime will live here too)."""

from dynjax.parallel.mesh import (
    AXES,
    TOKEN_AXES,
    batch_sharding,
    expert_parallel,
    is_expert_param,
    make_mesh,
    param_shardings,
    stage_mesh,
)
from dynjax.parallel.step import StepOptions, make_eval_step, make_train_step

__all__ = [
    "AXES",
    "TOKEN_AXES",
    "batch_sharding",
    "expert_parallel",
    "is_expert_param",
    "make_mesh",
    "param_shardings",
    "stage_mesh",
    "StepOptions",
    "make_eval_step",
    "make_train_step",
]
