"""Profiling a pipeline: per-layer forward and backward times and per-stage memory.

Seed 000 §3.1 and §4: the iteration after each change of the model is profiled for the time of
every layer and the memory of every stage, and the balancer moves layers on that data. XLA fuses
a stage's layers into one program, so a layer's time is measured by running that layer alone as
a one-unit stage (the same `stage_programs`, on the layer's own stage sub-mesh, with its live
parameters): a forward program, and a backward program that recomputes the forward first, as a
stage's backward does. Layers with the same graph and records on the same stage compile and
run one such program; they are lowered and compiled with their Plan, in the background
(`unit_programs`), so a profiled step waits for no compile. Memory is the compiler's memory
analysis of the stage programs plus the live parameter, optimizer-state and
gradient-accumulator bytes, and the stage inputs the schedule keeps for the backward, all per
device.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from dynjax.balance import peak_in_flight
from dynjax.balance.schedules import SPLIT_BACKWARD
from dynjax.model import ModelParts
from dynjax.parallel.layout import Unit, select
from dynjax.parallel.stages import PipelineSpec, StageSpec
from dynjax.parallel.step_inputs import restrict

GetProgram = Callable[[str, StageSpec], Any]  # (kind, spec) -> compiled program
Shapes = Callable[[StageSpec], Any]  # spec -> stage_programs.StageShapes


@dataclasses.dataclass(frozen=True)
class TaskTime:
    """A task as it ran in `Pipeline.timed_step`: seconds from the start of the step."""

    kind: str  # "F", "B" or, where the schedule splits the backward, "W"
    microbatch: int
    start: float
    end: float


UnitSeconds = Mapping[Unit, tuple[float, float]]  # ("embed",) / ("layers", i) / ("head",)
# Known units re-timed after a Plan change, whose median change rescales the kept times
# (`unit_seconds`): one is at the mercy of a slow spell, three outvote it.
ANCHORS = 3


@dataclasses.dataclass(frozen=True)
class UnitTimes:
    """Seconds per microbatch of each unit's forward and backward (backward: with recompute)."""

    layer_forward: tuple[float, ...]  # [layers]
    layer_backward: tuple[float, ...]
    embed: tuple[float, float]  # (forward, backward) of the token embedding
    head: tuple[float, float]  # (forward, backward) of the final norm, head and loss

    @classmethod
    def of(cls, seconds: UnitSeconds) -> UnitTimes:
        """From every unit's (forward, backward) seconds."""
        layers = sorted(unit[1] for unit in seconds if unit[0] == "layers")
        return cls(
            layer_forward=tuple(seconds["layers", i][0] for i in layers),
            layer_backward=tuple(seconds["layers", i][1] for i in layers),
            embed=seconds[("embed",)],
            head=seconds[("head",)],
        )

    def by_unit(self) -> dict[Unit, tuple[float, float]]:
        """Every unit's (forward, backward) seconds (`of` in reverse)."""
        layers = zip(self.layer_forward, self.layer_backward, strict=True)
        return {
            ("embed",): self.embed,
            **{("layers", i): times for i, times in enumerate(layers)},
            ("head",): self.head,
        }


def unit_spec(stage: StageSpec, unit: tuple, *, trainable_before: bool = True) -> StageSpec:
    """A one-unit stage on ``stage``'s sub-mesh: the embedding, one layer, or the head.

    The unit keeps what decides its backward's cost in ``stage``: a frozen layer computes no
    weight gradient, and a unit with nothing trainable before it in the model
    (``trainable_before`` False) passes no gradient back, so a layer of a frozen prefix has no
    backward at all (seed 000 §4.2.3), as in the stage programs.
    """
    one = dataclasses.replace(
        stage, first=False, last=False, layers=(), frozen=(), options=(), needs=(),
        embed_frozen=False, input_grads=trainable_before, step_inputs=(), batch_inputs=(),
        remat=(),
    )
    if unit == ("embed",):
        return dataclasses.replace(one, first=True, embed_frozen=stage.embed_frozen)
    if unit == ("head",):
        return dataclasses.replace(one, last=True)
    i = unit[1]
    at = stage.layers.index(i)
    options = (stage.layer_options()[at],) if stage.options else ()
    needs = (stage.needs[at],) if stage.needs else ()
    return dataclasses.replace(
        one,
        layers=(i,),
        frozen=(i,) if i in stage.frozen else (),
        options=options,
        needs=needs,
        step_inputs=restrict(stage.step_inputs, (i,)),
        # what its backward recomputes and keeps: its time and memory
        remat=(stage.remat[at],) if stage.remat else (),
    )


