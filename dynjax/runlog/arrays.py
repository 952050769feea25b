"""A `Run`'s records as NumPy arrays, the data behind each plot: pure functions, no matplotlib.

The steps are the optimizer steps as metrics.jsonl counts them (steps done): a Plan swapped in at
loop step s (``swap_step``) first runs step s + 1, and is placed at step s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dynjax.runlog.workdir import Run


def is_number(v: Any) -> bool:
    """A finite int or float (a bool is not a number here)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def by_step(records: Sequence[dict[str, Any]], key: str) -> dict[int, Any]:
    """{step: value} of the records that hold ``key``, sorted by step; a step logged twice (a
    resumed run redoes the steps after its checkpoint) keeps its newest value."""
    out: dict[int, Any] = {}
    for r in records:
        if key in r and is_number(r.get("step")):
            out[int(r["step"])] = r[key]
    return dict(sorted(out.items()))


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of a scalar metric: the finite numbers logged under ``key``."""
    pairs = [(s, float(v)) for s, v in by_step(records, key).items() if is_number(v)]
    steps = np.array([s for s, _ in pairs], dtype=np.int64)
    return steps, np.array([v for _, v in pairs], dtype=np.float64)


def plan_changes(events: Sequence[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(boundary, plan) of every Plan the run trained with, in order: the first Plan from each
    ``compile`` event (at its ``step``; a resumed run compiles again) and each swapped-in Plan
    from its ``recompile`` event (at its ``swap_step``). The Plan runs the steps after
    ``boundary`` (metrics steps ``boundary + 1, ...``). A resumed run's ``compile`` at step b
    undoes the swaps at b or later that the run before it wrote: it redid those steps."""
    out: list[tuple[int, dict[str, Any]]] = []
    for e in events:
        plan = e.get("plan")
        if not isinstance(plan, dict):
            continue
        if e.get("event") == "compile" and is_number(e.get("step")):
            at = int(e["step"])
            out = [(b, p) for b, p in out if b < at]
        elif e.get("event") == "recompile" and is_number(e.get("swap_step")):
            at = int(e["swap_step"])
        else:
            continue
        out.append((at, plan))
    out.sort(key=lambda t: t[0])  # stable: file order within a step
    return out


def plans_at(
    changes: Sequence[tuple[int, dict[str, Any]]], steps: Sequence[int]
) -> list[dict[str, Any] | None]:
    """The Plan each metrics step ran with (None before the first known Plan)."""
    bounds = np.array([b for b, _ in changes], dtype=np.int64)
    out: list[dict[str, Any] | None] = []
    for s in steps:
        i = int(np.searchsorted(bounds, s, side="left")) - 1  # last boundary < s
        out.append(changes[i][1] if i >= 0 else None)
    return out


@dataclass
class StageLoad:
    """Measured per-stage load of a pipeline, one row per ``profile`` event.

    steps: [P] the profiled step; forward, backward: [P, S] seconds each stage was busy with
    forward / backward tasks in that step (summed over microbatches; NaN for a stage the
    layout did not have); bubble_ratio, iteration_seconds: [P].
    """

    steps: np.ndarray
    forward: np.ndarray
    backward: np.ndarray
    bubble_ratio: np.ndarray
    iteration_seconds: np.ndarray


def stage_load(run: Run) -> StageLoad | None:
    """`StageLoad` from the ``profile`` events; None when there are none."""
    steps, fwd, bwd, bubble, iteration = [], [], [], [], []
    for e in run.events_of("profile"):
        timeline = e.get("timeline")
        if not is_number(e.get("step")) or not isinstance(timeline, list):
            continue
        steps.append(int(e["step"]) + 1)  # loop step s is metrics step s + 1
        fwd.append([_busy(s, "F") for s in timeline])
        bwd.append([_busy(s, "B") + _busy(s, "W") for s in timeline])  # W: a split backward
        bubble.append(float(e["bubble_ratio"]) if is_number(e.get("bubble_ratio")) else np.nan)
        it = e.get("iteration_seconds")
        iteration.append(float(it) if is_number(it) else np.nan)
    if not steps:
        return None
    return StageLoad(
        np.array(steps, dtype=np.int64),
        _ragged(fwd),
        _ragged(bwd),
        np.array(bubble),
        np.array(iteration),
    )


def _busy(stage: Any, kind: str) -> float:
    """Seconds a stage's timeline (``[kind, microbatch, start, end]`` tasks) spent on
    ``kind`` ("F" or "B") tasks."""
    tasks = stage if isinstance(stage, list) else []
    return float(
        sum(
            t[3] - t[2]
            for t in tasks
            if isinstance(t, list)
            and len(t) == 4
            and t[0] == kind
            and is_number(t[2])
            and is_number(t[3])
        )
    )


def _ragged(rows: Sequence[Sequence[float]]) -> np.ndarray:
    """Rows of different lengths as one [N, max length] array padded with NaN."""
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), np.nan)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def stage_layers(run: Run) -> tuple[np.ndarray, np.ndarray] | None:
    """(boundaries [K], layers per stage [K, S]) of every pipeline Plan, or None without a
    pipeline."""
    changes = [(b, p.get("stage_layers")) for b, p in plan_changes(run.events)]
    changes = [(b, s) for b, s in changes if isinstance(s, list) and s]
    if not changes:
        return None
    return np.array([b for b, _ in changes], dtype=np.int64), _ragged([s for _, s in changes])


