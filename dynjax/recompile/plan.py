"""The Plan: everything static about the compiled training step, as frozen, hashable data.

Two equal Plans compile to the same executables (docs/architecture.md, "Plan"), so a Plan is the key
of the compile cache, the unit of a RECOMPILE (seed 001 §3) and what a checkpoint stores to resume
the same program. Fields added later (the pipeline's stage assignment and schedule, frozen layers)
have defaults, so a Plan saved before a field existed still loads (`Plan.from_dict`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dynjax.balance import SCHEDULES
from dynjax.balance.schedules import INTERLEAVED
from dynjax.model.remat import REMAT

DTYPES = ("float32", "bfloat16")


class PlanError(ValueError):
    """An impossible Plan; the message names the field and the fix."""


@dataclass(frozen=True)
class PlanContext:
    """The facts about the model and batch that decide whether a Plan is possible.

    `pipeline_stages` is the number of stage sub-meshes a Plan may use: the mesh's stages less
    those released after a re-pack (0: no pipeline, the single-program step). A Plan may use
    fewer (stage s runs on sub-mesh s). `batch_shards` is the devices one stage splits a
    microbatch over (mesh.data * mesh.expert). `checks` are the run's plugins' checks of their
    own parts (`Plugin.plan_problems`): each returns the problems it finds, with their fixes.
    """

    batch_size: int
    num_layers: int = 0
    pipeline_stages: int = 0
    batch_shards: int = 1
    checks: tuple[Callable[[Plan], list[str]], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if (
            self.batch_size < 1
            or self.pipeline_stages < 0
            or self.batch_shards < 1
            or self.num_layers < self.pipeline_stages
        ):
            raise PlanError(f"impossible model for a Plan: {self}")


def _freeze(value: Any) -> Any:
    """Lists (as JSON gives them back) become tuples, recursively, so Plans stay hashable."""
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    """Tuples become lists, recursively: the JSON shape of a field."""
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


@dataclass(frozen=True)
class Plan:
    """Everything static about the compiled step; equal Plans share executables.

    microbatches: gradient-accumulation steps inside one train step; in a pipeline, the
      microbatches the schedule moves through the stages (one source of truth for both).
    dtype: compute dtype, one of `DTYPES`.
    stage_layers: how many consecutive layers each pipeline stage holds, e.g. (1, 3, 2, 2); the
      embedding is on the first stage, the final norm, head and loss on the last. Empty: no
      pipeline (the single-program step of `dynjax.parallel.step`).
    schedule: the pipeline schedule, one of `SCHEDULES` (seed 003 §A).
    virtual_stages: the chunks of layers each stage's sub-mesh holds (``interleaved_1f1b``;
      1 otherwise). ``stage_layers`` then has one entry per *logical* stage, in model order:
      logical stage ``c * S + d`` is chunk ``c`` of sub-mesh ``d`` of ``S``
      (`dynjax.balance.logical_stage`).
    frozen_layers: layers that compute no weight gradient and get no optimizer update. Freezing
      layer 0 freezes the token (and position) embedding with it, so a frozen prefix of the model
      runs no backward at all (layer freezing, seed 000 §4.2.3).
    remat: each layer's rematerialisation policy, one of `REMAT` per layer
      (`dynjax.model.remat`; `model.remat` gives every layer the same). Empty: "none" for all;
      a tuple of only "none" is stored empty, so the two are one Plan.
    parts: each dynamism plugin's part of the Plan (docs/plugins.md), as sorted
      ``(plugin name, part)`` pairs; a part is ``(field, value)`` pairs of JSON data (numbers,
      strings, bools and nested tuples), read with `part` and changed with `with_part`. Tables
      (tuples of tuples of scalars, e.g. MoE's per-expert capacities) of the same shape diff
      entry by entry.

    >>> a = Plan().with_part("toy", width=((4, 4),))
    >>> b = a.with_part("toy", width=((4, 6),), on=True)
    >>> a.diff(b)
    {'parts.toy.on': (None, True), 'parts.toy.width[0][1]': (4, 6)}
    >>> Plan.from_dict(b.to_dict()) == b
    True
    >>> b.part("toy")
    {'on': True, 'width': ((4, 6),)}
    """

    microbatches: int = 1
    dtype: str = "float32"
    stage_layers: tuple[int, ...] = ()
    schedule: str = "1f1b"
    frozen_layers: tuple[int, ...] = ()
    virtual_stages: int = 1
    parts: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    remat: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _freeze(getattr(self, f.name)))
        parts = self.parts.items() if isinstance(self.parts, dict) else self.parts
        object.__setattr__(self, "parts", _freeze_parts(dict(parts)))
        object.__setattr__(self, "stage_layers", tuple(int(n) for n in self.stage_layers))
        # A set of layers: one order, so equal sets are equal Plans.
        frozen = tuple(sorted({int(i) for i in self.frozen_layers}))
        object.__setattr__(self, "frozen_layers", frozen)
        remat = tuple(str(r) for r in self.remat)
        object.__setattr__(self, "remat", remat if any(r != "none" for r in remat) else ())

    def replace(self, **changes: Any) -> Plan:
        return dataclasses.replace(self, **changes)

    def part(self, name: str) -> dict[str, Any]:
        """Plugin ``name``'s part as a dict of frozen values; empty when it has none."""
        return dict(dict(self.parts).get(name, ()))

    def with_part(self, name: str, **fields: Any) -> Plan:
        """This Plan with plugin ``name``'s part updated by ``fields``."""
        parts = dict(self.parts)
        parts[name] = tuple({**dict(parts.get(name, ())), **fields}.items())
        return self.replace(parts=parts)

    def validate(self, ctx: PlanContext) -> None:
        """Raise `PlanError` listing every problem of this Plan for `ctx`, each with its fix."""
        problems = [p for check in ctx.checks for p in check(self)]
        if self.microbatches < 1:
            problems.append(f"microbatches = {self.microbatches} must be at least 1")
        elif ctx.batch_size % self.microbatches:
            problems.append(
                f"microbatches = {self.microbatches} does not divide the batch size "
                f"{ctx.batch_size}: choose a divisor of the batch size"
            )
        if self.dtype not in DTYPES:
            problems.append(f"dtype = {self.dtype!r} is unknown: use one of {DTYPES}")
        problems += self._pipeline_problems(ctx)
        if problems:
            raise PlanError("invalid Plan:\n  " + "\n  ".join(problems))

    def _pipeline_problems(self, ctx: PlanContext) -> list[str]:
        problems = []
        stages = self.stage_layers
        if not stages:
            if ctx.pipeline_stages:
                problems.append(
                    f"stage_layers is empty but the mesh has {ctx.pipeline_stages} pipeline "
                    "stages: give one layer count per stage, e.g. dynjax.balance.uniform"
                )
        else:
            problems += self._interleaving_problems(ctx)
            if len(stages) > ctx.pipeline_stages:
                problems.append(
                    f"stage_layers = {stages} has {len(stages)} stages but only "
                    f"{ctx.pipeline_stages} stage sub-meshes are available (mesh.stage, less "
                    "any released by a re-pack): use at most that many stages"
                )
            empty = [s for s, n in enumerate(stages) if n < 1]
            if empty:
                problems.append(
                    f"stage_layers = {stages}: stage(s) {empty} hold no layers; every stage "
                    "needs at least one layer (use fewer stages)"
                )
            if sum(stages) != ctx.num_layers:
                problems.append(
                    f"stage_layers = {stages} sums to {sum(stages)} layers but the model has "
                    f"{ctx.num_layers}: the counts must add up to model.num_layers"
                )
            if self.schedule not in SCHEDULES:
                problems.append(f"schedule = {self.schedule!r} is unknown: use one of {SCHEDULES}")
            rows = ctx.batch_size // max(self.microbatches, 1)
            if rows % ctx.batch_shards:
                problems.append(
                    f"a microbatch of {rows} sequences cannot be split over the "
                    f"{ctx.batch_shards} devices of a stage: use fewer microbatches"
                )
        outside = [i for i in self.frozen_layers if not 0 <= i < ctx.num_layers]
        if outside:
            problems.append(
                f"frozen_layers {outside} are not layers of the {ctx.num_layers}-layer model"
            )
        if self.remat and len(self.remat) != ctx.num_layers:
            problems.append(
                f"remat = {self.remat} has {len(self.remat)} policies but the model has "
                f"{ctx.num_layers} layers: give one per layer (or none: no remat)"
            )
        unknown = sorted(set(self.remat) - set(REMAT))
        if unknown:
            problems.append(f"remat policies {unknown} are unknown: use those of {REMAT}")
        return problems

    def _interleaving_problems(self, ctx: PlanContext) -> list[str]:
        v, stages = self.virtual_stages, len(self.stage_layers)
        if v < 1:
            return [f"virtual_stages = {v} must be at least 1"]
        if (v > 1) != (self.schedule in INTERLEAVED):
            return [
                f"schedule = {self.schedule!r} with virtual_stages = {v}: interleaved "
                "schedules need virtual_stages >= 2, the others 1"
            ]
        if v == 1:
            return []
        problems = []
        if stages != ctx.pipeline_stages:
            problems.append(
                f"stage_layers = {self.stage_layers} has {stages} logical stages but an "
                f"interleaved pipeline runs all {ctx.pipeline_stages} (mesh.stage x "
                "virtual_stages): it does not re-pack"
            )
        if stages % v:
            problems.append(
                f"stage_layers = {self.stage_layers} has {stages} logical stages: not "
                f"{v} chunks on each stage (virtual_stages = {v})"
            )
        elif self.microbatches % (stages // v):
            problems.append(
                f"{self.schedule} runs {v} chunks on each of {stages // v} stages in groups of "
                f"one microbatch per stage: microbatches = {self.microbatches} must be a "
                "multiple of the stages"
            )
        return problems

    def diff(self, other: Plan) -> dict[str, tuple[Any, Any]]:
        """Changed fields as `name -> (self value, other value)`, JSON-serialisable.

        Nested tuples of the same shape (e.g. per-expert capacities) are compared entry by
        entry: only changed entries appear, under keys like `parts.moe.capacities[layer][expert]`.
        """
        out: dict[str, tuple[Any, Any]] = {}
        for f in dataclasses.fields(self):
            old, new = getattr(self, f.name), getattr(other, f.name)
            if old == new:
                continue
            if f.name == "parts":
                out.update(_parts_diff(self, other))
            else:
                out[f.name] = (_thaw(old), _thaw(new))
        return out

    def format_diff(self, other: Plan) -> str:
        """One line per changed entry, `name: old -> new`; `(no change)` for equal Plans."""
        lines = [f"{k}: {a} -> {b}" for k, (a, b) in self.diff(other).items()]
        return "\n".join(lines) if lines else "(no change)"

    def __str__(self) -> str:
        lines = ["Plan"]
        for f in dataclasses.fields(self):
            if f.name != "parts":
                lines.append(f"  {f.name}: {getattr(self, f.name)}")
        for name, part in self.parts:
            lines.append(f"  {name}:")
            lines += [f"    {key}: {value}" for key, value in part]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (tuples as lists); `Plan.from_dict` restores an equal Plan."""
        out = {f.name: _thaw(getattr(self, f.name)) for f in dataclasses.fields(self)}
        out["parts"] = {name: {k: _thaw(v) for k, v in part} for name, part in self.parts}
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """Inverse of `to_dict`; fields missing from `d` (saved before they existed) default.
        MoE's ``capacities`` and ``cached_routing``, top-level fields of Plans saved before it
        became a plugin, go into its part."""
        d = dict(d)
        legacy = {k: d.pop(k) for k in _LEGACY_MOE if k in d}
        if legacy.get("capacities") or legacy.get("cached_routing"):
            parts = dict(d.get("parts", {}))
            parts["moe"] = {"cached_routing": False, **legacy, **dict(parts.get("moe", {}))}
            d["parts"] = parts
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PlanError(
                f"unknown Plan fields {unknown}: the Plan was saved by a newer dynjax; upgrade"
            )
        return cls(**d)


# Top-level fields of Plans saved before MoE was a plugin; now keys of its part.
_LEGACY_MOE = ("capacities", "cached_routing")


def _freeze_parts(parts: dict[str, Any]) -> tuple:
    """``{name: {field: value}}`` (or pairs) -> sorted, hashable pairs of frozen values."""
    return tuple(
        (str(name), tuple(sorted((str(k), _freeze(v)) for k, v in dict(part).items())))
        for name, part in sorted(parts.items())
    )


def _parts_diff(a: Plan, b: Plan) -> dict[str, tuple[Any, Any]]:
    out = {}
    for name in sorted(set(dict(a.parts)) | set(dict(b.parts))):
        old, new = a.part(name), b.part(name)
        for key in sorted(set(old) | set(new)):
            out.update(_entry_diff(f"parts.{name}.{key}", old.get(key), new.get(key)))
    return out


def _entry_diff(key: str, old: Any, new: Any) -> dict[str, tuple[Any, Any]]:
    """``{key: (old, new)}`` if they differ; tables (tuples of tuples) of the same shape entry
    by entry, as ``key[row][column]``."""
    if old == new:
        return {}
    if _shape(old) is not None and _shape(old) == _shape(new):
        return {
            f"{key}[{i}][{j}]": (a, b)
            for i, (row_a, row_b) in enumerate(zip(old, new, strict=True))
            for j, (a, b) in enumerate(zip(row_a, row_b, strict=True))
            if a != b
        }
    return {key: (_thaw(old), _thaw(new))}


def _shape(value: Any) -> tuple[int, ...] | None:
    """The row lengths of a table of scalars; None for anything else."""
    if not isinstance(value, tuple) or not all(isinstance(row, tuple) for row in value):
        return None
    if any(isinstance(v, tuple) for row in value for v in row):
        return None
    return tuple(len(row) for row in value)
