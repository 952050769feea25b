"""The MPMD pipeline runtime: per-stage state, the schedule's tasks, migration between stages.

DESIGN.md "Parallelism": each stage runs its own programs (`stage_programs`) on its own
sub-mesh, so stages may hold different numbers of layers of different shapes and layers can
move. A step walks the global dispatch order of the schedule's task lists (`dispatch`), sends
activations (with the block wrappers' carry) and their gradients to the neighbour stage
(`Transport.send`), accumulates gradients over the microbatches, sums the per-stage gradient
norms over all stages for clipping and updates each stage's parameters. Stages whose wrappers
read the model's readout (early exit) get the last stage's norm and head parameters once per
step and send their gradient back to it before the norms (`stage_programs`). It dispatches
everything asynchronously and returns the step's metrics as device arrays; it never waits for
a result inside a step.

Programs are compiled per kind and the part of the `StageSpec` they depend on (`program_key`):
a Plan whose stage assignment changes compiles only the stages whose layers changed, and
`Pipeline.migrate` moves each moved layer's parameters and optimizer state to its new stage bit
for bit (seed 000 §4.1). A Plan that keeps the state layout (`state_layout`: capacities, cached
routing, the schedule changed) swaps in without touching the state or waiting for the device.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dynjax.jax_private import copy_to
from dynjax.parallel.dispatch import dispatch_order
from dynjax.parallel.feed import Placement, place_microbatches
from dynjax.parallel.layout import join, relayout
from dynjax.parallel.mesh import TOKEN_AXES
from dynjax.parallel.peers import Rounds
from dynjax.parallel.profile import (
    Profile,
    ProfilePart,
    TaskTime,
    UnitSeconds,
    busy_seconds,
    known_unit_seconds,
    merged,
    program_temp_bytes,
    rescaled_units,
    stage_memory,
    unit_programs,
    unit_seconds,
    units_busy_seconds,
)
from dynjax.parallel.stage_programs import (
    READOUT_UNITS,
    StageSetup,
    StageShapes,
    add_readout_grads,
    lower_stage,
    stage_shapes,
)
from dynjax.parallel.stages import PipelineSpec, StageSpec
from dynjax.parallel.transport import Transport

ProgramKey = tuple[str, int]  # (kind, stage)
UnitKey = tuple[str, StageSpec]  # (kind, one-unit spec): a profiling program


def program_kinds(spec: StageSpec) -> tuple[str, ...]:
    """The training programs one stage needs."""
    kinds = () if spec.last else ("fwd",)
    kinds += ("bwd",) if spec.has_backward else ()
    return kinds + ("sqnorm", "update")


def program_key(kind: str, spec: StageSpec) -> tuple[str, StageSpec]:
    """The part of a stage's spec one of its programs depends on: its compile-cache key.

    The gradient norm and the update see parameters, gradients and metrics, whose shapes do
    not depend on capacities or cached routing: a capacity change recompiles only the forward
    and backward of the stages whose capacities changed (on the ragged MoE path: whose totals
    changed; the capacities themselves are a runtime input).
    """
    if kind in ("sqnorm", "update"):
        return kind, replace(spec, capacities=(), ragged_totals=(), cached_routing=False)
    return kind, spec


def state_layout(spec: PipelineSpec) -> tuple:
    """What the per-stage state trees depend on: the units each stage holds and which of them
    train (the gradient accumulator's). Plans equal here share one state: swapping between them
    moves nothing."""
    return tuple(
        (s.index, s.first, s.last, s.layers, s.frozen, s.embed_frozen) for s in spec.stages
    )


@dataclasses.dataclass(frozen=True)
class PipelineExecutable:
    """Compiled programs for every stage (of this process) of one `PipelineSpec`."""

    spec: PipelineSpec
    programs: Mapping[ProgramKey, Any]  # (kind, stage) -> jax.stages.Compiled
    compiled: tuple[ProgramKey, ...]  # compiled for this spec; the others came from the cache
    order: tuple[tuple[int, Any], ...]  # global dispatch order of (stage, task)
    # `profile.unit_programs` of this process's stages (none: it has none); None: lowered
    # without them
    profiling: Mapping[UnitKey, Any] | None


@dataclasses.dataclass
class LoweredPipeline:
    """Programs lowered for a spec; `compile()` (on the Compiler's worker) builds the rest."""

    spec: PipelineSpec
    programs: PipelinePrograms
    ready: dict[ProgramKey, Any]
    lowered: dict[ProgramKey, tuple[StageSpec, jax.stages.Lowered]]
    profiling_ready: dict[UnitKey, Any] | None  # None: lowered without the one-unit programs
    profiling_lowered: dict[UnitKey, jax.stages.Lowered]

    def compile(self) -> PipelineExecutable:
        programs = dict(self.ready)
        for key, (stage, lowered) in self.lowered.items():
            programs[key] = self.programs.store(key[0], stage, lowered.compile())
        profiling = None if self.profiling_ready is None else dict(self.profiling_ready)
        for (kind, one), lowered in self.profiling_lowered.items():
            profiling[kind, one] = self.programs.store(kind, one, lowered.compile())
        return PipelineExecutable(
            self.spec,
            programs,
            tuple(sorted(self.lowered)),
            dispatch_order(self.spec.tasks),
            profiling,
        )


class PipelinePrograms:
    """Lowers stage programs and keeps the compiled ones by (kind, `StageSpec`).

    `lower(spec)` runs on the caller's thread (tracing holds the GIL), `compile()` of its result
    on the Compiler's worker; programs of stages whose spec did not change are reused.
    """

    def __init__(
        self,
        setup: StageSetup,
        transport: Transport,
        full_params: Any,
        seq_len: int,
        *,
        max_entries: int = 64,
    ) -> None:
        self.setup, self.transport = setup, transport
        self.full_params, self.seq_len = full_params, seq_len
        self.max_entries = max_entries
        self._compiled: OrderedDict[tuple[str, StageSpec], Any] = OrderedDict()
        self._shapes: dict[StageSpec, StageShapes] = {}
        self._lock = threading.Lock()

    def shapes(self, spec: StageSpec) -> StageShapes:
        """Abstract state and inputs of a stage. Traced without the lock: the training thread
        reads them every task while the controller's thread may be tracing a new Plan's."""
        hit = self._shapes.get(spec)
        if hit is None:
            mesh = self.transport.stage_meshes[spec.index]
            hit = stage_shapes(self.setup, spec, mesh, self.full_params, self.seq_len)
            hit = self._shapes.setdefault(spec, hit)
        return hit

    def lower(self, spec: PipelineSpec, *, profiling: bool = False) -> LoweredPipeline:
        """The programs of this process's stages: cached ones ready, the others lowered; with
        ``profiling``, the one-unit programs that profile the spec's step too."""
        ready, lowered = {}, {}
        for stage in spec.stages:
            if not self.transport.is_local(stage.index):
                continue
            for kind in program_kinds(stage):
                hit = self._cached(kind, stage)
                if hit is not None:
                    ready[kind, stage.index] = hit
                else:
                    lowered[kind, stage.index] = (stage, self.lower_one(kind, stage))
        units_ready, units_lowered = {}, {}
        for kind, one in unit_programs(spec, self.setup.parts) if profiling else ():
            if not self.transport.is_local(one.index):
                continue
            hit = self._cached(kind, one)
            if hit is not None:
                units_ready[kind, one] = hit
            else:
                units_lowered[kind, one] = self.lower_one(kind, one)
        return LoweredPipeline(
            spec, self, ready, lowered, units_ready if profiling else None, units_lowered
        )

    def _cached(self, kind: str, stage: StageSpec) -> Any:
        """A compiled program (now the most recently used), or None."""
        key = program_key(kind, stage)
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
        return hit

    def lower_one(self, kind: str, stage: StageSpec) -> jax.stages.Lowered:
        mesh = self.transport.stage_meshes[stage.index]
        return lower_stage(kind, self.setup, stage, mesh, self.shapes(stage))

    def store(self, kind: str, stage: StageSpec, compiled: Any) -> Any:
        key = program_key(kind, stage)
        with self._lock:
            self._compiled[key] = compiled
            self._compiled.move_to_end(key)
            while len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
        return compiled

    def release(self, stages: Iterable[int]) -> None:
        """Drop the programs and shapes of stage sub-meshes given back after a re-pack."""
        gone = set(stages)
        with self._lock:
            for key in [k for k in self._compiled if k[1].index in gone]:
                del self._compiled[key]
            self._shapes = {k: v for k, v in self._shapes.items() if k.index not in gone}

    def get(self, kind: str, stage: StageSpec) -> Any:
        """A compiled program, compiling it now if needed (evaluation programs)."""
        with self._lock:
            hit = self._compiled.get(program_key(kind, stage))
        if hit is None:
            hit = self.store(kind, stage, self.lower_one(kind, stage).compile())
        return hit


@dataclasses.dataclass(frozen=True)
class Migration:
    """What `Pipeline.migrate` did: the ``migrate`` event of events.jsonl."""

    moves: tuple[tuple[int, int, int], ...]  # (layer, from stage, to stage)
    bytes: int  # parameter and optimizer-state bytes copied between stages
    seconds: float  # copying, after the steps in flight finished
    recompiled_stages: tuple[int, ...]  # stages whose programs the new Plan compiled

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(m[0] for m in self.moves)

    def event(self, step: int) -> dict[str, Any]:
        return {
            "event": "migrate",
            "step": step,
            "layers": list(self.layers),
            "moves": [list(m) for m in self.moves],
            "bytes": self.bytes,
            "seconds": self.seconds,
            "recompiled_stages": list(self.recompiled_stages),
        }


class Pipeline:
    """The training state of every stage and the step that runs a `PipelineExecutable` on it.

    State per stage: ``{"params", "opt_state"}`` keyed by name as in the full state (see
    `layout`), plus the gradient accumulator of its trainable units (zero between steps).
    """

    def __init__(
        self, programs: PipelinePrograms, full_template: Any, profiles: Rounds | None = None
    ) -> None:
        self.programs = programs
        self.transport = programs.transport
        # The other processes' stages' profiles come through it (None: this process profiles
        # alone). Its numbering outlives this pipeline (`Experiment.stage_rounds`).
        self.profiles = profiles
        # One watcher thread per stage, kept across timed steps (`start_timed_step`): starting
        # threads every step cost more CPU than the step's waits.
        self._watchers: dict[int, queue.SimpleQueue] = {}
        weakref.finalize(self, _stop_watchers, self._watchers)  # they end with the pipeline
        self.full_template = full_template  # the full {"params", "opt_state"} tree (structure)
        self.spec: PipelineSpec | None = None
        self.state: dict[int, dict[str, Any]] = {}
        self.acc: dict[int, Any] = {}
        self.racc: dict[int, Any] = {}  # readout-gradient accumulators (empty where unused)
        # The newest unit measurement of this process's stages: (the spec it ran on, their
        # units' times, each stage's busy seconds as they add up), what a periodic profile
        # rescales. Not the busy seconds of the step they were measured after: that step may
        # be a program's first run (or, over processes, include their first connection).
        self._measured_units: tuple[PipelineSpec, UnitSeconds, dict[int, float]] | None = None
        # Those units' times by timing signature (`unit_seconds`): after a Plan change only the
        # units it made new run alone.
        self._unit_times: dict[tuple, tuple[float, float]] = {}
        # The newest executable's `stage_memory` (`_memory`).
        self._memory_of: tuple[PipelineExecutable, dict[int, dict[str, int]]] | None = None
        # Per stage, the first parameter leaf the last update wrote and one of that update's
        # metrics, ready with it (`_ready_marks`).
        self._updated: dict[int, tuple[jax.Array, jax.Array]] = {}
        # The ragged MoE path's per-expert capacities [MoE layers, E] (`set_capacities`), and
        # each stage's rows of them on its sub-mesh, placed once per (stage, MoE layers).
        self.capacities: np.ndarray | None = None
        self._stage_capacities: dict[tuple[int, tuple[int, ...]], jax.Array] = {}

    # -- state -------------------------------------------------------------------------------

    def _local(self, spec: PipelineSpec) -> list[StageSpec]:
        return [s for s in spec.stages if self.transport.is_local(s.index)]

    def _templates(self, spec: PipelineSpec, every: bool = False) -> dict[int, dict[str, Any]]:
        """The abstract state of this process's stages (``every``: of all stages)."""
        out = {}
        for stage in spec.stages if every else self._local(spec):
            shapes = self.programs.shapes(stage)
            out[stage.index] = {"params": shapes.params, "opt_state": shapes.opt_state}
        return out

    def _zero_acc(self, spec: PipelineSpec, which: str = "acc") -> dict[int, Any]:
        """Zero accumulators (``which``: "acc" or "racc") of this process's stages."""
        zeros = lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding)
        return {
            s.index: jax.tree.map(zeros, getattr(self.programs.shapes(s), which))
            for s in self._local(spec)
        }

    def _single_process(self, what: str) -> None:
        if not self.transport.all_local:
            raise ValueError(f"{what} needs every pipeline stage in this process")

    def place(self, state: Any, spec: PipelineSpec) -> None:
        """Split the full ``{"params", "opt_state"}`` tree (host arrays, or device arrays: a
        leaf already in its stage's sharding stays where it is) onto this process's stages."""
        put = lambda array, _src, _dst, sharding: jax.device_put(array, sharding)
        # The full tree is one more "stage" (-1) that holds every leaf.
        self.state, _ = relayout({-1: state}, self._templates(spec), put)
        self.acc, self.racc, self.spec = self._zero_acc(spec), self._zero_acc(spec, "racc"), spec
        self._updated = {}

    def full_state(self) -> Any:
        """The full ``{"params", "opt_state"}`` tree of the stages' own arrays, each shared
        leaf from the first stage holding it: nothing is copied (checkpoints save it shard by
        shard). Over several processes, this process's stages' leaves, and None where only
        another process's stage holds one (the part of a checkpoint this process writes)."""
        stages = [self.state[s] for s in sorted(self.state)]
        return join(self.full_template, stages, partial=not self.transport.all_local)

    def host_state(self) -> Any:
        """The full ``{"params", "opt_state"}`` tree as host arrays."""
        return jax.device_get(self.full_state())

    def set_capacities(self, capacities: Any) -> None:
        """The ragged MoE path's per-expert capacities ([MoE layers, E], model order) that the
        next steps and evaluations run with: an input of the stage programs (``ctx``), so a
        change within the stages' totals (`StageSpec.ragged_totals`) compiles nothing."""
        self.capacities = np.asarray(capacities, np.int32)
        self._stage_capacities = {}

    def _capacities_of(self, stage: StageSpec) -> dict[str, jax.Array]:
        """``{"capacities": the stage's rows}`` on its sub-mesh; empty off the ragged path."""
        if not stage.ragged_totals:
            return {}
        key = (stage.index, stage.moe)
        if key not in self._stage_capacities:
            if self.capacities is None:
                raise ValueError("the ragged MoE path runs with capacities: set_capacities first")
            moe = [i for st in self.spec.stages for i in st.moe]
            rows = self.capacities[[moe.index(i) for i in stage.moe]]
            sharding = self.transport.sharding(stage.index, P())
            self._stage_capacities[key] = jax.device_put(rows, sharding)
        return {"capacities": self._stage_capacities[key]}

    def swap(self, exe: PipelineExecutable) -> Migration | None:
        """Run ``exe`` from the next step. A spec with the same `state_layout` only switches
        (no device wait: the steps in flight keep running); any other migrates."""
        if state_layout(exe.spec) == state_layout(self.spec):
            self.spec = exe.spec
            return None
        return self.migrate(exe)

    def migrate(self, exe: PipelineExecutable) -> Migration:
        """Lay the state out for ``exe``: every layer whose stage changed moves to its new stage
        with its optimizer state, bit for bit; the others stay where they are. Across processes
        both owners take part in each move (`Transport.send`), in the one order every process
        derives from the two specs."""
        old, spec = self.spec, exe.spec
        jax.block_until_ready(self.state)  # the steps in flight finish first: time the moves only
        start = time.perf_counter()
        held = {**self._templates(old, every=True), **self.state}  # others' stages: abstract
        is_local = self.transport.is_local

        def move(leaf, src: int, dst: int, sharding) -> jax.Array | None:
            like = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
            return self.transport.send(leaf if is_local(src) else None, src, dst, like)

        self.state, moved = relayout(held, self._templates(spec, every=True), move, is_local)
        jax.block_until_ready(self.state)
        seconds = time.perf_counter() - start
        self.acc, self.racc, self.spec = self._zero_acc(spec), self._zero_acc(spec, "racc"), spec
        self._updated = {}
        layers = [i for s in old.stages for i in s.layers if spec.owner(i) != s.index]
        return Migration(
            moves=tuple((i, old.owner(i), spec.owner(i)) for i in layers),
            bytes=moved,
            seconds=seconds,
            recompiled_stages=tuple(sorted({s for _, s in exe.compiled})),
        )

    # -- the step ----------------------------------------------------------------------------

    def _rows(self, stage: int) -> NamedSharding:
        return self.transport.sharding(stage, P(TOKEN_AXES))

    def batch_placements(self, batch_size: int) -> list[Placement]:
        """Where a step puts batch rows: microbatch m (rows ``m::M``) of the inputs on the first
        stage and of the targets on every stage that reads them (`feed.process_rows`)."""
        spec, rows = self.spec, np.arange(batch_size)
        fed = [st.index for st in spec.stages if st.first or st.last or st.needs_targets]
        m_count = spec.microbatches
        return [(self._rows(s), rows[m::m_count]) for s in fed for m in range(m_count)]

    def step(
        self,
        exe: PipelineExecutable,
        inputs: np.ndarray,
        targets: np.ndarray,
        cached: np.ndarray | None = None,
        rows: np.ndarray | None = None,
    ) -> dict[str, Any]:
        """One training step on a host batch ([B, S] tokens; cached: [L_moe, B, S, k]), or on the
        ``rows`` of it this process read (`batch_placements`; default all B).

        Returns ``{"stages": {stage: metrics}}`` (this process's stages) as device arrays;
        `host_metrics` turns the host copies of all stages into the single-program metrics.
        """
        run = self._start(exe, inputs, targets, cached, rows)
        for s, task in exe.order:
            self._run(run, s, task)
        return self._finish(run)

    def timed_step(
        self,
        exe: PipelineExecutable,
        inputs: np.ndarray,
        targets: np.ndarray,
        cached: np.ndarray | None = None,
        rows: np.ndarray | None = None,
    ) -> tuple[dict[str, Any], tuple[tuple[TaskTime, ...], ...]]:
        """`step`, with each stage's timeline of tasks in seconds from the start of the step
        (what the pipeline simulator of `dynjax.balance` predicts). Blocks until the timeline is
        complete; `start_timed_step` does not."""
        self._single_process("the timeline of every stage")
        metrics, timeline = self.start_timed_step(exe, inputs, targets, cached, rows)
        rows_of = timeline.result()
        return metrics, tuple(rows_of[s] for s in sorted(rows_of))

    def start_timed_step(
        self,
        exe: PipelineExecutable,
        inputs: np.ndarray,
        targets: np.ndarray,
        cached: np.ndarray | None = None,
        rows: np.ndarray | None = None,
    ) -> tuple[dict[str, Any], PendingTimeline]:
        """`step`, timed: returns once the step is dispatched, as `step` does, with the timeline
        of this process's stages still being taken (`PendingTimeline.result`).

        The tasks are dispatched exactly as `step` dispatches them, so timing costs the step
        none of its overlap, nor the next steps theirs (a profile every step stays cheap; seed
        000 §3.3.1); one watcher thread per stage waits for that stage's results in order (one
        thread for all would note a task that ends before an earlier-dispatched one on another
        stage only when that one ends). The watchers live as long as the pipeline: starting
        them every step cost the training thread 0.7 ms each. A stage runs its programs in
        order, so a task ends when its results are ready and starts at the latest of its
        dispatch, the end of the stage's previous task and the end of the task that computed
        its input (when that stage is this process's). Each wait is a thread wake-up, most of
        what a profile every step costs in CPU, so the watchers wait for nothing else: not for
        a transfer's arrival (a starved stage's task then includes its input's transfer). The
        watched arrays are none that a later program donates, so later steps may be dispatched
        before the watchers are done.
        """
        run = self._start(exe, inputs, targets, cached, rows)
        local = [s.index for s in self._local(exe.spec)]
        queues = {s: self._watcher(s) for s in local}
        seen: dict[int, list[tuple[Any, float, float, float]]] = {s: [] for s in local}
        errors: list[BaseException] = []
        done = {s: threading.Event() for s in local}
        start = time.perf_counter()
        try:
            for s in local:  # this step's records, then what its first task waits for
                queues[s].put((_BEGIN, seen[s], errors, ()))
                queues[s].put((_READY, start, self._ready_marks(run, s), ()))
            for s, task in exe.order:
                dispatched = time.perf_counter()
                computed = self._run(run, s, task)
                if s in queues:
                    queues[s].put((task, dispatched, (), computed))
            metrics = self._finish(run)
        finally:
            for s, q in queues.items():
                q.put((_END, done[s], None, ()))  # the step's last task is noted
        return metrics, PendingTimeline(list(done.values()), seen, errors, start)

    def _watcher(self, s: int) -> queue.SimpleQueue:
        """The task queue of stage ``s``'s watcher thread (started on first use)."""
        if s not in self._watchers:
            self._watchers[s] = queue.SimpleQueue()
            threading.Thread(
                target=_watch, args=(self._watchers[s],), name=f"{WATCHER}{s}", daemon=True
            ).start()
        return self._watchers[s]

    def _ready_marks(self, run: _Run, s: int) -> tuple:
        """Arrays ready when stage ``s`` may start the step: its parameters from the previous
        update (which waits for the global norm, so for every stage's previous backward) and
        the readout sent to it. The timeline counts waiting for them as idle, not as the first
        task's time (a profile of a step dispatched while the previous one still runs). The
        step's update donates the parameters, so what is watched is a metric of the update
        that wrote them (ready with them), or, for parameters no update here wrote (placed,
        migrated, changed by a plugin), a scalar derived from them (one small program)."""
        leaves = jax.tree.leaves(self.state[s]["params"])
        updated = self._updated.get(s)
        if not leaves:
            marks = []
        elif updated is not None and updated[0] is leaves[0]:
            marks = [updated[1]]
        else:
            marks = [_MARK(leaves[0])]
        return _present(marks, run.readout.get(s))

    def profile_step(
        self,
        exe: PipelineExecutable,
        inputs: np.ndarray,
        targets: np.ndarray,
        cached: np.ndarray | None = None,
        rows: np.ndarray | None = None,
        *,
        repeats: int = 3,
    ) -> tuple[dict[str, Any], Profile]:
        """`start_profile_step`, waiting for its `Profile`."""
        metrics, pending = self.start_profile_step(
            exe, inputs, targets, cached, rows, repeats=repeats
        )
        return metrics, pending.result()

    def start_profile_step(
        self,
        exe: PipelineExecutable,
        inputs: np.ndarray,
        targets: np.ndarray,
        cached: np.ndarray | None = None,
        rows: np.ndarray | None = None,
        *,
        repeats: int = 3,
    ) -> tuple[dict[str, Any], PendingProfile]:
        """A timed step, then each unit's forward and backward time and each stage's memory
        (seed 000 §3.1: the step after a change is profiled).

        On a layout not profiled yet (the first profile after a swap), units whose timing
        signature no earlier measurement holds (a Plan change made them new: `unit_seconds`)
        then run alone, the step waited for; the others keep their times (with none new, this
        returns at once). A later profile of the layout rescales its units' times by its own
        step's timeline (`rescaled_units`) and returns as soon as the step is dispatched: the
        `Profile` is built when asked for, once the watchers are done, so a periodic profile
        costs the training loop no wait (seed 000 §3.3.1). Memory is computed once per
        executable. The one-unit programs come with ``exe`` (lowered with ``profiling``):
        nothing compiles here, on the training thread.

        Each process measures its own stages; over several processes (``profiles``) every process
        must profile the same steps and ask for their `Profile`s in the same order: each then
        exchanges its part with the others' (`merged`), and all hold the same `Profile`.
        """
        if exe.profiling is None:
            raise ValueError(
                "profiling a step needs its one-unit programs: lower the spec with "
                "PipelinePrograms.lower(spec, profiling=True)"
            )
        if self.profiles is None:
            self._single_process("profiling without the other processes (profiles)")
        memory = self._memory(exe)
        layout = tuple(len(stage.layers) for stage in exe.spec.stages)
        parts = self.programs.setup.parts
        measured = self._measured_units
        if measured is not None and measured[0] == exe.spec:
            metrics, pending = self.start_timed_step(exe, inputs, targets, cached, rows)
            _, units, then = measured

            def rescaled() -> Profile:
                timeline = pending.result()
                start = time.perf_counter()
                factors = {
                    s: busy_seconds(row) / then[s] if then[s] > 0 else 1.0
                    for s, row in timeline.items()
                }
                units_now = rescaled_units(units, exe.spec, factors)
                part = ProfilePart(units_now, memory, timeline, units_measured=False)
                return self._gathered(part, layout, time.perf_counter() - start)

            return metrics, PendingProfile(rescaled)
        stages = set(self.state)  # this process's
        known = known_unit_seconds(exe.spec, parts, stages=stages, known=self._unit_times)
        metrics, pending = self.start_timed_step(exe, inputs, targets, cached, rows)
        if known is not None:
            # Nothing new to time: the units keep their times as measured alone. Not rescaled
            # from this step, the first of the layout's programs (a first run may load them).
            self._measured_units = (exe.spec, known, units_busy_seconds(known, exe.spec))

            def kept() -> Profile:
                part = ProfilePart(known, memory, pending.result(), units_measured=True)
                return self._gathered(part, layout, 0.0)

            return metrics, PendingProfile(kept)
        timeline = pending.result()
        start = time.perf_counter()
        local = {s: st["params"] for s, st in self.state.items()}  # the step's updated ones
        units, self._unit_times = unit_seconds(
            exe.spec,
            local,
            lambda kind, one: exe.profiling[kind, one],
            self.programs.shapes,
            parts,
            stages=local.keys(),
            known=self._unit_times,
            repeats=repeats,
        )
        self._measured_units = (exe.spec, units, units_busy_seconds(units, exe.spec))
        part = ProfilePart(units, memory, timeline, units_measured=True)
        seconds = time.perf_counter() - start
        return metrics, PendingProfile(lambda: self._gathered(part, layout, seconds))

    def _gathered(self, part: ProfilePart, layout: tuple[int, ...], seconds: float) -> Profile:
        """The `Profile` of every stage: this process's ``part`` and, over several processes,
        the others' of the same profile (every process asks for them in the same order; the
        exchange's seconds count too)."""
        start = time.perf_counter()
        parts = [part] if self.profiles is None else self.profiles.all(part)
        seconds += time.perf_counter() - start
        return merged(parts, layout, seconds=seconds)

    def _memory(self, exe: PipelineExecutable) -> dict[int, dict[str, int]]:
        """`stage_memory` of this process's stages under ``exe``. The state's shapes and
        shardings are those of ``exe``'s program inputs, so it is computed once per executable
        (walking every shard takes milliseconds: a share of the step at a per-step cadence)."""
        if self._memory_of is None or self._memory_of[0] is not exe:
            temps = program_temp_bytes(exe.programs)
            memory = stage_memory(exe.spec, self.state, self.acc, temps, self.programs.shapes)
            self._memory_of = (exe, memory)
        return self._memory_of[1]

    def _start(self, exe: PipelineExecutable, inputs, targets, cached, rows) -> _Run:
        if exe.spec != self.spec:
            raise ValueError("the state is laid out for another stage assignment: migrate first")
        stages = exe.spec.stages
        size = stages[0].microbatch_size * exe.spec.microbatches
        return _Run(
            exe=exe,
            inputs=inputs,
            targets=targets,
            held=np.arange(size) if rows is None else rows,
            size=size,
            routes=_CachedRoutes(exe.spec, cached, self.transport),
            stage_in=[{} for _ in stages],
            grad_in=[{} for _ in stages],
            metrics=[[None] * exe.spec.microbatches for _ in stages],
            readout=self._send_readout(exe.spec),
        )

    def _send_readout(self, spec: PipelineSpec) -> dict[int, Any]:
        """The last stage's current norm and head parameters on every local stage that reads
        the readout: sent once per step (`stage_programs` module docstring)."""
        last, out = spec.stages[-1].index, {}
        held = None
        if self.transport.is_local(last):
            held = {u[0]: self.state[last]["params"][u[0]] for u in READOUT_UNITS}
        for stage in spec.stages:
            if stage.needs_readout:
                like = self.programs.shapes(stage).ctx["readout"]
                moved = self.transport.send_tree(held, last, stage.index, like)
                if moved is not None:
                    out[stage.index] = moved
        return out

    def _context(
        self, stage: StageSpec, carry: Any, run: _Run | _EvalBatch, m: int, m_count: int
    ) -> dict[str, Any]:
        """What the stage's wrappers read for microbatch ``m`` of ``m_count`` besides the
        readout (carry, targets), and the ragged MoE path's capacities: stored with the stage
        input for the backward."""
        ctx = {} if carry is None else {"carry": carry}
        ctx.update(self._capacities_of(stage))
        if stage.needs_targets:
            ctx["targets"] = run.place("targets", m, m_count, self._rows(stage.index))
        return ctx

    def _run(self, run: _Run, s: int, task: Any) -> tuple:
        """Dispatch one task (and, across processes, this process's side of its transfer);
        returns what it computed as far as it is on this process (what a timed step watches)."""
        spec = run.exe.spec
        stage, m, m_count = spec.stages[s], task.microbatch, spec.microbatches
        programs, local = run.exe.programs, self.transport.is_local(s)
        params = self.state[s]["params"] if local else None
        if task.kind == "F":
            if local and stage.first:
                x = run.place("inputs", m, m_count, self._rows(s))
                run.stage_in[s][m] = (x, self._context(stage, None, run, m, m_count))
            if stage.last:
                return ()  # the last stage's forward runs inside its backward
            y = carry = None
            if local:
                x, ctx = run.take(run.stage_in, s, m, pop=False)
                y, carry, run.metrics[s][m] = programs["fwd", s](
                    params, x, {**ctx, **run.readout_of(s)}, run.routes(s, m)
                )
            after = self.programs.shapes(spec.stages[s + 1])
            carry_like, carry_def = jax.tree.flatten(after.ctx.get("carry", {}))

            def arrive(moved: jax.Array, moved_carry: Any, dst: StageSpec = spec.stages[s + 1]):
                ctx = self._context(dst, moved_carry or None, run, m, m_count)
                run.stage_in[dst.index][m] = (moved, ctx)

            if local and self.transport.is_local(s + 1):  # one copy call with others (`defer`)
                run.defer(
                    [y, *jax.tree.leaves(carry)],
                    [after.x.sharding, *(c.sharding for c in carry_like)],
                    lambda a: arrive(a[0], jax.tree.unflatten(carry_def, a[1:])),
                )
                return _present(y, carry)
            moved = self.transport.send(y, s, s + 1, after.x)
            moved_carry = self.transport.send_tree(carry, s, s + 1, after.ctx.get("carry", {}))
            if moved is not None:
                arrive(moved, moved_carry)
            return _present(y, carry)
        x, ctx = run.take(run.stage_in, s, m, pop=True) if local else (None, None)
        if not stage.has_backward:
            return ()
        out = None
        if local:
            if stage.last:
                seed = run.place("targets", m, m_count, self._rows(s))
            else:
                seed = run.take(run.grad_in, s, m, pop=True)
            out = programs["bwd", s](
                params, self.acc[s], self.racc[s], x, {**ctx, **run.readout_of(s)}, seed,
                run.routes(s, m),
            )
            self.acc[s], self.racc[s] = out[0], out[2]
            if stage.last:
                run.metrics[s][m] = out[3]
        # Not the accumulators: the stage's next backward donates them.
        done = _present(None if out is None else (out[1], out[3:]))
        if not stage.input_grads:
            return done
        like = self.programs.shapes(spec.stages[s - 1]).y
        if local and self.transport.is_local(s - 1):

            def arrive(moved: list[jax.Array], dst: int = s - 1) -> None:
                run.grad_in[dst][m] = moved[0]

            run.defer([out[1]], [like.sharding], arrive)
            return done
        moved = self.transport.send(out[1] if local else None, s, s - 1, like)
        if moved is not None:
            run.grad_in[s - 1][m] = moved
        return done

    def _finish(self, run: _Run) -> dict[str, Any]:
        """Global gradient norm and the update of every stage of this process."""
        stages, programs = run.exe.spec.stages, run.exe.programs
        local = [s.index for s in stages if self.transport.is_local(s.index)]
        run.flush()  # none left unless a schedule sent what no task reads
        self._gather_readout_grads(run.exe.spec)
        sq = {s: programs["sqnorm", s](self.acc[s]) for s in local}
        sq_all = self.transport.gather(sq, (1,), jnp.float32, len(stages))
        stage_metrics = {}
        for s in local:
            st = self.state[s]
            st["params"], st["opt_state"], self.acc[s], stage_metrics[s] = programs["update", s](
                st["params"], st["opt_state"], self.acc[s], sq_all[s], tuple(run.metrics[s])
            )
            leaves = jax.tree.leaves(st["params"])
            if leaves:
                self._updated[s] = (leaves[0], jax.tree.leaves(stage_metrics[s])[0])
        return {"stages": stage_metrics}

    def _gather_readout_grads(self, spec: PipelineSpec) -> None:
        """Add every earlier stage's readout gradient to the last stage's accumulator (the
        norm and head entries), then zero those stages' readout accumulators."""
        last = spec.stages[-1]
        for stage in spec.stages:
            if not stage.needs_readout:
                continue
            s, like = stage.index, self.programs.shapes(last).acc
            grads = self.racc.get(s)
            moved = self.transport.send_tree(
                grads, s, last.index, {k: like[k] for k in self.programs.shapes(stage).racc}
            )
            if moved is not None:
                self.acc[last.index] = _ADD_READOUT(self.acc[last.index], moved)
            if self.transport.is_local(s):
                zeros = lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding)
                self.racc[s] = jax.tree.map(zeros, self.programs.shapes(stage).racc)

    # -- evaluation ----------------------------------------------------------------------------

    def evaluate(self, batches: Iterable[tuple[np.ndarray, np.ndarray]]) -> float | None:
        """Mean next-token loss over host ``(inputs, targets)`` batches (blocks for the result);
        None on a process without the last stage, or without batches.

        A batch runs in microbatches of the largest size that divides both it and the training
        microbatch: a full batch in the training microbatches, a smaller one (a short validation
        set) through stage programs compiled for its size. The programs run as at inference
        (`StageSpec.inference`), so the loss is the one causal sampling would see."""
        losses = []
        for inputs, targets in batches:
            size = math.gcd(len(inputs), self.spec.stages[0].microbatch_size)
            # Only a stage with plugin records can run differently at inference: the others
            # reuse their training forward programs instead of compiling copies.
            stages = [
                replace(stage, microbatch_size=size, inference=bool(stage.options))
                for stage in self.spec.stages
            ]
            m_count, last = len(inputs) // size, stages[-1]
            readout = self._send_readout(self.spec)
            batch = _EvalBatch(inputs, targets)
            for m in range(m_count):
                x, carry = None, None
                if self.transport.is_local(0):
                    x = batch.place("inputs", m, m_count, self._rows(0))
                for stage in stages[:-1]:
                    s, y, out_carry = stage.index, None, None
                    if self.transport.is_local(s):
                        ctx = {**self._context(stage, carry, batch, m, m_count), **(
                            {"readout": readout[s]} if s in readout else {})}
                        fwd = self.programs.get("fwd", replace(stage, cached_routing=False))
                        y, out_carry, _ = fwd(self.state[s]["params"], x, ctx, None)
                    after = self.programs.shapes(stages[s + 1])
                    x = self.transport.send(y, s, s + 1, after.x)
                    carry = self.transport.send_tree(
                        out_carry, s, s + 1, after.ctx.get("carry", {})
                    ) or None
                if self.transport.is_local(last.index):
                    evaluate = self.programs.get("eval", last)
                    t = batch.place("targets", m, m_count, self._rows(last.index))
                    ctx = {} if carry is None else {"carry": carry}
                    ctx.update(self._capacities_of(last))
                    losses.append(evaluate(self.state[last.index]["params"], x, ctx, t))
        return float(np.mean(jax.device_get(losses))) if losses else None


