"""What a stage's programs read besides its parameters and activations: batch rows, context,
the step inputs of its layers (`dynjax.parallel.step_inputs`) and the early-exit readout.

The training step and evaluation place these the same way (`stage` module docstring:
``ctx``), so they come from one place.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dynjax.parallel.feed import Placement
from dynjax.parallel.mesh import TOKEN_AXES
from dynjax.parallel.stage import READOUT_UNITS
from dynjax.parallel.stage_state import StageState
from dynjax.parallel.stages import PipelineSpec, StageSpec
from dynjax.parallel.step_inputs import StepInputs, rows_of


class Batch(Protocol):
    """A batch on the host whose microbatches are placed on a stage's sub-mesh on request."""

    def place(self, field: str, m: int, m_count: int, sharding: NamedSharding) -> jax.Array: ...


class StageInputs:
    """Places what the stages of ``stages.spec`` read for a microbatch besides its input."""

    def __init__(self, stages: StageState) -> None:
        self.stages = stages
        self.transport = stages.transport
        # The step inputs (`set_inputs`), and each stage's rows of them on its sub-mesh, placed
        # once per (stage, layers).
        self.inputs: StepInputs = {}
        self._stage_inputs: dict[tuple[int, tuple[int, ...]], dict[str, jax.Array]] = {}

    def rows(self, stage: int) -> NamedSharding:
        return self.transport.sharding(stage, P(TOKEN_AXES))

    def batch_placements(self, batch_size: int) -> list[Placement]:
        """Where a step puts batch rows: microbatch m (rows ``m::M``) of the inputs on the first
        stage and of the targets on every stage that reads them (`feed.process_rows`)."""
        spec, rows = self.stages.spec, np.arange(batch_size)
        fed = [st.index for st in spec.stages if st.first or st.last or st.needs_targets]
        m_count = spec.microbatches
        return [(self.rows(s), rows[m::m_count]) for s in fed for m in range(m_count)]

    def set_inputs(self, inputs: StepInputs) -> None:
        """The step inputs the next steps and evaluations run with: inputs of the stage
        programs (``ctx``), so changing their values compiles nothing."""
        self.inputs = inputs
        self._stage_inputs = {}

    def step_inputs(self, stage: StageSpec) -> dict[str, Any]:
        """The stage context's entry of the step inputs of its layers (`inputs_of`; none:
        empty)."""
        inputs = self.inputs_of(stage)
        return {"inputs": inputs} if inputs else {}

    def inputs_of(self, stage: StageSpec) -> dict[str, jax.Array]:
        """The rows of the stage's layers of each step input, on its sub-mesh."""
        key = (stage.index, stage.layers)
        if key not in self._stage_inputs:
            sharding = self.transport.sharding(stage.index, P())
            rows = rows_of(self.inputs, stage.layers)
            self._stage_inputs[key] = {k: jax.device_put(v, sharding) for k, v in rows.items()}
        return self._stage_inputs[key]

    def context(
        self, stage: StageSpec, carry: Any, batch: Batch, m: int, m_count: int
    ) -> dict[str, Any]:
        """What the stage's wrappers read for microbatch ``m`` of ``m_count`` besides the
        readout (carry, targets), and the step inputs of its layers: stored with the stage
        input for the backward."""
        ctx = {} if carry is None else {"carry": carry}
        ctx.update(self.step_inputs(stage))
        if stage.needs_targets:
            ctx["targets"] = batch.place("targets", m, m_count, self.rows(stage.index))
        return ctx

    def send_readout(self, spec: PipelineSpec) -> dict[int, Any]:
        """The last stage's current norm and head parameters on every local stage that reads
        the readout: sent once per step (`stage` module docstring)."""
        last, out = spec.stages[-1].index, {}
        held = None
        if self.transport.is_local(last):
            state = self.stages.state[last]["params"]
            held = {u[0]: state[u[0]] for u in READOUT_UNITS}
        for stage in spec.stages:
            if stage.needs_readout:
                like = self.stages.programs.shapes(stage).ctx["readout"]
                moved = self.transport.send_tree(held, last, stage.index, like)
                if moved is not None:
                    out[stage.index] = moved
        return out
