"""Compiled stage programs of a `PipelineSpec`, and the cache that keeps them across Plans.

Programs are compiled per kind and the part of the `StageSpec` they depend on (`program_key`):
a Plan whose stage assignment changes compiles only the stages whose layers changed. Lowering
runs on the caller's thread, compiling on the Compiler's worker (`LoweredPipeline.compile`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import jax

from dynjax.balance.schedules import SPLIT_BACKWARD
from dynjax.model.hooks import Hooks
from dynjax.parallel.dispatch import Order, dispatch_order, overlapped_order
from dynjax.parallel.profile import timed_units, unit_programs
from dynjax.parallel.residuals import kept_bytes
from dynjax.parallel.split_backward import StageSplit
from dynjax.parallel.stage import StageSetup
from dynjax.parallel.stage_programs import StageShapes, lower_stage, stage_shapes, stage_split
from dynjax.parallel.stage_update import lower_stage_update
from dynjax.parallel.stages import PipelineSpec, StageSpec
from dynjax.parallel.transport import Transport

ProgramKey = tuple[str, int]  # (kind, stage)
UnitKey = tuple[str, StageSpec]  # (kind, one-unit spec): a profiling program


def program_kinds(spec: StageSpec, split_backward: bool = False) -> tuple[str, ...]:
    """The training programs one stage needs (``split_backward``: its backward as ``B`` and
    ``W``, `dynjax.parallel.split_backward`)."""
    kinds = () if spec.last else ("fwd",)
    if spec.has_backward and not split_backward:
        kinds += ("bwd",)
    elif spec.has_backward:  # B only where it computes something (`split_backward`)
        kinds += ("bwd_b", "bwd_w") if spec.input_grads or spec.last else ("bwd_w",)
    return kinds + ("sqnorm", "update")


def program_key(kind: str, spec: StageSpec, hooks: Hooks) -> tuple[str, StageSpec]:
    """The part of a stage's spec one of its programs depends on: its compile-cache key.

    The gradient norm and the update see parameters, gradients and metrics, whose shapes do
    not depend on the per-layer inputs, on what of the layers' records only the forward
    reads (`HookSet.update_record`) nor on the layers' rematerialisation: a change of those
    recompiles only the forward and backward of the stages it touches.
    """
    if kind in ("sqnorm", "update"):
        options = hooks.update_options(spec.options)
        return kind, replace(spec, step_inputs=(), batch_inputs=(), options=options, remat=())
    return kind, spec



@dataclasses.dataclass(frozen=True)
class PipelineExecutable:
    """Compiled programs for every stage (of this process) of one `PipelineSpec`."""

    spec: PipelineSpec
    programs: Mapping[ProgramKey, Any]  # (kind, stage) -> jax.stages.Compiled
    compiled: tuple[ProgramKey, ...]  # compiled for this spec; the others came from the cache
    order: Order  # the global dispatch order of (stage, task, action) (`dispatch`)
    # `profile.unit_programs` of this process's stages (none: it has none); None: lowered
    # without them
    profiling: Mapping[UnitKey, Any] | None
    # stage -> its backward's cut, where the schedule splits it (`split_backward`)
    splits: Mapping[int, StageSplit]


@dataclasses.dataclass
class LoweredPipeline:
    """Programs lowered for a spec; `compile()` (on the Compiler's worker) builds the rest."""

    spec: PipelineSpec
    programs: PipelinePrograms
    ready: dict[ProgramKey, Any]
    lowered: dict[ProgramKey, tuple[StageSpec, Any]]  # `PipelinePrograms.lower_one`'s
    profiling_ready: dict[UnitKey, Any] | None  # None: lowered without the one-unit programs
    profiling_lowered: dict[UnitKey, jax.stages.Lowered]
    splits: dict[int, StageSplit]

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
            (dispatch_order if self.programs.transport.all_local else overlapped_order)(
                self.spec.tasks
            ),
            profiling,
            self.splits,
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
        self._splits: dict[StageSpec, StageSplit] = {}
        self._kept: dict[tuple, int] = {}  # `kept_bytes` by timing signature
        # a stage's compiled update programs by (stage, signature): kept across Plans (a
        # layer moved onto a stage that updates an equal one compiles no update)
        self._unit_updates: dict[tuple, Any] = {}
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
        ready, lowered, splits = {}, {}, {}
        split = spec.schedule in SPLIT_BACKWARD
        for stage in spec.stages:
            if not self.transport.is_local(stage.index):
                continue
            if split and stage.has_backward:
                splits[stage.index] = self.split(stage)
            for kind in program_kinds(stage, split):
                hit = self._cached(kind, stage)
                if hit is not None:
                    ready[kind, stage.index] = hit
                else:
                    lowered[kind, stage.index] = (stage, self.lower_one(kind, stage))
        units_ready, units_lowered = {}, {}
        for unit, one, signature in timed_units(spec, self.setup.parts) if profiling else ():
            if unit[0] == "layers" and self.transport.is_local(one.index):
                self.kept_bytes(one, signature)  # traced here, not on the training thread
        for kind, one in unit_programs(spec, self.setup.parts) if profiling else ():
            if not self.transport.is_local(one.index):
                continue
            hit = self._cached(kind, one)
            if hit is not None:
                units_ready[kind, one] = hit
            else:
                units_lowered[kind, one] = self.lower_one(kind, one)
        return LoweredPipeline(
            spec, self, ready, lowered, units_ready if profiling else None, units_lowered, splits
        )

    def _cached(self, kind: str, stage: StageSpec) -> Any:
        """A compiled program (now the most recently used), or None."""
        key = program_key(kind, stage, self.setup.parts.cfg.hooks)
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
        return hit

    def split(self, spec: StageSpec) -> StageSplit:
        """The stage's backward cut for ZB-H1 (`stage_split`), traced once per spec (while its
        programs are cached)."""
        return self._traced_once(self._splits, spec, spec, stage_split)

    def kept_bytes(self, one: StageSpec, signature: tuple) -> int:
        """What the one-unit layer spec ``one``'s forward keeps for its backward
        (`residuals.kept_bytes`), traced once per timing signature (`timed_units`): with the
        Plan's profiling programs (`lower`), so a profile reads it without tracing."""
        return self._traced_once(self._kept, signature, one, kept_bytes)

    def _traced_once(self, cache: dict, key: Any, spec: StageSpec, trace: Callable) -> Any:
        """``trace(setup, spec, mesh, shapes)`` under ``key`` in ``cache``, traced on a miss
        only (the first of two racing threads' results is kept)."""
        hit = cache.get(key)
        if hit is None:
            mesh = self.transport.stage_meshes[spec.index]
            hit = cache.setdefault(key, trace(self.setup, spec, mesh, self.shapes(spec)))
        return hit

    def lower_one(self, kind: str, stage: StageSpec) -> Any:
        """One program of ``stage`` lowered: a `jax.stages.Lowered`, or for ``update`` in one
        process the stage's `stage_update.LoweredStageUpdate`; either's ``compile()`` gives
        the program."""
        mesh = self.transport.stage_meshes[stage.index]
        if kind == "update":
            return lower_stage_update(
                self.setup, stage, mesh, self.shapes(stage), self._unit_updates,
                whole=not self.transport.all_local,
            )
        split = self.split(stage) if kind in ("bwd_b", "bwd_w") else None
        return lower_stage(kind, self.setup, stage, mesh, self.shapes(stage), split)

    def store(self, kind: str, stage: StageSpec, compiled: Any) -> Any:
        key = program_key(kind, stage, self.setup.parts.cfg.hooks)
        with self._lock:
            self._compiled[key] = compiled
            self._compiled.move_to_end(key)
            if len(self._compiled) > self.max_entries:
                while len(self._compiled) > self.max_entries:
                    self._compiled.popitem(last=False)
                # cuts of backwards no longer cached (an executable keeps its own: `splits`)
                cached = {key[1] for key in self._compiled if key[0] in ("bwd_b", "bwd_w")}
                self._splits = {k: v for k, v in self._splits.items() if k in cached}
        return compiled

    def release(self, stages: Iterable[int]) -> None:
        """Drop the programs and shapes of stage sub-meshes given back after a re-pack."""
        gone = set(stages)
        with self._lock:
            for key in [k for k in self._compiled if k[1].index in gone]:
                del self._compiled[key]
            self._shapes = {k: v for k, v in self._shapes.items() if k.index not in gone}
            self._splits = {k: v for k, v in self._splits.items() if k.index not in gone}
            self._kept = {k: v for k, v in self._kept.items() if k[3].index not in gone}
            for key in [k for k in self._unit_updates if k[0] in gone]:
                del self._unit_updates[key]

    def get(self, kind: str, stage: StageSpec) -> Any:
        """A compiled program, compiling it now if needed (evaluation programs)."""
        with self._lock:
            hit = self._compiled.get(program_key(kind, stage, self.setup.parts.cfg.hooks))
        if hit is None:
            hit = self.store(kind, stage, self.lower_one(kind, stage).compile())
        return hit