@dataclasses.dataclass
class _Run:
    """The arrays in flight during one step."""

    exe: PipelineExecutable
    inputs: np.ndarray  # the rows ``held`` of the batch's ``size``, on this process
    targets: np.ndarray
    held: np.ndarray
    size: int
    routes: _CachedRoutes
    # [stage][microbatch] -> (stage input, its context), kept for the backward
    stage_in: list[dict[int, Any]]
    grad_in: list[dict[int, Any]]  # [stage][microbatch] -> gradient of the stage output
    metrics: list[list[Any]]  # [stage][microbatch] -> metrics of that forward
    readout: dict[int, Any]  # stage -> the last stage's norm and head parameters, this step
    # (field, microbatches, sharding) -> every microbatch of it, placed at the first request
    placed: dict[tuple[str, int, NamedSharding], list[jax.Array]] = dataclasses.field(
        default_factory=dict
    )

    # copies between this process's stages not made yet: (arrays, target shardings, what
    # receives the copies), made together by `flush` (`defer`)
    deferred: list[tuple[list[jax.Array], list[NamedSharding], Callable[[list], None]]] = (
        dataclasses.field(default_factory=list)
    )

    def defer(
        self, arrays: list[jax.Array], shardings: list[NamedSharding], land: Callable[[list], None]
    ) -> None:
        """Copy ``arrays`` to ``shardings`` (another stage of this process) when a task first
        needs a copy not made yet, together with every other copy pending then: one call of
        many copies (`copy_to`) costs far less host time than one call each (issue 15 §7;
        GPipe's 48 copies a step go in 6 calls). The copies are only enqueued later, never
        made to wait for."""
        self.deferred.append((arrays, shardings, land))

    def flush(self) -> None:
        if not self.deferred:
            return
        arrays = [a for arrays, _, _ in self.deferred for a in arrays]
        shardings = [sh for _, shardings, _ in self.deferred for sh in shardings]
        moved, start = copy_to(arrays, shardings), 0
        for some, _, land in self.deferred:
            land(moved[start : start + len(some)])
            start += len(some)
        self.deferred = []

    def take(self, table: list[dict[int, Any]], s: int, m: int, pop: bool) -> Any:
        """``table[s][m]`` (a stage input or output gradient) once its deferred copy is made;
        ``pop``: removed (its last use frees it)."""
        if m not in table[s]:
            self.flush()
        return table[s].pop(m) if pop else table[s][m]

    def readout_of(self, s: int) -> dict[str, Any]:
        return {"readout": self.readout[s]} if s in self.readout else {}

    def place(self, field: str, m: int, m_count: int, sharding: NamedSharding) -> jax.Array:
        """Microbatch ``m`` (rows ``m::m_count``) of ``field`` on ``sharding`` (a local
        stage's): all ``m_count`` microbatches are placed together on the first request."""
        key = (field, m_count, sharding)
        if key not in self.placed:
            values = getattr(self, field)
            self.placed[key] = place_microbatches(values, self.held, self.size, m_count, sharding)
        return self.placed[key][m]


