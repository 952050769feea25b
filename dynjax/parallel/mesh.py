"""The device mesh ('stage', 'data', 'expert') and the shardings of parameters and batches."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dynjax.model import ExpertParallel

AXES = ("stage", "data", "expert")
TOKEN_AXES = ("data", "expert")  # the batch is split over both; experts over 'expert' only
EXPERT_PARAMS = ("w_in", "w_out")  # stacked [E, ...] expert weights inside an MoE block


def make_mesh(stage: int, data: int, expert: int, devices=None) -> Mesh:
    """A mesh over the first stage*data*expert devices, with auto (not explicit) axis types."""
    devices = list(devices if devices is not None else jax.devices())
    need = stage * data * expert
    if need > len(devices):
        raise ValueError(
            f"a ({stage}, {data}, {expert}) mesh needs {need} devices, have {len(devices)}"
        )
    grid = np.array(devices[:need], dtype=object).reshape(stage, data, expert)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 3)


def stage_mesh(mesh: Mesh, stage: int = 0) -> Mesh:
    """The (data, expert) sub-mesh of one pipeline stage."""
    return Mesh(mesh.devices[stage], TOKEN_AXES, axis_types=(AxisType.Auto,) * 2)


def expert_parallel(mesh: Mesh) -> ExpertParallel:
    return ExpertParallel(mesh, TOKEN_AXES, "expert")


def is_expert_param(path: tuple) -> bool:
    """True for the stacked expert weights of an MoE block (leading axis = expert)."""
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    return len(names) >= 2 and names[-2] == "moe" and names[-1] in EXPERT_PARAMS


def param_shardings(params, mesh: Mesh):
    """Experts split over 'expert' (replicated over 'data'); everything else replicated."""

    def spec(path, leaf):
        return NamedSharding(mesh, P("expert") if is_expert_param(path) else P())

    return jax.tree_util.tree_map_with_path(spec, params)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows of a [B, ...] batch split over data and expert devices."""
    return NamedSharding(mesh, P(TOKEN_AXES))
