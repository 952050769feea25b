"""The single-program step's pieces that depend on the mesh alone: its lowering from abstract
values, its batches (abstract and placed) and a bounded cache of its jitted evaluation steps.
`dynjax.experiment.Experiment` calls them with the few numbers of its config they take."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dynjax.parallel.feed import place_rows
from dynjax.parallel.mesh import TOKEN_AXES, batch_sharding
from dynjax.parallel.step_inputs import StepInputs, rows_of

if TYPE_CHECKING:
    from dynjax.data import Batch


def lower_step(step: Callable, state: dict[str, Any], batch: dict[str, Any]):
    """``step(params, opt_state, batch)`` jitted with ``state``'s shardings (its buffers
    donated) and lowered from the abstract ``state`` and ``batch`` (no buffers touched)."""
    shardings = jax.tree.map(lambda a: a.sharding, state)
    jitted = jax.jit(
        step,
        in_shardings=(shardings["params"], shardings["opt_state"], None),
        out_shardings=(shardings["params"], shardings["opt_state"], None),
        donate_argnums=(0, 1),
    )
    return jitted.lower(state["params"], state["opt_state"], batch)


def abstract_batch(
    mesh: jax.sharding.Mesh,
    batch_size: int,
    seq_len: int,
    *,
    cached: tuple[int, int] | None,
    inputs: StepInputs,
) -> dict[str, jax.ShapeDtypeStruct]:
    """A step's batch as ``jax.ShapeDtypeStruct``s: tokens, plus with ``cached`` (MoE layers,
    top-k) the cached routing, and the step ``inputs`` (replicated)."""
    b, s = batch_size, seq_len
    tokens = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=batch_sharding(mesh))
    batch = {"inputs": tokens, "targets": tokens}
    if cached is not None:
        shape = (cached[0], b, s, cached[1])
        batch["cached"] = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=_cached(mesh))
    for name, rows in rows_of(inputs).items():
        batch[name] = jax.ShapeDtypeStruct(
            rows.shape, rows.dtype, sharding=NamedSharding(mesh, P())
        )
    return batch


def place_batch(
    mesh: jax.sharding.Mesh,
    batch: Batch,
    cached: np.ndarray | None,
    inputs: StepInputs,
) -> dict[str, jax.Array]:
    """A host batch (or this process's rows of it) on the mesh, with the cached routing where
    given and the step ``inputs``."""
    sharding, rows = batch_sharding(mesh), np.arange(len(batch.sample_ids))
    out = {
        "inputs": place_rows(batch.inputs, batch.rows, rows, sharding),
        "targets": place_rows(batch.targets, batch.rows, rows, sharding),
    }
    if cached is not None:
        out["cached"] = jax.device_put(cached, _cached(mesh))
    for name, rows in rows_of(inputs).items():
        out[name] = jax.device_put(rows, NamedSharding(mesh, P()))
    return out


def _cached(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(None, TOKEN_AXES))


class EvalSteps:
    """The last ``max_entries`` jitted evaluation steps, by their one-stage spec, like the
    Compiler's train steps: a dynamic-capacity run makes a new one at every capacity change."""

    def __init__(self, make: Callable[[Hashable], Callable], max_entries: int) -> None:
        self.make, self.max_entries = make, max_entries
        self._steps: OrderedDict[Hashable, Callable] = OrderedDict()

    def get(self, options: Hashable) -> Callable:
        fn = self._steps.pop(options, None) or jax.jit(self.make(options))
        self._steps[options] = fn
        while len(self._steps) > self.max_entries:
            self._steps.popitem(last=False)
        return fn