def unit_kinds(one: StageSpec) -> tuple[str, ...]:
    """The programs that time a one-unit stage: its forward ("eval" for the head, which ends in
    the loss), and its backward where the step runs one."""
    return ("eval" if one.last else "fwd",) + (("bwd",) if one.has_backward else ())


def timed_units(spec: PipelineSpec, parts: ModelParts) -> list[tuple[Unit, StageSpec, tuple]]:
    """Every unit of the model in order, as (unit, its one-unit spec, its timing signature).

    Units with equal signatures (the same graph, plugin options and input shapes on the same
    stage, under any Plan) run one program and share one measurement: two layers of one stage
    whose options differ (e.g. block-sparse matmuls of different widths) are timed apart.
    """
    out = []
    trainable_before = False  # a unit before this one gets gradients: it must pass them back
    for stage in spec.stages:
        units = [("layers", i) for i in stage.layers]
        units = ([("embed",)] if stage.first else []) + units + ([("head",)] if stage.last else [])
        for unit in units:
            one = unit_spec(stage, unit, trainable_before=trainable_before)
            graph = parts.layers[unit[1]] if unit[0] == "layers" else None
            # The one-unit spec less the layer's index: the program's every input (its stage,
            # microbatch, dtype, options, input shapes, ...) but which equal-graph layer it is.
            inputs = tuple(dataclasses.replace(s, layers=()) for s in one.step_inputs)
            program = dataclasses.replace(one, layers=(), frozen=(), step_inputs=inputs)
            signature = (unit[0], graph, one.frozen != (), program)
            out.append((unit, one, signature))
            if unit[0] == "layers":
                trainable_before |= not one.frozen
            elif unit[0] == "embed":
                trainable_before |= not one.embed_frozen
    return out


def unit_programs(spec: PipelineSpec, parts: ModelParts) -> list[tuple[str, StageSpec]]:
    """The (kind, one-unit spec) programs `unit_times` runs for ``spec``: lowered and compiled
    with the Plan, off the training thread, so profiling its first step compiles nothing."""
    firsts: dict[tuple, StageSpec] = {}
    for _, one, signature in timed_units(spec, parts):
        firsts.setdefault(signature, one)
    return [(kind, one) for one in firsts.values() for kind in unit_kinds(one)]


