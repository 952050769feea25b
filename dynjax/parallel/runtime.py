"""The two runtimes behind one `Runtime` protocol: the single-program step and the MPMD
pipeline. The training loop makes the same calls on either (docs/architecture.md "Runtime").

A runtime holds the training state and runs steps of its current Plan; it takes what it needs as
arguments (built once, at the edge, by `dynjax.experiment.Experiment.runtime`) and never reads
the config.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import jax
import numpy as np

from dynjax.parallel.executable import PipelinePrograms
from dynjax.parallel.feed import local_devices, process_rows
from dynjax.parallel.layout import join
from dynjax.parallel.mesh import batch_sharding
from dynjax.parallel.peers import Rounds
from dynjax.parallel.pipeline import Pipeline, host_metrics
from dynjax.parallel.profiler import PendingProfile
from dynjax.parallel.stage_state import Migration
from dynjax.parallel.stages import PipelineSpec
from dynjax.parallel.step_inputs import BatchInputs, StepInputs

if TYPE_CHECKING:  # carried, never built here: parallel sits below the data
    from dynjax.data import Batch

# A `dynjax.recompile.Plan`: runtimes carry it to the callables they were given, never read it
# (parallel sits below recompile).
Plan = Hashable


class Runtime(Protocol):
    """What the training loop calls, whichever program runs the steps."""

    def step(self, executable, batch: Batch, batch_in: BatchInputs | None) -> Any:
        """Dispatch one step; returns its metrics as device arrays (never waits for them)."""

    def batch_rows(self, devices: frozenset[jax.Device] | None = None) -> np.ndarray:
        """The rows of each batch that ``devices`` (default: this process's) consume."""

    def host_metrics(self, step: int, metrics: dict[str, Any]) -> dict[str, np.ndarray]:
        """``step``'s metrics, once on the host, as the policies and logs read them."""

    def swap(self, plan: Plan, executable) -> Migration | None:
        """Run ``plan`` from the next step on; the migration if layers moved."""

    def stages_available(self, used: int) -> int:
        """The stage sub-meshes a new Plan may use while the Controller's Plan uses ``used``."""

    def release_unused(self) -> tuple[tuple[int, ...], list[jax.Device]]:
        """Give back the stage sub-meshes the current Plan leaves unused."""

    def checkpoint_state(self) -> dict[str, Any]:
        """The state a checkpoint saves (this process's leaves)."""

    def stage_states(self) -> list[dict[str, Any]]:
        """The live ``{"params", "opt_state"}`` dict of each stage (`Plugin.before_step`)."""

    def evaluate(self, plan: Plan) -> float | None:
        """Mean validation loss under ``plan``; None without validation batches."""


class SingleProgramRuntime:
    """The training state of the single-program step, and the calls the training loop makes.

    ``place_batch(batch, batch_in, plan)`` puts a host batch on the mesh (how depends on the
    run's sharding) and ``eval_step(plan)`` is the jitted validation loss of one batch under
    ``plan`` (`Experiment.eval_step`), run over ``val_batches``."""

    def __init__(
        self,
        state: dict[str, Any],
        plan: Plan,
        *,
        pipeline_stages: int,
        mesh: jax.sharding.Mesh,
        batch_size: int,
        seq_len: int,
        place_batch: Callable[[Batch, np.ndarray | None, Plan], dict[str, jax.Array]],
        eval_step: Callable[[Plan], Callable],
        val_batches: Sequence[Batch],
    ) -> None:
        self.state, self.plan, self.mesh = state, plan, mesh
        self.pipeline_stages = pipeline_stages
        self.batch_size, self.seq_len = batch_size, seq_len
        self._place_batch, self.eval_step, self.val_batches = place_batch, eval_step, val_batches

    def step(self, executable, batch: Batch, batch_in: BatchInputs | None):
        """Dispatch one step; returns its metrics as device arrays."""
        state = self.state
        state["params"], state["opt_state"], metrics = executable(
            state["params"], state["opt_state"], self._place_batch(batch, batch_in, self.plan)
        )
        return metrics

    def batch_rows(self, devices: frozenset[jax.Device] | None = None) -> np.ndarray:
        """The rows of each batch that ``devices`` (default: this process's) consume."""
        placement = (batch_sharding(self.mesh), np.arange(self.batch_size))
        return process_rows([placement], self.seq_len, devices or local_devices())

    def host_metrics(self, step: int, metrics: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return metrics

    def swap(self, plan: Plan, executable) -> Migration | None:
        """Every Plan of this runtime shares one state layout: nothing to migrate (the next
        batches carry the new Plan's step inputs)."""
        self.plan = plan
        return None

    def stages_available(self, used: int) -> int:
        return self.pipeline_stages

    def release_unused(self) -> tuple[tuple[int, ...], list[jax.Device]]:
        """One program over the whole mesh: nothing to give back."""
        return (), []

    def checkpoint_state(self) -> dict[str, Any]:
        return self.state

    def stage_states(self) -> list[dict[str, Any]]:
        """The live ``{"params", "opt_state"}`` dict of each stage (one here), for plugins
        that change the state between steps (`Plugin.before_step`)."""
        return [self.state]

    def evaluate(self, plan: Plan) -> float | None:
        if not self.val_batches:
            return None
        fn, params = self.eval_step(plan), self.state["params"]
        losses = [fn(params, self._place_batch(b, None, plan)) for b in self.val_batches]
        return float(np.mean(jax.device_get(losses)))


class PipelineRuntime:
    """The MPMD pipeline behind the same calls as `SingleProgramRuntime`.

    A Plan with fewer stages than the mesh (a re-pack, seed 000 §3.4) runs stage s on sub-mesh
    s; `release_unused` then gives the trailing sub-meshes back for good: later Plans may not
    use them (`stages_available`), since a cluster scheduler may have handed them to another job.
    A Plan with fewer stages is always released down to when swapped in, so no Plan ever uses
    more stage sub-meshes than the one before it.

    ``rounds(name)`` is the run's numbered exchange of that name between the processes of a
    pipeline over several (`Experiment.stage_rounds`): metrics and evaluations combine there.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        pipeline_stages: int,
        batch_size: int,
        seq_len: int,
        step_inputs: Callable[[Plan], StepInputs],
        val_batches: Sequence[Batch],
        rounds: Callable[[str], Rounds],
    ) -> None:
        self.pipeline, self.step_inputs = pipeline, step_inputs
        self.batch_size, self.seq_len = batch_size, seq_len
        self.val_batches, self.rounds = val_batches, rounds
        self.available_stages = pipeline_stages

    def stages_available(self, used: int) -> int:
        """The stage sub-meshes the Controller's Plan uses (``used`` of them): those beyond it are
        released when it is swapped in (the Controller publishes a Plan before the training
        loop swaps and releases), so a new Plan may not count on them."""
        return min(self.available_stages, used)

    def release_unused(self) -> tuple[tuple[int, ...], list[jax.Device]]:
        """Give back the stage sub-meshes the current Plan does not use: returns their indices
        and devices (empty when there are none). Their state already moved away (`swap`)."""
        used = self.pipeline.spec.num_stages
        stages = tuple(range(used, self.available_stages))
        if not stages:
            return (), []
        self.available_stages = used
        self.pipeline.programs.release(stages)
        meshes = self.pipeline.transport.stage_meshes
        return stages, [d for s in stages for d in meshes[s].devices.flat]

    def batch_rows(self, devices: frozenset[jax.Device] | None = None) -> np.ndarray:
        """The rows of each batch that ``devices`` (default: this process's) consume: every row
        of every microbatch their first stage's inputs or their targets-reading stages hold (a
        process with only middle stages reads none)."""
        placements = self.pipeline.batch_placements(self.batch_size)
        return process_rows(placements, self.seq_len, devices or local_devices())

    def step(self, executable, batch: Batch, batch_in: BatchInputs | None):
        return self.pipeline.step(executable, batch.inputs, batch.targets, batch_in, batch.rows)

    def profile_step(self, executable, batch: Batch, batch_in: BatchInputs | None):
        """`step`, profiled (blocks): returns (metrics with the profile's added, Profile). On a
        new layout the units a Plan change made new run alone and the others keep their times;
        later profiles rescale them by their step's timeline (`Pipeline.start_profile_step`).

        The metrics also name the layout that ran (`profile/stage_layers`, layers per stage),
        so a policy can tell a profile of the current Plan from an older one."""
        metrics, pending = self.start_profile_step(executable, batch, batch_in)
        profile = pending.result()
        return {**metrics, **profile.metrics()}, profile

    def start_profile_step(
        self, executable, batch: Batch, batch_in: BatchInputs | None
    ) -> tuple[dict[str, Any], PendingProfile]:
        """`profile_step` without waiting for a periodic profile (`Pipeline.start_profile_step`):
        returns the step's metrics and the pending `Profile`, whose metrics the training loop
        adds to the step's when the Monitor hands them over (Δ steps later: the step is done)."""
        return self.pipeline.start_profile_step(
            executable, batch.inputs, batch.targets, batch_in, batch.rows
        )

    def host_metrics(self, step: int, metrics: dict[str, Any]) -> dict[str, np.ndarray]:
        """The host metrics of ``step``: every process contributes its stages' (in order)."""
        stages = {}
        # Numbered by exchange, not by step: a step repeats after an in-memory recovery.
        for part in self.rounds("metrics").all(metrics["stages"]):
            stages.update(part)
        hooks = self.pipeline.programs.setup.parts.cfg.hooks
        return host_metrics({**metrics, "stages": stages}, hooks)

    def swap(self, plan: Plan, executable) -> Migration | None:
        """Migrate layers to their new stages when the state layout changed (`Pipeline.swap`);
        a change of step inputs, batch inputs or schedule swaps without waiting (the next
        steps take the new Plan's step inputs)."""
        migration = self.pipeline.swap(executable)
        self.pipeline.set_inputs(self.step_inputs(plan))
        return migration if migration is not None and migration.layers else None

    def checkpoint_state(self) -> dict[str, Any]:
        """This process's stages' leaves (`Pipeline.full_state`): all of them in one process."""
        return self.pipeline.full_state()

    def stage_states(self) -> list[dict[str, Any]]:
        """The live ``{"params", "opt_state"}`` dict of each stage of this process, in stage
        order, keyed as in the full state (`Plugin.before_step`)."""
        return [self.pipeline.state[s] for s in sorted(self.pipeline.state)]

    def evaluate(self, plan: Plan) -> float | None:
        local = self.pipeline.evaluate((b.inputs, b.targets) for b in self.val_batches)
        losses = self.rounds("eval").all(local)  # the last stage's process has it
        return next((loss for loss in losses if loss is not None), None)


def pipeline_target(
    programs: PipelinePrograms, spec: PipelineSpec, abstract_state: dict[str, Any]
) -> dict[str, Any]:
    """``abstract_state`` with each leaf in the sharding of the first stage of ``spec`` that
    holds it, so a checkpoint restores straight onto the pipeline's devices; over processes,
    the leaves of this process's stages only (None elsewhere)."""
    transport = programs.transport
    stages = [programs.shapes(s) for s in spec.stages if transport.is_local(s.index)]
    return join(
        abstract_state,
        [{"params": s.params, "opt_state": s.opt_state} for s in stages],
        partial=not transport.all_local,
    )