@dataclass
class LayerCosts:
    """Per-layer costs over time. modelled: [T, L] each layer's cost under the Plan the step
    ran with (a dense layer = 1.0) at ``steps``; seconds: [P, L] profiled forward + backward
    seconds of each layer at ``profiled_steps`` (empty when never profiled)."""

    steps: np.ndarray
    modelled: np.ndarray
    profiled_steps: np.ndarray
    seconds: np.ndarray


def layer_costs(run: Run) -> LayerCosts | None:
    """`LayerCosts` from ``layer_costs.jsonl``; profiled seconds from it, else from the
    ``profile`` events. None when there is neither."""
    modelled = by_step(run.layer_costs, "layer_cost")
    modelled = {s: v for s, v in modelled.items() if isinstance(v, list)}
    timed = {
        int(r["step"]): seconds
        for r in run.layer_costs
        if is_number(r.get("step")) and (seconds := _layer_seconds(r)) is not None
    }
    if not timed:  # loop step s of a profile event is metrics step s + 1
        timed = {
            int(e["step"]) + 1: seconds
            for e in run.events_of("profile")
            if is_number(e.get("step")) and (seconds := _layer_seconds(e)) is not None
        }
    if not modelled and not timed:
        return None
    timed = dict(sorted(timed.items()))
    return LayerCosts(
        np.array(list(modelled), dtype=np.int64),
        _ragged(list(modelled.values())),
        np.array(list(timed), dtype=np.int64),
        _ragged(list(timed.values())),
    )


def _layer_seconds(record: dict[str, Any]) -> list[float] | None:
    """Each layer's forward + backward seconds of a record that has both lists."""
    f, b = record.get("layer_forward_seconds"), record.get("layer_backward_seconds")
    if not (isinstance(f, list) and isinstance(b, list) and len(f) == len(b)):
        return None
    if not all(map(is_number, f + b)):
        return None
    return [x + y for x, y in zip(f, b, strict=True)]


@dataclass
class Frozen:
    """Layer freezing over time: at each Plan boundary [K], the frozen prefix (layers
    0..n-1 all frozen, which run no backward) and the count of frozen layers."""

    boundaries: np.ndarray
    prefix: np.ndarray
    count: np.ndarray


def frozen_layers(run: Run) -> Frozen | None:
    """`Frozen` from the Plans' ``frozen_layers``; None when no Plan froze a layer and the
    config does not enable freezing."""
    changes = plan_changes(run.events)
    frozen = [set(p.get("frozen_layers") or ()) for _, p in changes]
    if not changes or not (any(frozen) or run.config_value("freezing.enabled", False)):
        return None
    prefix = []
    for layers in frozen:
        n = 0
        while n in layers:
            n += 1
        prefix.append(n)
    return Frozen(
        np.array([b for b, _ in changes], dtype=np.int64),
        np.array(prefix, dtype=np.int64),
        np.array([len(f) for f in frozen], dtype=np.int64),
    )


def scheme_series(run: Run, scheme: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every ``<scheme>/...`` metric (e.g. ``pruning/density``, ``freezing/plasticity``) as
    (steps [T], values [T] or [T, L]): scalars and per-layer lists, whatever the scheme logs. A
    null in a per-layer list (not measured) reads as NaN."""
    keys = sorted({k for r in run.metrics for k in r if k.startswith(f"{scheme}/")})
    out = {}
    for key in keys:
        logged = by_step(run.metrics, key)
        scalar = {s: float(v) for s, v in logged.items() if is_number(v)}
        vector = {
            s: [np.nan if x is None else x for x in v]
            for s, v in logged.items()
            if isinstance(v, list) and all(x is None or is_number(x) for x in v)
        }
        if len(vector) > len(scalar):
            out[key] = (np.array(list(vector), dtype=np.int64), _ragged(list(vector.values())))
        elif scalar:
            out[key] = (np.array(list(scalar), dtype=np.int64), np.array(list(scalar.values())))
    return out


# Event kinds marked as vertical lines, in legend order: (label, color, line style).
MARKS = {
    "recompile": ("recompile (swap)", "tab:red", "--"),
    "rebalance": ("rebalance accepted", "tab:green", "-"),
    "rebalance_rejected": ("rebalance declined", "0.6", ":"),
    "repack": ("re-pack accepted", "tab:purple", "-"),
    "migrate": ("migration", "tab:orange", "-."),
    "release": ("devices released", "black", "-"),
}


def event_marks(run: Run) -> dict[str, np.ndarray]:
    """Steps of the run's actions, by kind of `MARKS`: recompiles at their ``swap_step``,
    accepted and declined rebalance decisions, accepted re-packs, migrations and releases at
    their ``step``. Kinds without events are left out."""
    out: dict[str, list[int]] = {k: [] for k in MARKS}
    for e in run.events:
        kind = e.get("event")
        at = e.get("swap_step") if kind == "recompile" else e.get("step")
        if not is_number(at):
            continue
        if kind in ("rebalance", "repack"):
            kind = kind if e.get("accepted") else f"{kind}_rejected"
        if kind in out:
            out[kind].append(int(at))
    return {k: np.array(sorted(v), dtype=np.int64) for k, v in out.items() if v}