def unit_seconds(
    spec: PipelineSpec,
    params: Mapping[int, Any],
    get: GetProgram,
    shapes: Shapes,
    parts: ModelParts,
    *,
    stages: Collection[int],
    known: Mapping[tuple, tuple[float, float]],
    repeats: int = 3,
) -> tuple[dict[Unit, tuple[float, float]], dict[tuple, tuple[float, float]]]:
    """Median (forward, backward) seconds of the units of ``stages`` (``params``: theirs), each
    run alone on its own stage: in a multi-process run each process times its own stages.

    ``known``: times by timing signature (`timed_units`) measured under an earlier Plan. A unit
    whose signature a Plan change left as it was is not run again, so the profile after a swap
    costs what the swap changed (a record's change re-times the layers holding it only; a move, the
    layers moved): DynMo rebalances every iteration because that costs little (seed 000
    §3.3.1). The `ANCHORS` longest known units (by distinct signature) run again, and every
    known time is scaled by the median of their changes: times measured minutes apart on a
    shared machine drift (one layer's unit measured 27 and 18 ms at the start of two identical
    runs on a pinned 2-core VM), and the balancer compares new units with kept ones and one
    process's with another's. The median, not one anchor: one unit re-timed in a slow spell of
    its core (1.74x its kept time, while the other process timed the same layer at 0.96x) moved
    every kept time with it and misled the partition (docs/benchmarks.md, "Stages on cores of
    their own"). Returns the units' times and their times by signature (the next ``known``).
    """
    local = _local_units(spec, parts, stages)
    by_signature: dict[tuple, tuple[float, float]] = {}

    def timed(one: StageSpec) -> tuple[float, float]:
        unit_params = select(params[one.index], one.units(parts.learned_positions))
        return _time_unit(one, unit_params, get, shapes, repeats)

    kept: dict[tuple, StageSpec] = {}  # each known signature's first unit (its program's)
    for _, one, signature in local:
        if signature in known:
            kept.setdefault(signature, one)
    anchors = sorted(kept, key=lambda signature: sum(known[signature]), reverse=True)
    changes = []
    for anchor in anchors[:ANCHORS]:
        by_signature[anchor] = timed(kept[anchor])
        then = sum(known[anchor])
        if then > 0:
            changes.append(sum(by_signature[anchor]) / then)
    drift = float(np.median(changes)) if changes else 1.0
    out = {}
    for unit, one, signature in local:
        if signature not in by_signature:
            if signature in known:
                f, b = known[signature]
                by_signature[signature] = (f * drift, b * drift)
            else:
                by_signature[signature] = timed(one)
        out[unit] = by_signature[signature]
    return out, by_signature


def _local_units(
    spec: PipelineSpec, parts: ModelParts, stages: Collection[int]
) -> list[tuple[Unit, StageSpec, tuple]]:
    """`timed_units` of ``stages`` (in a multi-process run, this process's)."""
    return [u for u in timed_units(spec, parts) if u[1].index in stages]


def _time_unit(
    one: StageSpec, params: Any, get: GetProgram, shapes: Shapes, repeats: int
) -> tuple[float, float]:
    s = shapes(one)
    rng = np.random.default_rng(0)
    x = _random(s.x, rng)
    # What the unit's block wrappers read in the step (carry, targets, the readout's
    # parameters), so a layer is timed with the work it does there (e.g. an exit's readout).
    ctx = jax.tree.map(lambda a: _random(a, rng), s.ctx)
    for sig in one.step_inputs:  # each input at the value a unit is timed with
        like = s.ctx["inputs"][sig.name]
        full = np.full(like.shape, sig.fill, like.dtype)
        ctx["inputs"][sig.name] = jax.device_put(full, like.sharding)
    forward_kind, *backward_kind = unit_kinds(one)
    if one.last:
        targets = _random(s.targets, rng)
        forward = _median(lambda: get(forward_kind, one)(params, x, ctx, targets), repeats)
        seed = targets
    else:
        forward = _median(lambda: get(forward_kind, one)(params, x, ctx, None), repeats)
        seed = _random(s.y, rng)
    if not backward_kind:  # inside a frozen prefix: the step runs no backward for it
        return forward, 0.0
    zeros = lambda a: jax.numpy.zeros(a.shape, a.dtype, device=a.sharding)
    acc, racc = jax.tree.map(zeros, s.acc), jax.tree.map(zeros, s.racc)
    bwd = get("bwd", one)
    # With ``recompute`` off the backward takes its forward's residuals (made before timing).
    keeps = s.residual_layout is not None
    stored = get(forward_kind, one)(params, x, ctx, None)[3] if keeps else ()

    def backward():
        nonlocal acc, racc
        out = bwd(params, acc, racc, x, ctx, stored, seed, None)
        acc, racc = out[0], out[2]
        return out

    return forward, _median(backward, repeats)


def _random(shape: jax.ShapeDtypeStruct, rng: np.random.Generator) -> jax.Array:
    if shape.dtype == np.bool_:
        host = rng.random(shape.shape) < 0.5
    elif np.issubdtype(shape.dtype, np.integer):
        host = rng.integers(0, 2, shape.shape).astype(shape.dtype)
    else:
        host = rng.standard_normal(shape.shape).astype(shape.dtype)
    return jax.device_put(host, shape.sharding)


