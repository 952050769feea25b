"""Moving arrays between stage sub-meshes, inside one process or across processes.

Inside one process an array crosses stages as ``jax.device_put`` to the other stage's sharding
would copy it (docs/parallelism.md): an asynchronous device-to-device copy that never blocks
the host, made by JAX's batched copy directly (`jax_private.copy_to`), since
``device_put``'s own Python costs more host time than the rest of a pipeline task's dispatch.
Across processes (``jax.distributed``, each process owning the devices of some stages) it crosses
through a transfer both neighbours take part in: a jitted ``jax.shard_map`` ``ppermute`` over a
mesh made of the two stages' devices, to which the sender contributes its shards and the
receiver a zero buffer of the same layout, each from its own devices only (docs/parallelism.md
"Several processes"). Both processes issue their transfers in the schedule's one global
order (`dispatch`), so they meet.

Small per-stage values that every stage needs (squared gradient norms) go to every stage the
same way. (One collective over all stages' devices would be simpler, but on the CPU backend its
participants wait inside the collective for stages that are still busy and can starve them of
threads; a copy only waits for its source.)
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dynjax.parallel.mesh import STAGE_AXES, stage_mesh
from jax_private import copy_to


class Transport:
    """Stage-to-stage transfers for one ('stage', 'data', 'expert', 'tensor') mesh.

    Stages are logical (`dynjax.parallel.stages.PipelineSpec`): with ``virtual_stages`` v,
    logical stage ``l`` runs on sub-mesh ``l % S`` of the mesh's S (each sub-mesh holds v
    non-adjacent chunks, `dynjax.balance.logical_stage`); with v = 1 a stage is a sub-mesh."""

    def __init__(self, mesh: Mesh, virtual_stages: int = 1) -> None:
        self.mesh = mesh
        self.devices_of = tuple(
            s % mesh.shape["stage"] for s in range(mesh.shape["stage"] * virtual_stages)
        )  # the sub-mesh (index into the mesh's 'stage' axis) of each logical stage
        self.stage_meshes = tuple(stage_mesh(mesh, d) for d in self.devices_of)
        me = jax.process_index()
        self.local_stages = frozenset(
            s for s, m in enumerate(self.stage_meshes)
            if {d.process_index for d in m.devices.flat} == {me}
        )
        for s, m in enumerate(self.stage_meshes):
            owners = {d.process_index for d in m.devices.flat}
            if len(owners) > 1:
                raise ValueError(
                    f"pipeline stage {s} spans processes {sorted(owners)}: each process must "
                    "own whole stages (devices per process a multiple of "
                    "mesh.data*mesh.expert*mesh.tensor)"
                )
        self._exchanges: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    @property
    def num_stages(self) -> int:
        return len(self.stage_meshes)

    @property
    def all_local(self) -> bool:
        """Whether every stage sub-mesh is this process's (always, in one process)."""
        return len(self.local_stages) == self.num_stages

    def is_local(self, stage: int) -> bool:
        return stage in self.local_stages

    def sharding(self, stage: int, spec: P) -> NamedSharding:
        return NamedSharding(self.stage_meshes[stage], spec)

    def send(
        self, x: jax.Array | None, src: int, dst: int, like: jax.ShapeDtypeStruct,
        held: list[jax.Array] | None = None,
    ) -> jax.Array | None:
        """Move ``x`` from stage ``src`` to stage ``dst`` (``like``: its shape and target
        sharding). Call it in every process that owns either stage, with ``x`` None where
        ``src`` is not local; returns the array where ``dst`` is local, else None.

        ``held``: a transfer across processes appends its result's shards on this process's
        devices, ready when this side's part is done: the transfer holds the device until
        the other process takes part, which a timed step counts as waiting, not as a task's
        work (`dynjax.parallel.timeline`)."""
        if self.is_local(src) and self.is_local(dst):
            return copy_to([x], [like.sharding])[0]
        if not (self.is_local(src) or self.is_local(dst)):
            return None
        if not self.is_local(src):  # the receiver's half of the exchange: a zero buffer
            x = jnp.zeros(like.shape, like.dtype, device=like.sharding)
        exchange, pair_sharding = self._exchange(src, dst, like)
        shape = (2 * like.shape[0], *like.shape[1:])
        pair = jax.make_array_from_single_device_arrays(
            shape, pair_sharding, [sh.data for sh in x.addressable_shards]
        )
        shards = exchange(pair).addressable_shards
        if held is not None:
            held.extend(sh.data for sh in shards)
        if not self.is_local(dst):
            return None
        mine = {sh.device: sh.data for sh in shards}
        devices = self.stage_meshes[dst].devices.flat
        return jax.make_array_from_single_device_arrays(
            like.shape, like.sharding, [mine[d] for d in devices]
        )

    def send_tree(
        self, tree: Any, src: int, dst: int, like: Any, held: list[jax.Array] | None = None
    ) -> Any:
        """`send` of every leaf of a pytree shaped as ``like`` (a tree of
        ``jax.ShapeDtypeStruct``; ``tree`` None where ``src`` is not local); returns the tree
        where ``dst`` is local, else None (``held``: as `send`'s)."""
        shapes, treedef = jax.tree.flatten(like)
        if self.is_local(src) and self.is_local(dst):  # one call for all leaves (`copy_to`)
            leaves = copy_to(jax.tree.leaves(tree), [s.sharding for s in shapes])
            return jax.tree.unflatten(treedef, leaves)
        leaves = jax.tree.leaves(tree) if tree is not None else [None] * len(shapes)
        moved = [self.send(x, src, dst, s, held) for x, s in zip(leaves, shapes, strict=True)]
        return jax.tree.unflatten(treedef, moved) if self.is_local(dst) else None

    def _exchange(self, src: int, dst: int, like: jax.ShapeDtypeStruct):
        """The compiled ppermute from stage ``src`` to ``dst`` of arrays like ``like``."""
        spec = tuple(like.sharding.spec) + (None,) * (len(like.shape) - len(like.sharding.spec))
        key = (src, dst, like.shape, str(like.dtype), spec)
        with self._lock:
            if key in self._exchanges:
                return self._exchanges[key]
        grid = np.stack(
            [self.mesh.devices[self.devices_of[src]], self.mesh.devices[self.devices_of[dst]]]
        )
        mesh = Mesh(grid, ("pair", *STAGE_AXES), axis_types=(AxisType.Auto,) * 4)
        lead = spec[0] if spec else None
        lead = ("pair",) + (() if lead is None else (lead,) if isinstance(lead, str) else lead)
        pair_spec = P(lead, *spec[1:])
        exchange = jax.jit(
            jax.shard_map(
                lambda a: jax.lax.ppermute(a, "pair", [(0, 1)]),
                mesh=mesh,
                in_specs=pair_spec,
                out_specs=pair_spec,
            )
        )
        pair_sharding = NamedSharding(mesh, pair_spec)
        shape = jax.ShapeDtypeStruct(
            (2 * like.shape[0], *like.shape[1:]), like.dtype, sharding=pair_sharding
        )
        compiled = (exchange.lower(shape).compile(), pair_sharding)
        with self._lock:
            self._exchanges[key] = compiled
        return compiled

    def gather(
        self, parts: dict[int, jax.Array], shape: tuple[int, ...], dtype, stages: int
    ) -> dict:
        """Every stage's replicated array of ``shape`` on every local stage, in stage order:
        small per-stage values that each stage sums to the same total. ``stages``: how many
        stage sub-meshes the current Plan uses (fewer than the mesh's after a re-pack)."""
        out: dict[int, list[Any]] = {s: [None] * stages for s in self.local_stages if s < stages}
        between_local: list[tuple[int, int]] = []  # copied in one call (`copy_to`) at the end
        for src in range(stages):
            for dst in range(stages):
                if src == dst:
                    if dst in out:
                        out[dst][src] = parts[src]
                elif self.is_local(src) and self.is_local(dst):
                    between_local.append((src, dst))
                else:  # the exchanges across processes, in the same order in every process
                    target = jax.ShapeDtypeStruct(shape, dtype, sharding=self.sharding(dst, P()))
                    moved = self.send(parts.get(src), src, dst, target)
                    if moved is not None:
                        out[dst][src] = moved
        moved = copy_to(
            [parts[src] for src, _ in between_local],
            [self.sharding(dst, P()) for _, dst in between_local],
        )
        for (src, dst), array in zip(between_local, moved, strict=True):
            out[dst][src] = array
        return {s: tuple(v) for s, v in sorted(out.items())}
