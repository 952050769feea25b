"""What a Plan's programs are built from, given the run's enabled plugins: each layer's plugin
records, the step and batch inputs the plugins declare, the key the compiled programs share,
and the stage specs (the single program's one stage, or a pipeline's) that carry them.

The experiment holds one (`Experiment.specs`) and delegates its spec and input methods here;
the plugins' hooks (`Plugin.layer_options`, `Plugin.step_inputs`, `Plugin.input_fills`,
`Plugin.batch_input_signatures`, `Plugin.batch_inputs`, `Plugin.compiled_part`) are combined
over the plugins in `Schemes` order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import numpy as np

from dynjax.balance import schedule_tasks
from dynjax.dynamism.base import Plugin, plan_layer_options
from dynjax.model.hooks import Hooks, LayerOptions
from dynjax.parallel import whole_model
from dynjax.parallel.stages import PipelineSpec, StageSpec, stage_specs
from dynjax.parallel.step_inputs import BatchInputs, InputSignature, signatures
from dynjax.recompile import Plan


@dataclasses.dataclass(eq=False)
class ProgramSpecs:
    """The specs and inputs of a run's Plans, from its plugins and the model's shape."""

    plugins: tuple[Plugin, ...]  # the run's instances of the enabled schemes
    num_layers: int
    hooks: Hooks  # the model's hooks (`GPTConfig.hooks`)
    batch_size: int  # rows of a training batch (`train.batch_size`)
    _layer_options: dict = dataclasses.field(default_factory=dict, repr=False)

    def layer_options(self, plan: Plan) -> tuple[LayerOptions, ...]:
        """Each layer's plugin records under ``plan`` (computed once per Plan)."""
        if plan not in self._layer_options:
            self._layer_options = {plan: plan_layer_options(self.plugins, plan)}
        return self._layer_options[plan]

    def compile_key(self, plan: Plan) -> Hashable:
        """What the train step's program depends on: ``plan`` with each plugin's part as its
        programs see it (`Plugin.compiled_part`), so Plans that differ only in what the
        programs read at runtime (step inputs within the same compiled buffers) share one
        executable (issue 12 §1)."""
        parts = dict(plan.parts)
        for p in self.plugins:
            compiled = p.compiled_part(plan)
            if compiled is not None:
                parts[p.name] = compiled
        return plan.replace(parts=parts)

    def step_inputs(self, plan: Plan) -> dict[str, dict[int, np.ndarray]]:
        """The step inputs of ``plan`` (`Plugin.step_inputs`): arrays its steps read rather
        than compile in."""
        return {k: v for p in self.plugins for k, v in p.step_inputs(plan).items()}

    def step_input_signatures(self, plan: Plan) -> tuple[InputSignature, ...]:
        """What the programs of ``plan`` are lowered for of its step inputs (their shapes,
        and the values a layer profiled alone reads: `Plugin.input_fills`)."""
        fills = {k: v for p in self.plugins for k, v in p.input_fills().items()}
        return signatures(self.step_inputs(plan), fills)

    def batch_input_signatures(self, plan: Plan) -> tuple[InputSignature, ...]:
        """The per-layer arrays every training batch of ``plan`` carries
        (`Plugin.batch_input_signatures`)."""
        return tuple(s for p in self.plugins for s in p.batch_input_signatures(plan))

    def batch_inputs(
        self, step: int, sample_ids: np.ndarray, plan: Plan
    ) -> BatchInputs | None:
        """The batch inputs of ``step``'s batch (its ``sample_ids``) under ``plan``
        (`Plugin.batch_inputs`); None when its Plan declares none."""
        out = {
            k: v for p in self.plugins for k, v in p.batch_inputs(step, sample_ids, plan).items()
        }
        return out or None

    def _shared(self, plan: Plan) -> dict[str, Any]:
        """What the single program's spec and every pipeline stage's take from ``plan``."""
        return {
            "batch_size": self.batch_size,
            "frozen_layers": plan.frozen_layers,
            "microbatches": plan.microbatches,
            "dtype": plan.dtype,
            "options": self.layer_options(plan),
            "hooks": self.hooks,
            "step_inputs": self.step_input_signatures(plan),
            "batch_inputs": self.batch_input_signatures(plan),
            "remat": plan.remat,
        }

    def step_spec(self, plan: Plan) -> StageSpec:
        """The single-program step of ``plan``: one stage holding the whole model."""
        return whole_model(self.num_layers, **self._shared(plan))

    def pipeline_spec(self, plan: Plan) -> PipelineSpec:
        """The stages of ``plan``'s pipeline and the order its schedule runs their tasks in."""
        stages = stage_specs(plan.stage_layers, **self._shared(plan))
        v = plan.virtual_stages
        tasks = schedule_tasks(plan.schedule, len(stages) // v, plan.microbatches, v)
        return PipelineSpec(stages, plan.schedule, tasks)