@dataclasses.dataclass
class _EvalBatch:
    """A validation batch, which every process holds whole (read once, at the start)."""

    inputs: np.ndarray
    targets: np.ndarray

    def place(self, field: str, m: int, m_count: int, sharding: NamedSharding) -> jax.Array:
        return jax.device_put(getattr(self, field)[m::m_count], sharding)


class _CachedRoutes:
    """Cached expert assignments of each stage's MoE layers, per microbatch, on its sub-mesh."""

    def __init__(self, spec: PipelineSpec, cached: np.ndarray | None, transport: Transport):
        self.spec, self.cached, self.transport = spec, cached, transport
        self.first = np.cumsum([0] + [len(s.moe) for s in spec.stages])

    def __call__(self, s: int, m: int) -> jax.Array | None:
        stage = self.spec.stages[s]
        if self.cached is None or not stage.cached_routing or not stage.moe:
            return None
        rows = self.cached[self.first[s] : self.first[s + 1], m :: stage.microbatches]
        return jax.device_put(rows, self.transport.sharding(s, P(None, TOKEN_AXES)))


_ADD_READOUT = jax.jit(add_readout_grads, donate_argnums=0)
_MARK = jax.jit(lambda leaf: leaf.reshape(-1)[0] * 0)  # `Pipeline._ready_marks`: one program
_READY = "ready"  # `Pipeline.timed_step`'s watchers: not a task, the stage's state arriving
_BEGIN, _END = object(), object()  # a watcher's markers of a timed step's first and last items
WATCHER = "dynjax-watch-stage-"  # a watcher thread's name, before its stage's index


