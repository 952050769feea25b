"""The single-program step's pieces that depend on the mesh alone: its lowering from abstract
values, its batches (abstract and placed) and a bounded cache of its jitted evaluation steps.
`dynjax.experiment.Experiment` calls them with the few numbers of its config they take."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dynjax.parallel.feed import place_rows
from dynjax.parallel.mesh import TOKEN_AXES, batch_sharding
from dynjax.parallel.step_inputs import BatchInputs, InputSignature, StepInputs, rows_of

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
    inputs: StepInputs,
    batch_inputs: Sequence[InputSignature] = (),
) -> dict[str, Any]:
    """A step's batch as ``jax.ShapeDtypeStruct``s: tokens, the step ``inputs`` (replicated,
    under ``step_inputs``) and the ``batch_inputs`` (rows sharded like the tokens, under
    ``batch_inputs``)."""
    b, s = batch_size, seq_len
    tokens = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=batch_sharding(mesh))
    batch: dict[str, Any] = {"inputs": tokens, "targets": tokens}
    if batch_inputs:
        batch["batch_inputs"] = {
            sig.name: jax.ShapeDtypeStruct(
                (len(sig.layers), b, *sig.shape), sig.dtype, sharding=_layer_rows(mesh)
            )
            for sig in batch_inputs
        }
    stacked = rows_of(inputs)
    if stacked:
        batch["step_inputs"] = {
            name: jax.ShapeDtypeStruct(rows.shape, rows.dtype, sharding=NamedSharding(mesh, P()))
            for name, rows in stacked.items()
        }
    return batch


def place_batch(
    mesh: jax.sharding.Mesh,
    batch: Batch,
    batch_inputs: BatchInputs | None,
    inputs: StepInputs,
) -> dict[str, Any]:
    """A host batch (or this process's rows of it) on the mesh, with its batch inputs where
    given and the step ``inputs``."""
    sharding, rows = batch_sharding(mesh), np.arange(len(batch.sample_ids))
    out: dict[str, Any] = {
        "inputs": place_rows(batch.inputs, batch.rows, rows, sharding),
        "targets": place_rows(batch.targets, batch.rows, rows, sharding),
    }
    if batch_inputs:
        out["batch_inputs"] = {
            name: jax.device_put(stacked, _layer_rows(mesh))
            for name, stacked in rows_of(batch_inputs).items()
        }
    stacked = rows_of(inputs)
    if stacked:
        out["step_inputs"] = {
            name: jax.device_put(rows, NamedSharding(mesh, P())) for name, rows in stacked.items()
        }
    return out


def _layer_rows(mesh: jax.sharding.Mesh) -> NamedSharding:
    """A batch input's sharding: [layers, B, ...], the rows split like the tokens."""
    return NamedSharding(mesh, P(None, TOKEN_AXES))


class EvalSteps:
    """The last ``max_entries`` jitted evaluation steps, by their one-stage spec, like the
    Compiler's train steps: a run whose layers' records change makes a new one at each change."""

    def __init__(self, make: Callable[[Hashable], Callable], max_entries: int) -> None:
        self.make, self.max_entries = make, max_entries
        self._steps: OrderedDict[Hashable, Callable] = OrderedDict()

    def get(self, options: Hashable) -> Callable:
        fn = self._steps.pop(options, None) or jax.jit(self.make(options))
        self._steps[options] = fn
        while len(self._steps) > self.max_entries:
            self._steps.popitem(last=False)
        return fn
