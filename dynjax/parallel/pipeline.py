"""The MPMD pipeline runtime: per-stage state, the schedule's tasks, migration between stages.

docs/parallelism.md: each stage runs its own programs (`stage_programs`) on its own
sub-mesh, so stages may hold different numbers of layers of different shapes and layers can
move. `Pipeline` is what the rest of the library calls; each of its jobs lives in a module of
its own:

* `executable`: the compiled programs of a spec, and their cache across Plans;
* `stage_state`: the stages' parameters, optimizer state and accumulators, and migration;
* `stage_inputs`: what the stage programs read besides activations (rows, context, the step
  inputs of their layers, the early-exit readout);
* `step_run`: one step, dispatched asynchronously in the schedule's global order;
* `timeline`: timed steps and the watcher threads that take their timelines;
* `profiler`: profiled steps (unit times, memory);
* `evaluation`: the validation loss.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from dynjax.model.hooks import Hooks
from dynjax.parallel.evaluation import evaluate
from dynjax.parallel.executable import PipelineExecutable, PipelinePrograms
from dynjax.parallel.feed import Placement
from dynjax.parallel.metrics import fold_stages
from dynjax.parallel.peers import Rounds
from dynjax.parallel.profile import Profile, TaskTime
from dynjax.parallel.profiler import PendingProfile, Profiler
from dynjax.parallel.stage_inputs import StageInputs
from dynjax.parallel.stage_state import Migration, StageState, state_layout
from dynjax.parallel.stages import PipelineSpec
from dynjax.parallel.step_inputs import BatchInputs, StepInputs
from dynjax.parallel.step_run import StepRunner
from dynjax.parallel.timeline import PendingTimeline, TimedSteps


class Pipeline:
    """The training state of every stage and the step that runs a `PipelineExecutable` on it.

    State per stage: ``{"params", "opt_state"}`` keyed by name as in the full state (see
    `layout`), plus the gradient accumulator of its trainable units (zero between steps).
    Each job is a part of its own (module docstring); the parts share one `StageState`.
    """

    def __init__(
        self, programs: PipelinePrograms, full_template: Any, profiles: Rounds | None = None
    ) -> None:
        self.programs = programs
        self.transport = programs.transport
        self.stages = StageState(programs, full_template)
        self.inputs = StageInputs(self.stages)
        self.runner = StepRunner(self.stages, self.inputs)
        self.timed = TimedSteps(self.runner)
        # ``profiles``: the other processes' stages' profiles (None: this process profiles
        # alone).
        self.profiler = Profiler(self.timed, profiles)

    @property
    def spec(self) -> PipelineSpec | None:
        """The spec the state is laid out for (None before `place`)."""
        return self.stages.spec

    @property
    def state(self) -> dict[int, dict[str, Any]]:
        return self.stages.state

    @property
    def acc(self) -> dict[int, Any]:
        return self.stages.acc

    # -- state -------------------------------------------------------------------------------

    def place(self, state: Any, spec: PipelineSpec) -> None:
        """`StageState.place`: the full state onto this process's stages, laid out for
        ``spec``."""
        self.stages.place(state, spec)

    def full_state(self) -> Any:
        """`StageState.full_state`: the full tree of the stages' own arrays (no copies)."""
        return self.stages.full_state()

    def host_state(self) -> Any:
        """The full ``{"params", "opt_state"}`` tree as host arrays."""
        return jax.device_get(self.full_state())

    def set_inputs(self, inputs: StepInputs) -> None:
        """`StageInputs.set_inputs`: the step inputs from the next step on."""
        self.inputs.set_inputs(inputs)

    def swap(self, exe: PipelineExecutable) -> Migration | None:
        """Run ``exe`` from the next step. A spec with the same `state_layout` only switches
        (no device wait: the steps in flight keep running); any other migrates."""
        if state_layout(exe.spec) == state_layout(self.spec):
            self.stages.spec = exe.spec
            return None
        return self.migrate(exe)

    def migrate(self, exe: PipelineExecutable) -> Migration:
        """`StageState.migrate`: every moved layer to its new stage, bit for bit."""
        return self.stages.migrate(exe)

    # -- the step ----------------------------------------------------------------------------

    def batch_placements(self, batch_size: int) -> list[Placement]:
        """`StageInputs.batch_placements`: where a step puts batch rows."""
        return self.inputs.batch_placements(batch_size)

    def step(
        self,
        exe: PipelineExecutable,
        inputs: np.ndarray,
        targets: np.ndarray,
        batch_in: BatchInputs | None = None,
        rows: np.ndarray | None = None,
    ) -> dict[str, Any]:
        """One training step on a host batch ([B, S] tokens; ``batch_in``: its batch inputs,
        `dynjax.parallel.step_inputs`), or on the
        ``rows`` of it this process read (`batch_placements`; default all B).

        Returns ``{"stages": {stage: metrics}}`` (this process's stages) as device arrays;
        `host_metrics` turns the host copies of all stages into the single-program metrics.
        """
        run = self.runner.start(exe, inputs, targets, batch_in, rows)
        for s, task, action in exe.order:
            self.runner.dispatch(run, s, task, action)
        return self.runner.finish(run)

    def timed_step(
        self,
        exe: PipelineExecutable,
        inputs: np.ndarray,
        targets: np.ndarray,
        batch_in: BatchInputs | None = None,
        rows: np.ndarray | None = None,
    ) -> tuple[dict[str, Any], tuple[tuple[TaskTime, ...], ...]]:
        """`step`, with each stage's timeline of tasks in seconds from the start of the step
        (what the pipeline simulator of `dynjax.balance` predicts). Blocks until the timeline is
        complete; `start_timed_step` does not."""
        self.stages.require_every_stage("the timeline of every stage")
        metrics, timeline = self.start_timed_step(exe, inputs, targets, batch_in, rows)
        rows_of = timeline.result()
        return metrics, tuple(rows_of[s] for s in sorted(rows_of))

    def start_timed_step(
        self,
        exe: PipelineExecutable,
        inputs: np.ndarray,
        targets: np.ndarray,
        batch_in: BatchInputs | None = None,
        rows: np.ndarray | None = None,
    ) -> tuple[dict[str, Any], PendingTimeline]:
        """`TimedSteps.start`: `step`, returning once it is dispatched, with the timeline of
        this process's stages still being taken."""
        return self.timed.start(exe, inputs, targets, batch_in, rows)

    def profile_step(
        self,
        exe: PipelineExecutable,
        inputs: np.ndarray,
        targets: np.ndarray,
        batch_in: BatchInputs | None = None,
        rows: np.ndarray | None = None,
        *,
        repeats: int = 3,
    ) -> tuple[dict[str, Any], Profile]:
        """`start_profile_step`, waiting for its `Profile`."""
        metrics, pending = self.start_profile_step(
            exe, inputs, targets, batch_in, rows, repeats=repeats
        )
        return metrics, pending.result()

    def start_profile_step(
        self,
        exe: PipelineExecutable,
        inputs: np.ndarray,
        targets: np.ndarray,
        batch_in: BatchInputs | None = None,
        rows: np.ndarray | None = None,
        *,
        repeats: int = 3,
    ) -> tuple[dict[str, Any], PendingProfile]:
        """`Profiler.start`: a timed step, then each unit's time and each stage's memory."""
        return self.profiler.start(exe, inputs, targets, batch_in, rows, repeats=repeats)

    # -- evaluation ----------------------------------------------------------------------------

    def evaluate(self, batches: Iterable[tuple[np.ndarray, np.ndarray]]) -> float | None:
        """`evaluation.evaluate`: the mean next-token loss over host batches, at inference."""
        return evaluate(self.stages, self.inputs, batches)


def host_metrics(raw: Mapping[str, Any], hooks: Hooks) -> dict[str, Any]:
    """Host copies of `Pipeline.step` metrics of every stage -> the single-program metrics
    (`metrics.fold_stages` by the reductions ``hooks`` declare), with any others of ``raw``
    (e.g. a profile's metrics)."""
    by_stage: Mapping[int, Mapping[str, np.ndarray]] = raw["stages"]
    out = fold_stages([by_stage[s] for s in sorted(by_stage)], hooks)
    return {**out, **{k: v for k, v in raw.items() if k != "stages"}}
