"""This machine's speeds for MPipeMoE's memory-reuse choice (seed 002 §II-C, eq. 10).

Measured once at the edge when a scheme asks (`Plugin.speed_probe`) and handed to the run's
plugins as a fact (`RunLink.speeds`), so no plugin hook times the device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dynjax.model.moe import host_offload_supported
from pallas_kernels.timing import median_seconds


@dataclasses.dataclass(frozen=True)
class Speeds:
    """Measured speeds (seed 002 §II-C): ``comp`` FLOP/s of the expert matmuls, ``comm`` bytes/s
    of the all-to-all, ``mem`` bytes/s of device-host copies (0: the backend cannot offload).
    ``mu_comp``, ``mu_all``: the all-to-all's speed factor while experts compute, and while
    copies run too; ``eta_all``: the copies' factor while both others run (Fig. 3)."""

    comp: float
    comm: float
    mem: float
    mu_comp: float = 1.0
    mu_all: float = 1.0
    eta_all: float = 1.0


def measure_speeds(rows: int, d_model: int, hidden: int, repeats: int = 5) -> Speeds:
    """Seed 002 §II-C's W_comp, W_comm, W_mem on this machine, medians of ``repeats``: an expert
    GEMM of one partition, an all-to-all of T_DI over the local devices (none with one device:
    infinitely fast) and a copy of T_DI to pinned host memory (0 where the backend has none).
    The slowdown factors of running them together (μ, η) are left at 1: measuring them needs
    concurrent streams (GPU)."""
    rows = max(rows, 1)
    a = jnp.ones((rows, d_model), jnp.float32)
    w = jnp.ones((d_model, hidden), jnp.float32)

    def seconds(fn, *args) -> float:  # > 0: the speeds divide by it
        return max(median_seconds(fn, *args, repeats=repeats), 1e-9)

    comp = 2 * rows * d_model * hidden / seconds(jax.jit(jnp.matmul), a, w)
    devices = jax.local_devices()
    comm = float("inf")
    if len(devices) > 1:
        n = len(devices)
        mesh = jax.sharding.Mesh(np.asarray(devices), ("x",))
        x = jnp.ones((n * n, max(rows // n, 1), d_model), jnp.float32)
        a2a = jax.jit(
            jax.shard_map(
                lambda v: jax.lax.all_to_all(v, "x", 0, 0, tiled=True),
                mesh=mesh,
                in_specs=P("x"),
                out_specs=P("x"),
            )
        )
        comm = x.nbytes / n / seconds(a2a, jax.device_put(x, jax.NamedSharding(mesh, P("x"))))
    mem = 0.0
    if host_offload_supported():
        host = jax.sharding.SingleDeviceSharding(devices[0], memory_kind="pinned_host")
        mem = a.nbytes / seconds(lambda v: jax.device_put(v, host), a)
    return Speeds(comp=comp, comm=comm, mem=mem)
