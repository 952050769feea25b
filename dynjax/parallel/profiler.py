"""Profiled pipeline steps: a timed step, then each unit's time and each stage's memory.

Seed 000 §3.1: the step after a change is profiled. On a layout not profiled yet, the units a Plan
change made new run alone (`unit_seconds`); the others keep their times, corrected for the
machine's drift by one of them run again. A later profile of the layout rescales the measured times
by its own step's timeline (`rescaled_units`) and costs the training loop no wait: its `Profile` is
built when asked for (seed 000 §3.3.1).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from dynjax.parallel.executable import PipelineExecutable
from dynjax.parallel.peers import Rounds
from dynjax.parallel.profile import (
    Profile,
    ProfilePart,
    UnitSeconds,
    busy_seconds,
    merged,
    program_temp_bytes,
    rescaled_units,
    stage_memory,
    timed_units,
    unit_seconds,
    units_busy_seconds,
)
from dynjax.parallel.stages import PipelineSpec
from dynjax.parallel.step_inputs import BatchInputs
from dynjax.parallel.timeline import PendingTimeline, TimedSteps


class PendingProfile:
    """A `Profile` built when first asked for (`Profiler.start`)."""

    def __init__(self, build: Callable[[], Profile]) -> None:
        self._build, self._profile = build, None

    def result(self) -> Profile:
        if self._profile is None:
            self._profile = self._build()
        return self._profile


class Profiler:
    """Profiles steps of `TimedSteps`, keeping unit times across Plans and memory per
    executable."""

    def __init__(self, timed: TimedSteps, profiles: Rounds | None) -> None:
        self.timed = timed
        self.stages = timed.stages
        # The other processes' stages' profiles come through it (None: this process profiles
        # alone). Its numbering outlives the pipeline (`Experiment.stage_rounds`).
        self.profiles = profiles
        # The newest unit measurement of this process's stages: (the spec it ran on, their
        # units' times, each stage's busy seconds as they add up), what a periodic profile
        # rescales. Not the busy seconds of the step they were measured after: that step may
        # be a program's first run (or, over processes, include their first connection).
        self._measured_units: tuple[PipelineSpec, UnitSeconds, dict[int, float]] | None = None
        # Those units' times by timing signature (`unit_seconds`): after a Plan change only the
        # units it made new run alone.
        self._unit_times: dict[tuple, tuple[float, float]] = {}
        # The newest executable's `stage_memory` (`_memory`).
        self._memory_of: tuple[PipelineExecutable, dict[int, dict[str, Any]]] | None = None

    def start(
        self,
        exe: PipelineExecutable,
        inputs: np.ndarray,
        targets: np.ndarray,
        batch_in: BatchInputs | None,
        rows: np.ndarray | None,
        *,
        repeats: int,
    ) -> tuple[dict[str, Any], PendingProfile]:
        """A timed step, then each unit's forward and backward time and each stage's memory
        (seed 000 §3.1: the step after a change is profiled).

        On a layout not profiled yet (the first profile after a swap), units whose timing signature
        no earlier measurement holds (a Plan change made them new: `unit_seconds`) then run alone,
        the step waited for; the others keep their times, scaled by the median change of up to
        three of them, run again (`unit_seconds`' anchors). A later profile of the layout
        rescales its units' times by its own step's timeline (`rescaled_units`) and returns as
        soon as the step is dispatched:
        the `Profile` is built when asked for, once the watchers are done, so a periodic profile
        costs the training loop no wait (seed 000 §3.3.1). Memory is computed once per executable.
        The one-unit programs come with ``exe`` (lowered with ``profiling``): nothing compiles here,
        on the training thread.

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
            self.stages.require_every_stage("profiling without the other processes (profiles)")
        memory = self._memory(exe)
        measured = self._measured_units
        metrics, pending = self.timed.start(exe, inputs, targets, batch_in, rows)
        if measured is not None and measured[0] == exe.spec:
            return metrics, self._rescaled(exe, pending, memory)
        return metrics, self._measured(exe, pending, memory, repeats)

    def _rescaled(
        self, exe: PipelineExecutable, pending: PendingTimeline, memory: dict[int, dict[str, int]]
    ) -> PendingProfile:
        """The measured units' times scaled by each stage's busy time in this step's timeline;
        a timeline that measured nothing (`PendingTimeline.watched`) keeps them."""
        _, units, then = self._measured_units

        def rescaled() -> Profile:
            timeline = pending.result()
            start = time.perf_counter()
            measured = _all_watched(pending)
            factors = {
                s: busy_seconds(row) / then[s] if then[s] > 0 and measured else 1.0
                for s, row in timeline.items()
            }
            units_now = rescaled_units(units, exe.spec, factors)
            part = ProfilePart(
                units_now, memory, timeline, units_measured=False, timeline_measured=measured
            )
            return self._gathered(part, _layout(exe), time.perf_counter() - start)

        return PendingProfile(rescaled)

    def _measured(
        self,
        exe: PipelineExecutable,
        pending: PendingTimeline,
        memory: dict[int, dict[str, int]],
        repeats: int,
    ) -> PendingProfile:
        """Once the step is done, the units no earlier measurement holds, each run alone."""
        timeline = pending.result()
        start = time.perf_counter()
        local = {s: st["params"] for s, st in self.stages.state.items()}  # the updated ones
        units, self._unit_times = unit_seconds(
            exe.spec,
            local,
            lambda kind, one: exe.profiling[kind, one],
            self.stages.programs.shapes,
            self.stages.programs.setup.parts,
            stages=local.keys(),
            known=self._unit_times,
            repeats=repeats,
        )
        self._measured_units = (exe.spec, units, units_busy_seconds(units, exe.spec))
        part = ProfilePart(
            units, memory, timeline, units_measured=True, timeline_measured=_all_watched(pending)
        )
        seconds = time.perf_counter() - start
        return PendingProfile(lambda: self._gathered(part, _layout(exe), seconds))

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
            temps, held = program_temp_bytes(exe.programs), self.stages
            boundary = lambda stage: exe.splits[stage.index].boundary  # noqa: E731
            memory = stage_memory(
                exe.spec, held.state, held.acc, temps, held.programs.shapes, boundary
            )
            for s, kept in self._layer_activations(exe.spec, memory.keys()).items():
                memory[s]["layer_activations"] = kept
            self._memory_of = (exe, memory)
        return self._memory_of[1]

    def _layer_activations(
        self, spec: PipelineSpec, stages: Collection[int]
    ) -> dict[int, tuple[int, ...]]:
        """Per stage of ``stages``, what each of its layers' forward keeps for its backward
        (`PipelinePrograms.kept_bytes`: its rematerialisation policy's; traced with the Plan's
        profiling programs, so nothing is traced here)."""
        programs = self.stages.programs
        out: dict[int, list[int]] = {s: [] for s in stages}
        for unit, one, signature in timed_units(spec, programs.setup.parts):
            if unit[0] == "layers" and one.index in out:
                out[one.index].append(programs.kept_bytes(one, signature))
        return {s: tuple(kept) for s, kept in out.items()}


def _all_watched(pending: PendingTimeline) -> bool:
    """Whether the step's timeline measured every stage of this process (after `result`)."""
    return pending.watched() >= pending.result().keys()


def _layout(exe: PipelineExecutable) -> tuple[int, ...]:
    """The number of layers of each stage: what the merged `Profile` is of."""
    return tuple(len(stage.layers) for stage in exe.spec.stages)