def _watch(tasks: queue.SimpleQueue) -> None:
    """One stage's watcher (`Pipeline.start_timed_step`), for the pipeline's life: for each
    (task, its dispatch, what it waits for from before the step, what it computed) of a step,
    in order, notes in the step's records when the former arrived (-inf: nothing to wait for)
    and when the results are ready. A step's items come between (`_BEGIN`, its records, its
    errors) and (`_END`, the event to set once they are noted)."""
    seen: list[tuple[Any, float, float, float]] = []
    errors: list[BaseException] = []
    while (item := tasks.get()) is not None:
        task, dispatched, needs, computed = item
        if task is _BEGIN:
            seen, errors = dispatched, needs
            continue
        if task is _END:
            dispatched.set()
            continue
        if errors:
            continue  # drain: the step failed
        try:
            arrived = -math.inf
            if needs:
                jax.block_until_ready(needs)
                arrived = time.perf_counter()
            jax.block_until_ready(computed)
            end = time.perf_counter() if computed else dispatched
        except BaseException as e:  # re-raised by `PendingTimeline.result`
            errors.append(e)
            continue
        seen.append((task, dispatched, arrived, end))


def _stop_watchers(watchers: dict[int, queue.SimpleQueue]) -> None:
    """End a discarded pipeline's watcher threads (after the items already queued)."""
    for tasks in watchers.values():
        tasks.put(None)


