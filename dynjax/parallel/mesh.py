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


def param_shardings(params, mesh: Mesh, *, fsdp: bool = False):
    """Experts split over 'expert'; everything else replicated, or with ``fsdp`` (ZeRO-3) every
    array also split over 'data' along its largest axis that the data devices divide: each data
    device keeps 1/data of the parameters and of their optimizer state (which mirrors their
    shardings), and XLA gathers a parameter where the step uses it (GSPMD). An array with no
    such axis (a scalar, a bias of odd width) stays replicated over 'data'."""
    data = mesh.shape["data"] if fsdp else 1

    def spec(path, leaf):
        shape = tuple(getattr(leaf, "shape", ()))
        axes: list[str | None] = [None] * len(shape)
        if is_expert_param(path):
            axes[0] = "expert"
        free = [i for i, n in enumerate(shape) if axes[i] is None and n % data == 0]
        if data > 1 and free:
            axes[max(free, key=lambda i: (shape[i], -i))] = "data"
        while axes and axes[-1] is None:
            axes.pop()
        return NamedSharding(mesh, P(*axes))

    return jax.tree_util.tree_map_with_path(spec, params)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows of a [B, ...] batch split over data and expert devices."""
    return NamedSharding(mesh, P(TOKEN_AXES))
