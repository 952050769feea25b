"""Mesh, shardings, the single-program step, and the MPMD pipeline (`pipeline` and its parts,
`stages`, `stage`, `stage_programs`, `dispatch`, `transport`, `layout`, `profile`: import
those modules directly)."""

from dynjax.parallel.mesh import (
    AXES,
    STAGE_AXES,
    TOKEN_AXES,
    batch_sharding,
    expert_parallel,
    is_expert_param,
    make_mesh,
    param_shardings,
    stage_mesh,
)
from dynjax.parallel.step import make_eval_step, make_train_step, whole_model

__all__ = [
    "AXES",
    "STAGE_AXES",
    "TOKEN_AXES",
    "batch_sharding",
    "expert_parallel",
    "is_expert_param",
    "make_mesh",
    "param_shardings",
    "stage_mesh",
    "make_eval_step",
    "make_train_step",
    "whole_model",
]