class PendingTimeline:
    """The timeline of a dispatched step, which its stages' watcher threads are still taking."""

    def __init__(
        self, done: list[threading.Event],
        seen: dict[int, list[tuple[Any, float, float, float]]], errors: list[BaseException],
        start: float,
    ) -> None:
        self._done, self._seen, self._errors, self._start = done, seen, errors, start

    def result(self) -> dict[int, tuple[TaskTime, ...]]:
        """The `TaskTime`s of each of this process's stages; waits for the step's tasks."""
        for event in self._done:
            event.wait()
        if self._errors:
            raise self._errors[0]
        return _timeline(self._seen, self._start)


class PendingProfile:
    """A `Profile` built when first asked for (`Pipeline.start_profile_step`)."""

    def __init__(self, build: Callable[[], Profile]) -> None:
        self._build, self._profile = build, None

    def result(self) -> Profile:
        if self._profile is None:
            self._profile = self._build()
        return self._profile


def host_metrics(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Host copies of `Pipeline.step` metrics of every stage -> the single-program metrics."""
    by_stage: Mapping[int, Mapping[str, np.ndarray]] = raw["stages"]
    stages = [by_stage[s] for s in sorted(by_stage)]
    f32 = np.float32
    out: dict[str, Any] = {
        "loss": stages[-1]["ce"],
        "aux_loss": f32(sum(f32(s["aux"]) for s in stages)),
        "z_loss": f32(sum(f32(s["z"]) for s in stages)),
        "grad_norm": stages[0]["grad_norm"],
        # Per-layer metrics: stages hold consecutive layers, so layer order is stage order.
        "layer_grad_norm": np.concatenate([s["layer_grad_norm"] for s in stages]),
        **{k: v for k, v in raw.items() if k != "stages"},  # e.g. a profile's metrics
    }
    for name in sorted({n for s in stages for n in s["layers"]}):
        out[name] = np.concatenate([s["layers"][name] for s in stages if name in s["layers"]])
    moe = [s for s in stages if "loads" in s]
    if moe:
        loads = np.concatenate([s["loads"] for s in moe])  # [L, B, E] in layer order
        dropped = np.concatenate([s["dropped"] for s in moe])
        out["moe/group_loads"] = loads
        out["moe/dropped"] = dropped
        out["moe/tokens_per_expert"] = loads.sum(axis=1)
        out["moe/unrouted"] = np.concatenate([s["unrouted"] for s in moe])
        out["moe/expert_tokens"] = np.concatenate([s["expert_tokens"] for s in moe])
        out["dropped_fraction"] = f32(dropped.sum()) / f32(loads.sum())
        if "assignments" in moe[0]:
            out["moe/assignments"] = np.concatenate([s["assignments"] for s in moe])
    return out


def _present(*outputs: Any) -> tuple:
    """The arrays of ``outputs`` (None where they are on another process), flattened."""
    return tuple(jax.tree.leaves(outputs))


def _timeline(
    seen: Mapping[int, list[tuple[Any, float, float, float]]], start: float
) -> dict[int, tuple[TaskTime, ...]]:
    """Each watched stage's `TaskTime`s from what `Pipeline.start_timed_step`'s watchers saw:
    (task, its dispatch, -inf, its results ready) per task, in order; a `_READY` entry first,
    whose arrival is when the stage's state from before the step is. A task starts after the
    task that computed its input ended, where a watcher of this process saw that one end (on
    the neighbour stage)."""
    ends = {(task.kind, s, task.microbatch): end
            for s, row in seen.items() for task, _, _, end in row if task != _READY}
    out = {}
    for s, row in seen.items():
        times, free = [], start
        for task, dispatched, arrived, end in row:
            if task == _READY:  # the stage idles until what it needs from before the step is in
                free = max(free, arrived)
                continue
            m = task.microbatch
            source = ("F", s - 1, m) if task.kind == "F" else ("B", s + 1, m)
            begin = max(dispatched, free, arrived, ends.get(source, start))
            free = max(end, begin)
            times.append(TaskTime(task.kind, m, begin - start, free - start))
        out[s] = tuple(times)
    return out
