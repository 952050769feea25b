"""The device mesh ('stage', 'data', 'expert', 'tensor') and the shardings of parameters and
batches."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dynjax.model import ExpertParallel

AXES = ("stage", "data", "expert", "tensor")
STAGE_AXES = AXES[1:]  # the sub-mesh of one pipeline stage
TOKEN_AXES = ("data", "expert")  # the batch is split over both; experts over 'expert' only
EXPERT_PARAMS = ("w_in", "w_out")  # stacked [E, ...] expert weights inside an MoE block
# Megatron-LM's tensor parallelism (Shoeybi et al. 2019 §3): the first matmul of attention and
# of the MLP split by output columns, the second by input rows, so each pair needs one
# reduction; matched against the end of a parameter's path.
COLUMN_PARALLEL = ("attn/qkv/kernel", "mlp/up/kernel", "mlp/gate/kernel")  # gate: SwiGLU's
COLUMN_PARALLEL_BIAS = ("attn/qkv/bias", "mlp/up/bias")
ROW_PARALLEL = ("attn/out/kernel", "mlp/down/kernel")


def make_mesh(stage: int, data: int, expert: int, devices=None, *, tensor: int = 1) -> Mesh:
    """A mesh over the first stage*data*expert*tensor devices, with auto (not explicit) axis
    types; 'tensor' varies fastest, so a tensor-parallel group is neighbouring devices."""
    devices = list(devices if devices is not None else jax.devices())
    need = stage * data * expert * tensor
    if need > len(devices):
        raise ValueError(
            f"a ({stage}, {data}, {expert}, {tensor}) mesh needs {need} devices, "
            f"have {len(devices)}"
        )
    grid = np.array(devices[:need], dtype=object).reshape(stage, data, expert, tensor)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 4)


def stage_mesh(mesh: Mesh, stage: int = 0) -> Mesh:
    """The (data, expert, tensor) sub-mesh of one pipeline stage."""
    return Mesh(mesh.devices[stage], STAGE_AXES, axis_types=(AxisType.Auto,) * 3)


def expert_parallel(mesh: Mesh) -> ExpertParallel:
    return ExpertParallel(mesh, TOKEN_AXES, "expert")


def _path(path: tuple) -> str:
    """A tree path as "/"-joined names, e.g. "layers/0/attn/qkv/kernel"."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def is_expert_param(path: tuple) -> bool:
    """True for the stacked expert weights of an MoE block (leading axis = expert)."""
    names = _path(path).split("/")
    return len(names) >= 2 and names[-2] == "moe" and names[-1] in EXPERT_PARAMS


def param_shardings(params, mesh: Mesh, *, fsdp: bool = False):
    """Experts split over 'expert'; attention and MLP matrices split Megatron-style over
    'tensor' (`COLUMN_PARALLEL`, `ROW_PARALLEL`; optimizer state mirrors the parameters'
    paths, so it follows); everything else replicated. With ``fsdp`` (ZeRO-3) every array is
    also split over 'data' along its largest remaining axis that the data devices divide: each
    data device keeps 1/data of the parameters and of their optimizer state, and XLA gathers a
    parameter where the step uses it (GSPMD). An array with no such axis (a scalar, a bias of
    odd width) stays replicated over 'data'."""
    data = mesh.shape["data"] if fsdp else 1
    tensor = mesh.shape.get("tensor", 1)

    def spec(path, leaf):
        shape = tuple(getattr(leaf, "shape", ()))
        axes: list[str | None] = [None] * len(shape)
        if is_expert_param(path):
            axes[0] = "expert"
        name = _path(path)
        if tensor > 1:
            if name.endswith(COLUMN_PARALLEL) or name.endswith(COLUMN_PARALLEL_BIAS):
                axes[-1] = "tensor"
            elif name.endswith(ROW_PARALLEL):
                axes[0] = "tensor"
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