def _median(run: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(run())  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_memory_limit(devices: Sequence[jax.Device]) -> int | None:
    """The smallest memory limit of ``devices`` as their allocator reports it; None where a
    backend reports none (CPU)."""
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
    return None if None in limits or not limits else int(min(limits))


def per_device_bytes(tree: Any) -> int:
    """Bytes one device of the tree's sub-mesh holds (the largest share over its devices)."""
    totals: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return max(totals.values(), default=0)


def program_temp_bytes(programs: Mapping[tuple[str, int], Any]) -> dict[int, int]:
    """Each stage's largest program temporary bytes (the compiler's memory analysis, which
    takes milliseconds per program: computed once per compiled spec, `Profiler._memory`)."""
    out: dict[int, int] = {}
    for (_, owner), compiled in programs.items():
        temp = compiled.memory_analysis().temp_size_in_bytes
        out[owner] = max(out.get(owner, 0), temp)
    return out


def stage_memory(
    spec: PipelineSpec,
    state: Mapping[int, Any],
    acc: Mapping[int, Any],
    temps: Mapping[int, int],
    shapes: Shapes,
    boundary: Callable[[StageSpec], Sequence[jax.ShapeDtypeStruct]],
) -> dict[int, dict[str, int]]:
    """Per-device bytes of each stage in ``state`` (this process's): live state, kept stage
    inputs, program temporaries (``temps``: `program_temp_bytes`), their ``total``, and
    ``microbatch_input``, the bytes of one kept stage input (``boundary``: what a split
    backward's B keeps of a microbatch for its W, `dynjax.parallel.split_backward`)."""
    out = {}
    for stage in spec.stages:
        s = stage.index
        if s not in state:
            continue
        held = shapes(stage)
        # A kept stage input is its activations (tokens; past a frozen prefix, the prefix's
        # output) with the carry and targets its wrappers read, and with ``recompute`` off the
        # residuals its forward keeps for the backward; where the backward is split, what B
        # keeps for W too (counted from F to W, the safe side: it exists from B on).
        context = {k: v for k, v in held.ctx.items() if k != "readout"}
        inputs = [held.kept, *jax.tree.leaves(context), *held.residuals]
        if stage.has_backward and spec.schedule in SPLIT_BACKWARD:
            inputs += boundary(stage)
        x_bytes = _device_bytes(inputs)
        record = {
            "params": per_device_bytes(state[s]["params"]),
            "opt_state": per_device_bytes(state[s]["opt_state"]),
            "grad_accumulator": per_device_bytes(acc[s]),
            "stage_inputs": peak_in_flight(spec.stage_tasks(s)) * x_bytes,
            "program_temp": temps.get(s, 0),
        }
        record["total"] = sum(record.values())
        record["microbatch_input"] = x_bytes  # one kept stage input (a part of stage_inputs)
        out[s] = record
    return out


def _device_bytes(arrays: Sequence[jax.ShapeDtypeStruct]) -> int:
    """Bytes one device holds of ``arrays`` (sharded evenly)."""
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize // a.sharding.num_devices for a in arrays)


Timeline = Sequence[Sequence[TaskTime]]  # [stages][tasks in execution order]


def iteration_seconds(timeline: Timeline) -> float:
    """First task start to last task end (the forward/backward part of a step)."""
    tasks = [t for stage in timeline for t in stage]
    return max(t.end for t in tasks) - min(t.start for t in tasks)


def bubble_ratio(timeline: Timeline) -> float:
    """Idle fraction of all stage-time in the iteration (seed 003 §A), as measured."""
    span = iteration_seconds(timeline)
    busy = sum(t.end - t.start for stage in timeline for t in stage)
    return 1.0 - busy / (len(timeline) * span) if span > 0 else 0.0


def busy_seconds(tasks: Sequence[TaskTime]) -> float:
    """Seconds a stage spent on its tasks in one step."""
    return sum(t.end - t.start for t in tasks)


def stage_busy_seconds(timeline: Timeline) -> np.ndarray:
    """[stages] seconds each stage spent on its tasks in one step."""
    return np.array([busy_seconds(stage) for stage in timeline])


def unit_stage(spec: PipelineSpec, unit: Unit) -> int:
    """The stage that runs ``unit``."""
    if unit[0] == "embed":
        return spec.stages[0].index
    if unit[0] == "head":
        return spec.stages[-1].index
    return spec.owner(unit[1])


def units_busy_seconds(seconds: UnitSeconds, spec: PipelineSpec) -> dict[int, float]:
    """Per stage with units in ``seconds``: the busy seconds of a step as its units alone add
    up (every microbatch's forward and backward of each)."""
    out: dict[int, float] = {}
    for unit, (f, b) in seconds.items():
        s = unit_stage(spec, unit)
        out[s] = out.get(s, 0.0) + spec.microbatches * (f + b)
    return out


def rescaled_units(
    seconds: UnitSeconds, spec: PipelineSpec, factors: Mapping[int, float]
) -> dict[Unit, tuple[float, float]]:
    """``seconds`` (units of the stages in ``factors``) with every unit of stage s scaled by
    ``factors[s]``: a periodic profile's per-unit times from its own step's timeline (each
    stage's busy time against the one its units alone add up to, `units_busy_seconds`)
    instead of re-running every unit alone (issue: balancing must cost almost nothing, seed
    000 §3.3.1). Shares inside a stage keep the measured ones."""
    return {
        unit: (f * factors[unit_stage(spec, unit)], b * factors[unit_stage(spec, unit)])
        for unit, (f, b) in seconds.items()
    }


@dataclasses.dataclass(frozen=True)
class ProfilePart:
    """What one process measured of a profiled step: the share of its own stages. In a
    multi-process run every process's part is exchanged and `merged` into the `Profile`."""

    units: Mapping[Unit, tuple[float, float]]  # its stages' units (`unit_seconds`)
    memory: Mapping[int, dict[str, Any]]  # its stages' `Profile.memory` records
    timeline: Mapping[int, tuple[TaskTime, ...]]  # its stages' tasks, from its step's start
    units_measured: bool  # its units' times are as measured alone, not rescaled (`Profile`)
    # Its timeline measured every stage of it (`PendingTimeline.watched`; `Profile`).
    timeline_measured: bool = True


def merged(
    parts: Sequence[ProfilePart],
    stage_layers: tuple[int, ...],
    *,
    seconds: float,
) -> Profile:
    """One `Profile` of every stage from the processes' parts. A process times its tasks from
    its own dispatch of the step, and processes may dispatch a step up to Δ + 1 steps apart
    (transfers do not block the host), so each stage's task and busy times are as measured
    but the offsets between different processes' stages are not: the iteration span and
    bubble ratio of a multi-process profile are approximate."""
    units = {u: t for part in parts for u, t in part.units.items()}
    memory = {s: m for part in parts for s, m in part.memory.items()}
    timeline = {s: row for part in parts for s, row in part.timeline.items()}
    stages = range(len(stage_layers))
    missing = [s for s in stages if s not in memory or s not in timeline]
    if missing:
        raise ValueError(f"no process profiled stages {missing}")
    return Profile(
        UnitTimes.of(units),
        tuple(memory[s] for s in stages),
        tuple(timeline[s] for s in stages),
        stage_layers,
        units_measured=any(part.units_measured for part in parts),
        timeline_measured=all(part.timeline_measured for part in parts),
        seconds=seconds,
    )


@dataclasses.dataclass(frozen=True)
class Profile:
    """One profiled step: unit times, stage memory and the measured timeline.

    ``units_measured``: whether its unit times are as measured alone (a layout's first
    profile: the units a Plan change made new ran alone, the others kept their times,
    `unit_seconds`), or were rescaled from those by this step's timeline (`rescaled_units`);
    ``timeline_measured``: whether every stage's watcher saw its tasks end (False: a loaded CPU
    woke one only after they had, so the timeline, its span, bubble and stage times say
    nothing and are neither offered to the policies nor logged); ``seconds``: the host time
    profiling added beyond the timed step on the thread that asked for it (the balancer's
    cost; the watcher threads' waiting is not counted).
    """

    units: UnitTimes
    # [stages] per-device bytes by kind (`stage_memory`) and the ``layer_activations``, per
    # layer, its forward keeps for its backward per microbatch (`residuals.kept_bytes`)
    memory: tuple[dict[str, Any], ...]
    timeline: tuple[tuple[TaskTime, ...], ...]  # [stages][tasks in execution order]
    stage_layers: tuple[int, ...]  # layers per stage of the layout that ran
    units_measured: bool = True
    timeline_measured: bool = True
    seconds: float = 0.0

    @property
    def iteration_seconds(self) -> float:
        return iteration_seconds(self.timeline)

    @property
    def bubble_ratio(self) -> float:
        return bubble_ratio(self.timeline)

    def stage_seconds(self, kind: str) -> np.ndarray:
        """[stages] mean measured seconds of one microbatch's ``kind`` ("F"/"B") task; "B"
        with its "W" where the schedule splits the backward."""
        kinds = ("B", "W") if kind == "B" else (kind,)
        return np.array([_per_task(stage, kind, kinds) for stage in self.timeline])

    def metrics(self) -> dict[str, np.ndarray]:
        """What policies read from the Monitor (host arrays, added to the step's metrics)."""
        out = {
            "profile/layer_forward_seconds": np.array(self.units.layer_forward),
            "profile/layer_backward_seconds": np.array(self.units.layer_backward),
            "profile/embed_seconds": np.array(self.units.embed),
            "profile/head_seconds": np.array(self.units.head),
            "profile/stage_memory_bytes": np.array([m["total"] for m in self.memory]),
            "profile/stage_input_bytes": np.array([m["stage_inputs"] for m in self.memory]),
            "profile/microbatch_input_bytes": np.array(
                [m["microbatch_input"] for m in self.memory]
            ),
            "profile/stage_temp_bytes": np.array([m["program_temp"] for m in self.memory]),
            # What each layer's forward keeps for its backward: its share of the temporaries.
            "profile/layer_activation_bytes": np.array(
                [b for m in self.memory for b in m["layer_activations"]], np.int64
            ),
            # The layout that ran, so a policy tells a profile of the current Plan from an older.
            "profile/stage_layers": np.array(self.stage_layers),
        }
        if self.timeline_measured:
            out |= {
                "profile/stage_forward_seconds": self.stage_seconds("F"),
                "profile/stage_backward_seconds": self.stage_seconds("B"),
                "profile/bubble_ratio": np.float64(self.bubble_ratio),
                "profile/iteration_seconds": np.float64(self.iteration_seconds),
            }
        return out

    def event(self, step: int) -> dict[str, Any]:
        """The ``profile`` event of events.jsonl."""
        return {
            "event": "profile",
            "step": step,
            "layer_forward_seconds": list(self.units.layer_forward),
            "layer_backward_seconds": list(self.units.layer_backward),
            "embed_seconds": list(self.units.embed),
            "head_seconds": list(self.units.head),
            "stage_memory_bytes": [dict(m) for m in self.memory],
            "iteration_seconds": self.iteration_seconds if self.timeline_measured else None,
            "bubble_ratio": self.bubble_ratio if self.timeline_measured else None,
            "units": "measured" if self.units_measured else "rescaled",
            "seconds": self.seconds,
            "timeline": [
                [[t.kind, t.microbatch, t.start, t.end] for t in stage] for stage in self.timeline
            ] if self.timeline_measured else None,
        }


def _per_task(tasks: Sequence[TaskTime], kind: str, kinds: Sequence[str]) -> float:
    """Seconds of ``kinds`` tasks per ``kind`` task (NaN without one)."""
    count = sum(t.kind == kind for t in tasks)
    return sum(t.end - t.start for t in tasks if t.kind in kinds) / count if count else np.nan
