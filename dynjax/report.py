"""Run report: PNG plots and a short ``report.md`` of what a run wrote to its workdir.

    python -m dynjax.report WORKDIR [--out DIR]     # DIR defaults to WORKDIR/report

It reads the files of README "What a run writes" (``metrics.jsonl``, ``events.jsonl``,
``layer_costs.jsonl``, ``config.json``, and ``process_<i>/`` of a multi-process run), on a
finished run or a live one (a torn last line is skipped). A plot whose data the run does not
have is skipped, with a line in report.md saying why.

Data and drawing are kept apart: `load_run` reads a workdir into a `Run`; pure functions turn
its records into NumPy arrays (`series`, `plan_changes`, `expert_load`, `stage_load`,
`layer_costs`, `frozen_layers`, `pruning_series`, `event_marks`, `summary`), testable without
matplotlib; small ``plot_*`` functions draw them. In a notebook::

    from dynjax.report import expert_load, load_run, plot_expert_load, plot_loss
    run = load_run("workdirs/moe")
    plot_loss(run)                      # a new figure, or plot_loss(run, ax=my_axes)
    plot_expert_load(run)
    load = expert_load(run)             # load.tokens [T, L, E], load.capacity [T, L, E]

The x axis of every plot is the optimizer step as metrics.jsonl counts it (steps done): a Plan
swapped in at loop step s (``swap_step``) first runs step s + 1, and is drawn at x = s.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dynjax.writers import read_jsonl

if TYPE_CHECKING:  # matplotlib is imported only by the functions that draw
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DPI = 100
WIDTH = 10.0  # inches: every PNG is WIDTH * DPI = 1000 pixels wide


class ReportError(Exception):
    """A workdir the report cannot read; the message says what is wrong."""


# ----------------------------------------------------------------------------------------------
# Reading a workdir


@dataclass
class Run:
    """What one process of a run wrote. ``processes`` holds the runs of ``process_<i>/`` (the
    other processes of a multi-process run), keyed by process index."""

    workdir: Path
    config: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    layer_costs: list[dict[str, Any]] = field(default_factory=list)
    processes: dict[int, Run] = field(default_factory=dict)

    def events_of(self, *kinds: str) -> list[dict[str, Any]]:
        """The events of these kinds, in file order."""
        return [e for e in self.events if e.get("event") in kinds]

    def config_value(self, dotted: str, default: Any = None) -> Any:
        """``config.json``'s value at ``"section.key"``, or ``default`` when absent."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node


def _records(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file; none if it does not exist (yet)."""
    if not path.is_file():
        return []
    return [r for r in read_jsonl(path) if isinstance(r, dict)]


def _config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _process_dirs(workdir: Path) -> dict[int, Path]:
    out = {}
    for p in workdir.glob("process_*"):
        suffix = p.name[len("process_") :]
        if p.is_dir() and suffix.isdigit():
            out[int(suffix)] = p
    return dict(sorted(out.items()))


def load_run(workdir: str | Path) -> Run:
    """Read a run's workdir (finished or live). Raises `ReportError` when ``workdir`` does not
    exist or holds no ``metrics.jsonl``."""
    workdir = Path(workdir)
    if not workdir.exists():
        raise ReportError(f"workdir {workdir} does not exist")
    if not workdir.is_dir():
        raise ReportError(f"workdir {workdir} is not a directory")
    if not (workdir / "metrics.jsonl").is_file():
        raise ReportError(
            f"no metrics.jsonl in {workdir}: not a dynjax run directory, or its run has not "
            "started yet (python -m dynjax.train --workdir DIR writes it)"
        )
    run = _read(workdir)
    run.processes = {i: _read(p) for i, p in _process_dirs(workdir).items()}
    return run


def _read(workdir: Path) -> Run:
    return Run(
        workdir=workdir,
        config=_config(workdir / "config.json"),
        metrics=_records(workdir / "metrics.jsonl"),
        events=_records(workdir / "events.jsonl"),
        layer_costs=_records(workdir / "layer_costs.jsonl"),
    )


# ----------------------------------------------------------------------------------------------
# Records -> arrays (pure, no matplotlib)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _by_step(records: Sequence[dict[str, Any]], key: str) -> dict[int, Any]:
    """{step: value} of the records that hold ``key``, sorted by step; a step logged twice (a
    resumed run redoes the steps after its checkpoint) keeps its newest value."""
    out: dict[int, Any] = {}
    for r in records:
        if key in r and _is_number(r.get("step")):
            out[int(r["step"])] = r[key]
    return dict(sorted(out.items()))


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of a scalar metric: the finite numbers logged under ``key``."""
    pairs = [(s, float(v)) for s, v in _by_step(records, key).items() if _is_number(v)]
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
        if e.get("event") == "compile" and _is_number(e.get("step")):
            at = int(e["step"])
            out = [(b, p) for b, p in out if b < at]
        elif e.get("event") == "recompile" and _is_number(e.get("swap_step")):
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


def moe_layer_indices(run: Run) -> list[int] | None:
    """The model layers holding an MoE block, None without a config that says."""
    import ml_collections

    from dynjax import config as config_lib

    every, layers = run.config_value("moe.every"), run.config_value("model.num_layers")
    if not (_is_number(every) and _is_number(layers)):
        return None
    cfg = ml_collections.ConfigDict({"moe": {"every": every}, "model": {"num_layers": layers}})
    return list(config_lib.moe_layer_indices(cfg))


@dataclass
class ExpertLoad:
    """Per-expert routed tokens against capacity, per logged step.

    steps: [T]; tokens: [T, L, E] tokens (token-choice pairs, before dropping) routed to each
    expert of each MoE layer in the step; capacity: [T, L, E] slots of each expert in the step,
    the Plan's capacity per dispatch group times the groups of a step (one sequence each, so
    ``train.batch_size``), NaN where the Plan is unknown; layers: the model layer of each MoE
    layer (or 0..L-1).
    """

    steps: np.ndarray
    tokens: np.ndarray
    capacity: np.ndarray
    layers: list[int]

    @property
    def utilisation(self) -> np.ndarray:
        """[T, L, E] tokens / capacity: above 1 an expert certainly dropped tokens in the step
        (below 1 it may still have, in a group whose load exceeded its capacity)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return self.tokens / self.capacity


def groups_per_step(run: Run, tokens: np.ndarray | None = None) -> int | None:
    """Dispatch groups (sequences) per step: ``train.batch_size``, else the routed
    token-choices of a step over ``seq_len * top_k``."""
    batch = run.config_value("train.batch_size")
    if _is_number(batch) and batch > 0:
        return int(batch)
    seq, k = run.config_value("data.seq_len"), run.config_value("moe.top_k")
    if tokens is not None and tokens.size and _is_number(seq) and _is_number(k) and seq * k > 0:
        return int(round(float(tokens[0, 0].sum()) / (seq * k)))
    return None


def expert_load(run: Run) -> ExpertLoad | None:
    """`ExpertLoad` of an MoE run; None when metrics.jsonl has no ``tokens_per_expert``."""
    logged = _by_step(run.metrics, "tokens_per_expert")
    rows, steps, shape = [], [], None
    for step, value in logged.items():
        arr = np.asarray(value, dtype=np.float64) if isinstance(value, list) else None
        if arr is None or arr.ndim != 2 or arr.size == 0:
            continue
        shape = shape or arr.shape
        if arr.shape == shape:  # a record of another shape (another model) is skipped
            rows.append(arr)
            steps.append(step)
    if not rows:
        return None
    tokens = np.stack(rows)
    capacity = np.full_like(tokens, np.nan)
    groups = groups_per_step(run, tokens)
    plans = plans_at(plan_changes(run.events), steps)
    for t, plan in enumerate(plans):
        caps = np.asarray((plan or {}).get("capacities") or [], dtype=np.float64)
        if groups is not None and caps.shape == shape:
            capacity[t] = caps * groups
    layers = moe_layer_indices(run)
    if layers is None or len(layers) != shape[0]:
        layers = list(range(shape[0]))
    return ExpertLoad(np.array(steps, dtype=np.int64), tokens, capacity, layers)


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
        if not _is_number(e.get("step")) or not isinstance(timeline, list):
            continue
        steps.append(int(e["step"]) + 1)  # loop step s is metrics step s + 1
        fwd.append([_busy(s, "F") for s in timeline])
        bwd.append([_busy(s, "B") for s in timeline])
        bubble.append(float(e["bubble_ratio"]) if _is_number(e.get("bubble_ratio")) else np.nan)
        it = e.get("iteration_seconds")
        iteration.append(float(it) if _is_number(it) else np.nan)
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
            and _is_number(t[2])
            and _is_number(t[3])
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
    modelled = _by_step(run.layer_costs, "layer_cost")
    modelled = {s: v for s, v in modelled.items() if isinstance(v, list)}
    timed = {
        int(r["step"]): seconds
        for r in run.layer_costs
        if _is_number(r.get("step")) and (seconds := _layer_seconds(r)) is not None
    }
    if not timed:  # loop step s of a profile event is metrics step s + 1
        timed = {
            int(e["step"]) + 1: seconds
            for e in run.events_of("profile")
            if _is_number(e.get("step")) and (seconds := _layer_seconds(e)) is not None
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
    if not all(map(_is_number, f + b)):
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


def pruning_series(run: Run) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every ``pruning/...`` metric as (steps [T], values [T] or [T, L]): scalars and per-layer
    lists (e.g. each layer's sparsity), whatever the pruning scheme logs."""
    keys = sorted({k for r in run.metrics for k in r if k.startswith("pruning/")})
    out = {}
    for key in keys:
        logged = _by_step(run.metrics, key)
        scalar = {s: float(v) for s, v in logged.items() if _is_number(v)}
        vector = {
            s: v for s, v in logged.items() if isinstance(v, list) and all(map(_is_number, v))
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
        if not _is_number(at):
            continue
        if kind in ("rebalance", "repack"):
            kind = kind if e.get("accepted") else f"{kind}_rejected"
        if kind in out:
            out[kind].append(int(at))
    return {k: np.array(sorted(v), dtype=np.int64) for k, v in out.items() if v}


def _median(values: np.ndarray) -> float | None:
    return float(np.median(values)) if values.size else None


def summary(run: Run) -> dict[str, Any]:
    """The report's key numbers as plain data (None where the run has no such data)."""
    loss_steps, loss = series(run.metrics, "loss")
    _, eval_loss = series(run.metrics, "eval_loss")
    _, rate = series(run.metrics, "tokens_per_sec")
    _, util = series(run.metrics, "mfu")
    all_steps = [int(r["step"]) for r in run.metrics if _is_number(r.get("step"))]
    compiles = run.events_of("compile")
    recompiles = run.events_of("recompile")
    decisions = run.events_of("rebalance")
    repacks = run.events_of("repack")
    migrations = run.events_of("migrate")
    saved = sorted(
        {int(e["step"]) for e in run.events_of("checkpoint") if _is_number(e.get("step"))}
    )
    kept = sorted(int(p.name) for p in (run.workdir / "checkpoints").glob("*") if p.name.isdigit())
    return {
        "first_step": min(all_steps) if all_steps else None,
        "last_step": max(all_steps) if all_steps else None,
        "train_steps_logged": int(loss_steps.size),
        "final_loss": float(loss[-1]) if loss.size else None,
        "final_eval_loss": float(eval_loss[-1]) if eval_loss.size else None,
        "median_tokens_per_sec": _median(rate),
        "median_mfu": _median(util),
        "model_flops_per_token": next(
            (
                float(r["model_flops_per_token"])
                for r in reversed(run.metrics)
                if _is_number(r.get("model_flops_per_token"))
            ),
            None,
        ),
        "compile_seconds": [
            float(e["compile_seconds"]) for e in compiles if _is_number(e.get("compile_seconds"))
        ],
        "recompiles": [
            {
                "step": e.get("step"),
                "swap_step": e.get("swap_step"),
                "policy": e.get("policy"),
                "reason": e.get("reason"),
                "lower_seconds": e.get("lower_seconds"),
                "compile_seconds": e.get("compile_seconds"),
                "steps_during_compile": e.get("steps_during_compile"),
                "cache_hit": e.get("cache_hit"),
            }
            for e in recompiles
        ],
        "recompiles_rejected": len(run.events_of("recompile_rejected")),
        "recompiles_failed": len(run.events_of("recompile_failed")),
        "policy_errors": len(run.events_of("policy_error")),
        "checkpoints_saved": saved,
        "checkpoints_kept": kept,
        "checkpoints_failed": len(run.events_of("checkpoint_failed")),
        "rebalances": len(decisions),
        "rebalances_accepted": sum(bool(e.get("accepted")) for e in decisions),
        "repacks": len(repacks),
        "repacks_accepted": sum(bool(e.get("accepted")) for e in repacks),
        "migrations": len(migrations),
        "migrated_bytes": sum(float(e.get("bytes") or 0) for e in migrations),
        "migration_seconds": sum(float(e.get("seconds") or 0) for e in migrations),
        "releases": len(run.events_of("release")),
        "resumes": len(run.events_of("resume")),
    }


# ----------------------------------------------------------------------------------------------
# Drawing (matplotlib, imported here only)


def _new_figure(fig: Figure | None, height: float) -> Figure:
    """``fig`` resized to WIDTH x height inches, or a new pyplot figure of that size."""
    if fig is None:
        import matplotlib.pyplot as plt

        return plt.figure(figsize=(WIDTH, height), layout="constrained")
    fig.set_size_inches(WIDTH, height)
    return fig


def _new_axes(ax: Axes | None, height: float = 4.5) -> Axes:
    return _new_figure(None, height).add_subplot() if ax is None else ax


def _mark_events(
    ax: Axes, marks: dict[str, np.ndarray], kinds: Sequence[str], label: bool = True
) -> None:
    """Vertical lines at the steps of these kinds of `event_marks`; the first of each kind is
    labelled for the legend unless ``label`` is False (the figure has its own legend)."""
    for kind in kinds:
        text, color, style = MARKS[kind]
        for i, x in enumerate(marks.get(kind, ())):
            name = text if label and i == 0 else None
            ax.axvline(x, color=color, ls=style, lw=1.2, alpha=0.8, label=name)


def _maybe_log(ax: Axes, values: np.ndarray) -> None:
    """Log scale when positive values span more than 20x (a first step's warm-up, noisy
    per-step rates), so that the typical values stay readable."""
    v = values[np.isfinite(values) & (values > 0)]
    if v.size and v.max() / v.min() > 20:
        ax.set_yscale("log")


def plot_loss(run: Run, ax: Axes | None = None) -> Axes:
    """Training loss and evaluation loss against step, with recompiles marked."""
    ax = _new_axes(ax)
    steps, loss = series(run.metrics, "loss")
    ax.plot(steps, loss, lw=1.2, color="tab:blue", label="train loss")
    e_steps, e_loss = series(run.metrics, "eval_loss")
    if e_steps.size:
        ax.plot(e_steps, e_loss, "o-", ms=5, color="tab:orange", label="eval loss")
    _mark_events(ax, event_marks(run), ["recompile"])
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("Loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    return ax


def _rolling_median(values: np.ndarray, window: int) -> np.ndarray:
    out = np.empty_like(values)
    for i in range(values.size):
        out[i] = np.median(values[max(0, i - window + 1) : i + 1])
    return out


def plot_throughput(run: Run, fig: Figure | None = None) -> Figure:
    """Tokens/s per logged interval (points) and their rolling median, of every process; MFU and
    achieved TFLOP/s per device in a second panel when metrics.jsonl has them."""
    _, util = series(run.metrics, "mfu")
    _, tflops = series(run.metrics, "tflops_per_device")
    efficiency = bool(util.size or tflops.size)
    fig = _new_figure(fig, 7.0 if efficiency else 4.5)
    axes = fig.subplots(2 if efficiency else 1, 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    runs = [(0, run), *run.processes.items()]
    everything = []
    for i, r in runs:
        steps, rate = series(r.metrics, "tokens_per_sec")
        if not steps.size:
            continue
        everything.append(rate)
        name = "" if len(runs) == 1 else f"process {i}: "
        color = f"C{i % 10}"
        window = min(20, steps.size // 5)
        if window < 2:  # too few points to smooth: join them
            ax.plot(steps, rate, ".-", ms=6, color=color, label=f"{name}per interval")
            continue
        ax.plot(steps, rate, ".", ms=4, alpha=0.4, color=color, label=f"{name}per interval")
        smooth = _rolling_median(rate, window)
        ax.plot(steps, smooth, lw=2, color=color, label=f"{name}rolling median ({window} logs)")
    if everything:
        median = float(np.median(everything[0]))
        who = "" if len(runs) == 1 else " (process 0)"
        ax.axhline(median, color="0.3", ls=":", lw=1, label=f"median{who} {median:,.0f}")
        _maybe_log(ax, np.concatenate(everything))
    _mark_events(ax, event_marks(run), ["recompile"])
    ax.set_ylabel("tokens / s (all devices)")
    ax.set_title("Throughput")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    if efficiency:
        ax2 = axes[1]
        if util.size:
            steps, util = series(run.metrics, "mfu")
            ax2.plot(steps, 100 * util, lw=1.5, color="tab:green", label="MFU")
            ax2.set_ylabel("MFU (%)")
            ax2.set_ylim(bottom=0)
        if tflops.size:
            steps, tflops = series(run.metrics, "tflops_per_device")
            twin = ax2.twinx() if util.size else ax2
            twin.plot(steps, tflops, lw=1, ls="--", color="tab:purple", label="TFLOP/s per device")
            twin.set_ylabel("model TFLOP/s per device")
            twin.set_ylim(bottom=0)
            if twin is not ax2:
                lines = ax2.get_lines() + twin.get_lines()
                ax2.legend(lines, [ln.get_label() for ln in lines], loc="lower right")
        if not (util.size and tflops.size):
            ax2.legend(loc="lower right")
        _mark_events(ax2, event_marks(run), ["recompile"], label=False)
        ax2.set_title("Model FLOPs utilization")
        ax2.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    return fig


MAX_EXPERT_LINES = 10  # above this many experts, lines show the spread instead of each expert


def plot_expert_load(run: Run, fig: Figure | None = None) -> Figure:
    """One row per MoE layer: left, each expert's routed tokens per step (solid) and its
    capacity in the step (dashed, same colour; capacity per group x groups per step); right,
    tokens / capacity per expert over time (red above 1: the expert surely dropped tokens)."""
    from matplotlib.colors import TwoSlopeNorm

    load = expert_load(run)
    if load is None:
        raise ValueError("no tokens_per_expert in metrics.jsonl: not an MoE run")
    num_layers, num_experts = load.tokens.shape[1:]
    fig = _new_figure(fig, 0.6 + 2.8 * num_layers)
    axes = fig.subplots(num_layers, 2, squeeze=False, width_ratios=(3, 2), sharex=True)
    marks = event_marks(run)
    edges = _edges(load.steps)
    ratio = load.utilisation
    top = max(2.0, float(np.nanmax(ratio))) if np.isfinite(ratio).any() else 2.0
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=top)
    for row in range(num_layers):
        ax, heat = axes[row]
        tokens, capacity = load.tokens[:, row], load.capacity[:, row]
        if num_experts <= MAX_EXPERT_LINES:
            for e in range(num_experts):
                color = f"C{e}"
                ax.plot(load.steps, tokens[:, e], lw=1.2, color=color, label=f"expert {e}")
                ax.step(
                    load.steps,
                    capacity[:, e],
                    where="pre",
                    lw=2,
                    color=color,
                    ls=_shared_dashes(e, num_experts),
                )
        else:
            for stat, style in ((np.max, "-"), (np.median, "-."), (np.min, ":")):
                ax.plot(
                    load.steps,
                    stat(tokens, axis=1),
                    ls=style,
                    color="tab:blue",
                    label=f"{stat.__name__} over experts",
                )
            ax.fill_between(
                load.steps,
                np.nanmin(capacity, axis=1),
                np.nanmax(capacity, axis=1),
                step="pre",
                color="tab:red",
                alpha=0.2,
                label="capacity range",
            )
        _mark_events(ax, marks, ["recompile"], label=False)
        ax.set_ylabel("tokens / step")
        ax.set_ylim(bottom=0)
        ax.set_title(
            f"MoE layer {load.layers[row]}: routed tokens (solid), capacity (dashed)",
            fontsize="medium",
        )
        ax.grid(alpha=0.3)
        mesh = heat.pcolormesh(
            edges,
            np.arange(num_experts + 1) - 0.5,
            ratio[:, row].T,
            cmap="RdBu_r",
            norm=norm,
            shading="flat",
        )
        heat.set_yticks(range(num_experts) if num_experts <= 16 else heat.get_yticks())
        heat.set_ylabel("expert")
        heat.set_title(f"layer {load.layers[row]}: tokens / capacity", fontsize="medium")
        fig.colorbar(mesh, ax=heat, label="tokens / capacity")
    axes[-1, 0].set_xlabel("step")
    axes[-1, 1].set_xlabel("step")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    if num_experts <= MAX_EXPERT_LINES:
        handles.append(_line_proxy(None, color="0.2", style=(0, (3, 3)), width=2))
        labels.append("capacity (dashed, expert's colour)")
    if "recompile" in marks:
        handles.append(_line_proxy("recompile"))
        labels.append(MARKS["recompile"][0])
    fig.legend(
        handles, labels, loc="outside upper center", ncol=min(len(labels), 6), fontsize="small"
    )
    return fig


def _shared_dashes(index: int, count: int) -> tuple[int, tuple[int, int]]:
    """A dash pattern for line ``index`` of ``count`` whose dashes fall in the gaps of the
    others': lines at the same height (experts with equal capacity) show every colour in turn."""
    on = 3
    return (on * index, (on, on * max(1, count - 1)))


def _edges(steps: np.ndarray) -> np.ndarray:
    """Cell edges around sorted steps: each step, a sample of the Plan that step ran with, owns
    the interval up to the next one (so a change shows where the swap put it)."""
    if steps.size == 1:
        return np.array([steps[0] - 0.5, steps[0] + 0.5])
    last = steps[-1] + (steps[-1] - steps[-2])
    return np.concatenate([steps, [last]]).astype(np.float64)


PIPELINE_MARKS = ("recompile", "rebalance", "rebalance_rejected", "repack", "migrate", "release")


def plot_pipeline(run: Run, fig: Figure | None = None) -> Figure:
    """Pipeline balance over time: each stage's measured busy seconds per profiled step
    (forward + backward, solid; forward, dashed), the layers each stage holds, and the step's
    bubble ratio and iteration time; decisions and swaps as vertical lines."""
    load = stage_load(run)
    if load is None:
        raise ValueError("no profile events: not a profiled pipeline run")
    layout = stage_layers(run)
    fig = _new_figure(fig, 9.0)
    axes = fig.subplots(3, 1, sharex=True, height_ratios=(3, 1.6, 2))
    marks = event_marks(run)
    kinds = [k for k in PIPELINE_MARKS if k in marks]

    ax = axes[0]
    total = load.forward + load.backward
    for s in range(total.shape[1]):
        ax.plot(load.steps, total[:, s], "o-", ms=4, color=f"C{s}", label=f"stage {s}")
    _maybe_log(ax, total)
    _mark_events(ax, marks, kinds, label=False)
    ax.set_ylabel("busy seconds / step (fwd + bwd)")
    ax.set_title("Measured stage load (profiled steps)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")

    ax = axes[1]
    last = max(int(load.steps.max()), _last_step(run))
    if layout is not None:
        bounds, per_stage = layout
        x = np.append(bounds, last)
        counts = np.nan_to_num(np.vstack([per_stage, per_stage[-1:]]))
        ax.stackplot(
            x,
            counts.T,
            step="post",
            colors=[f"C{s}" for s in range(counts.shape[1])],
            alpha=0.6,
            labels=[f"stage {s}" for s in range(counts.shape[1])],
        )
        ax.set_ylim(0, counts.sum(axis=1).max())
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    _mark_events(ax, marks, kinds, label=False)
    ax.set_ylabel("layers")
    ax.set_title("Layers per stage (Plan in force)")
    ax.grid(alpha=0.3)

    ax = axes[2]
    ax.plot(load.steps, load.bubble_ratio, "o-", ms=4, color="tab:blue", label="bubble ratio")
    ax.set_ylim(0, 1)
    ax.set_ylabel("bubble ratio", color="tab:blue")
    twin = ax.twinx()
    twin.plot(
        load.steps,
        load.iteration_seconds,
        "s--",
        ms=4,
        color="tab:brown",
        label="iteration seconds",
    )
    _maybe_log(twin, load.iteration_seconds)
    twin.set_ylabel("iteration seconds", color="tab:brown")
    _mark_events(ax, marks, kinds, label=False)
    ax.set_title(
        "Bubble ratio (blue dots, left) and iteration seconds (brown squares, right), profiled"
    )
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if kinds:  # one legend for the vertical lines, under the figure
        proxies = [_line_proxy(k) for k in kinds]
        fig.legend(
            proxies,
            [MARKS[k][0] for k in kinds],
            loc="outside lower center",
            ncol=len(kinds),
            fontsize="small",
        )
    return fig


def _line_proxy(kind: str | None, color: str = "", style: Any = "-", width: float = 1.2) -> Any:
    """A legend handle: the line of a kind of `MARKS`, or of the given look."""
    from matplotlib.lines import Line2D

    if kind is not None:
        _, color, style = MARKS[kind]
    return Line2D([], [], color=color, ls=style, lw=width)


def _last_step(run: Run) -> int:
    return max((int(r["step"]) for r in run.metrics if _is_number(r.get("step"))), default=0)


MAX_LAYER_LINES = 12


def plot_layer_costs(run: Run, fig: Figure | None = None) -> Figure:
    """Per-layer cost over time: the modelled cost (layer_costs.jsonl, a dense layer = 1) as a
    step x layer heatmap, and the profiled forward + backward seconds per layer."""
    costs = layer_costs(run)
    if costs is None:
        raise ValueError("no layer_costs.jsonl and no profiled layer times")
    panels = int(costs.steps.size > 0) + int(costs.profiled_steps.size > 0)
    fig = _new_figure(fig, 0.6 + 3.4 * panels)
    axes = list(fig.subplots(panels, 1, squeeze=False, sharex=True)[:, 0])
    last = axes[-1]
    marks = event_marks(run)
    if costs.steps.size:
        ax = axes.pop(0)
        num_layers = costs.modelled.shape[1]
        mesh = ax.pcolormesh(
            _edges(costs.steps),
            np.arange(num_layers + 1) - 0.5,
            costs.modelled.T,
            cmap="viridis",
            shading="flat",
        )
        fig.colorbar(mesh, ax=ax, label="relative cost (dense layer = 1)")
        ax.set_yticks(range(num_layers) if num_layers <= 24 else ax.get_yticks())
        ax.set_ylabel("layer")
        ax.set_title("Modelled cost per layer (Plan in force)")
        _mark_events(ax, marks, ["recompile"])
    if costs.profiled_steps.size:
        ax = axes.pop(0)
        num_layers = costs.seconds.shape[1]
        if num_layers <= MAX_LAYER_LINES:
            for layer in range(num_layers):
                ax.plot(
                    costs.profiled_steps,
                    1e3 * costs.seconds[:, layer],
                    "o-",
                    ms=3,
                    color=f"C{layer % 10}",
                    label=f"layer {layer}",
                )
            _maybe_log(ax, costs.seconds)
            _mark_events(ax, marks, ["recompile"])
            ax.set_ylabel("ms (forward + backward)")
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
            ax.grid(alpha=0.3, which="both")
        else:
            mesh = ax.pcolormesh(
                _edges(costs.profiled_steps),
                np.arange(num_layers + 1) - 0.5,
                1e3 * costs.seconds.T,
                cmap="magma",
                shading="flat",
            )
            fig.colorbar(mesh, ax=ax, label="ms (forward + backward)")
            ax.set_ylabel("layer")
            _mark_events(ax, marks, ["recompile"])
        ax.set_title("Profiled time per layer")
    last.set_xlabel("step")
    return fig


def plot_freezing(run: Run, ax: Axes | None = None) -> Axes:
    """The frozen prefix (layers that run no backward) and the count of frozen layers over
    time, from the Plans' ``frozen_layers``."""
    frozen = frozen_layers(run)
    if frozen is None:
        raise ValueError("no Plan froze a layer")
    ax = _new_axes(ax, 4.0)
    x = np.append(frozen.boundaries, max(_last_step(run), int(frozen.boundaries[-1]) + 1))
    ax.step(
        x,
        np.append(frozen.prefix, frozen.prefix[-1]),
        where="post",
        lw=2,
        color="tab:blue",
        label="frozen prefix (no backward)",
    )
    if (frozen.count != frozen.prefix).any():
        ax.step(
            x,
            np.append(frozen.count, frozen.count[-1]),
            where="post",
            lw=1.5,
            ls="--",
            color="tab:orange",
            label="frozen layers",
        )
    layers = run.config_value("model.num_layers")
    if _is_number(layers):
        ax.set_ylim(0, layers + 0.3)
        ax.axhline(layers, color="0.5", lw=1, ls=":", label=f"all {layers} layers")
    ax.yaxis.get_major_locator().set_params(integer=True)
    _mark_events(ax, event_marks(run), ["recompile"])
    ax.set_xlabel("step")
    ax.set_ylabel("layers")
    ax.set_title("Layer freezing")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    return ax


def plot_pruning(run: Run, fig: Figure | None = None) -> Figure:
    """One panel per ``pruning/...`` metric: a line for a scalar, a line per layer (coloured
    by layer) for a per-layer list such as each layer's sparsity."""
    import matplotlib as mpl

    metrics = pruning_series(run)
    if not metrics:
        raise ValueError("no pruning/ metrics")
    fig = _new_figure(fig, 0.6 + 3.0 * len(metrics))
    axes = fig.subplots(len(metrics), 1, squeeze=False, sharex=True)[:, 0]
    for ax, (key, (steps, values)) in zip(axes, metrics.items(), strict=True):
        if values.ndim == 1:
            ax.plot(steps, values, lw=1.5, color="tab:blue", label=key.split("/", 1)[1])
        else:
            num = values.shape[1]
            cmap = mpl.colormaps["viridis"]
            for layer in range(num):
                color = cmap(layer / max(1, num - 1))
                ax.plot(steps, values[:, layer], lw=1.2, color=color, label=f"layer {layer}")
            if num > MAX_LAYER_LINES:  # too many for a legend: a colour bar of layer indices
                norm = mpl.colors.BoundaryNorm(np.arange(num + 1) - 0.5, cmap.N)
                bar = fig.colorbar(mpl.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax)
                bar.set_label("layer")
                bar.locator = mpl.ticker.MaxNLocator(integer=True)
                bar.update_ticks()
        _mark_events(ax, event_marks(run), ["recompile"])
        ax.set_title(key)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if values.ndim == 1 or values.shape[1] <= MAX_LAYER_LINES:
            ax.legend(
                handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small"
            )
    axes[-1].set_xlabel("step")
    return fig


# ----------------------------------------------------------------------------------------------
# The report


@dataclass
class Plot:
    """A PNG the report wrote (``width`` x ``height`` pixels) or skipped (``reason``)."""

    name: str
    title: str
    path: Path | None = None
    width: int = 0
    height: int = 0
    reason: str = ""


def _axes_plot(draw: Callable[[Run, Any], Any], height: float) -> Callable[[Run, Figure], None]:
    def on(run: Run, fig: Figure) -> None:
        fig.set_size_inches(WIDTH, height)
        draw(run, fig.add_subplot())

    return on


# name, title, drawing onto a given Figure, the reason to skip (None = draw), caption
PLOTS: tuple[tuple[str, str, Callable[[Run, Figure], Any], Callable[[Run], str | None], str], ...]
PLOTS = (
    (
        "loss",
        "Loss",
        _axes_plot(plot_loss, 4.5),
        lambda r: None if series(r.metrics, "loss")[0].size else "no `loss` in metrics.jsonl yet",
        "Training loss per logged step and evaluation loss; red dashes: recompiles swapped in.",
    ),
    (
        "throughput",
        "Throughput",
        plot_throughput,
        lambda r: (
            None
            if series(r.metrics, "tokens_per_sec")[0].size
            else "no `tokens_per_sec` in metrics.jsonl yet (logged from the second logged step on)"
        ),
        "Tokens per second over each logging interval (points; log scale when they spread over "
        "20x) and their rolling median; MFU and model TFLOP/s per device when logged.",
    ),
    (
        "expert_load",
        "MoE: expert load against capacity",
        plot_expert_load,
        lambda r: (
            None
            if expert_load(r) is not None
            else "no `tokens_per_expert` in metrics.jsonl: not an MoE run"
        ),
        "Per MoE layer: each expert's routed tokens per step (before dropping; solid) against "
        "its slots in the step (dashed: the Plan's capacity per sequence x sequences per step, "
        "from the compile/recompile events); right: tokens / capacity, red above 1 (the expert "
        "surely dropped tokens; below 1 it may still drop in an unlucky sequence).",
    ),
    (
        "pipeline",
        "Pipeline: measured stage load and rebalancing",
        plot_pipeline,
        lambda r: (
            None
            if stage_load(r) is not None
            else "no `profile` events: not a pipeline run (mesh.stage > 1), or not profiled "
            "(pipeline.profile_on_change / pipeline.profile_every; multi-process runs are not)"
        ),
        "Each stage's busy seconds in a profiled step (all microbatches), the layers it holds, "
        "and the step's bubble ratio and iteration time; vertical lines: recompiles, accepted "
        "and declined rebalance decisions, re-packs, migrations, released devices.",
    ),
    (
        "layer_costs",
        "Per-layer cost",
        plot_layer_costs,
        lambda r: (
            None
            if layer_costs(r) is not None
            else "no layer_costs.jsonl (written when a dynamism plugin is enabled) and no profiled "
            "layer times"
        ),
        "Top: each layer's modelled cost under the Plan in force (a dense layer = 1); bottom: "
        "its profiled forward + backward time, when profiled.",
    ),
    (
        "freezing",
        "Layer freezing",
        _axes_plot(plot_freezing, 4.0),
        lambda r: (
            None
            if frozen_layers(r) is not None
            else "no Plan froze a layer (no `frozen_layers` in the compile/recompile events)"
        ),
        "The frozen prefix (layers 0..n-1 frozen: no backward) of each Plan over time.",
    ),
    (
        "pruning",
        "Pruning",
        plot_pruning,
        lambda r: None if pruning_series(r) else "no `pruning/...` metrics in metrics.jsonl",
        "Each `pruning/...` metric over time (per-layer lists: one line per layer).",
    ),
)


def render(run: Run, out: Path) -> list[Plot]:
    """Write every plot the run has data for as ``out/<name>.png``; return them, the skipped
    ones with their reason."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    out.mkdir(parents=True, exist_ok=True)
    plots = []
    for name, title, draw, skip, _ in PLOTS:
        reason = skip(run)
        if reason is not None:
            plots.append(Plot(name, title, reason=reason))
            continue
        fig = Figure(layout="constrained")
        draw(run, fig)
        path = out / f"{name}.png"
        fig.savefig(path, dpi=DPI)
        width, height = (round(v * DPI) for v in fig.get_size_inches())
        plots.append(Plot(name, title, path, width, height))
    return plots


def _fmt(value: Any, spec: str = ".4f") -> str:
    return "n/a" if value is None else format(value, spec)


def _steps(steps: Sequence[int]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"


def markdown(run: Run, plots: Sequence[Plot], out: Path) -> str:
    """report.md: the key numbers, the recompiles, each plot (or why it is missing)."""
    s = summary(run)
    mfu = None if s["median_mfu"] is None else 100 * s["median_mfu"]
    rows = [
        ("steps logged", f"{_fmt(s['first_step'], 'd')} -> {_fmt(s['last_step'], 'd')}"),
        ("final train loss", _fmt(s["final_loss"])),
        ("final eval loss", _fmt(s["final_eval_loss"])),
        ("median tokens/s", _fmt(s["median_tokens_per_sec"], ",.0f")),
    ]
    if mfu is not None:
        rows.append(("median MFU", f"{mfu:.2f} %"))
    if s["model_flops_per_token"] is not None:
        rows.append(("model FLOPs / token", f"{s['model_flops_per_token']:,.0f}"))
    first = s["compile_seconds"]
    rows += [
        ("compile at start", ", ".join(f"{c:.1f} s" for c in first) or "n/a"),
        (
            "recompiles",
            f"{len(s['recompiles'])} "
            f"({sum(r['compile_seconds'] or 0 for r in s['recompiles']):.1f} s compiling)"
            if s["recompiles"]
            else "0",
        ),
        (
            "rejected / failed recompiles, policy errors",
            f"{s['recompiles_rejected']} / {s['recompiles_failed']} / {s['policy_errors']}",
        ),
        ("checkpoints saved", _steps(s["checkpoints_saved"])),
        ("checkpoints kept", _steps(s["checkpoints_kept"])),
    ]
    if s["checkpoints_failed"]:
        rows.append(("checkpoint failures", str(s["checkpoints_failed"])))
    if s["rebalances"]:
        rows.append(
            ("rebalance decisions", f"{s['rebalances']} ({s['rebalances_accepted']} accepted)")
        )
    if s["repacks"]:
        rows.append(("re-pack decisions", f"{s['repacks']} ({s['repacks_accepted']} accepted)"))
    if s["migrations"]:
        rows.append(
            (
                "migrations",
                f"{s['migrations']} ({s['migrated_bytes']:,.0f} bytes, "
                f"{s['migration_seconds']:.3f} s)",
            )
        )
    if s["releases"]:
        rows.append(("device releases", str(s["releases"])))
    if s["resumes"]:
        rows.append(("resumes", str(s["resumes"])))
    lines = [f"# Run report: `{run.workdir}`", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    if s["recompiles"]:
        lines += [
            "",
            "## Recompiles",
            "",
            "| proposed at | swapped at | policy | compile s | lower s | steps during "
            "compile | cache hit | reason |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in s["recompiles"]:
            reason = str(r["reason"] or "").replace("|", "/")
            lines.append(
                f"| {r['step']} | {r['swap_step']} | {r['policy']} | "
                f"{_fmt(r['compile_seconds'], '.2f')} | {_fmt(r['lower_seconds'], '.2f')} | "
                f"{r['steps_during_compile']} | {r['cache_hit']} | {reason} |"
            )
    if run.processes:
        lines += [
            "",
            "## Processes",
            "",
            "Process 0 writes the workdir; process i > 0 writes `process_<i>/` (the same "
            "metrics, exchanged between the processes). The summary above is process 0's.",
            "",
            "| process | metrics lines | last step | median tokens/s | events |",
            "|---|---|---|---|---|",
        ]
        for i, r in [(0, run), *run.processes.items()]:
            p = summary(r)
            lines.append(
                f"| {i} | {len(r.metrics)} | {_fmt(p['last_step'], 'd')} | "
                f"{_fmt(p['median_tokens_per_sec'], ',.0f')} | {len(r.events)} |"
            )
    lines += ["", "## Plots"]
    captions = {name: caption for name, _, _, _, caption in PLOTS}
    for p in plots:
        lines += ["", f"### {p.title}", ""]
        if p.path is None:
            lines.append(f"Skipped: {p.reason}.")
        else:
            rel = p.path.relative_to(out) if p.path.is_relative_to(out) else p.path
            lines += [captions[p.name], "", f"![{p.title}]({rel})"]
    return "\n".join(lines) + "\n"


def write_report(workdir: str | Path | Run, out: str | Path | None = None) -> list[Plot]:
    """Render the plots of a run and ``report.md`` into ``out`` (default WORKDIR/report)."""
    run = workdir if isinstance(workdir, Run) else load_run(workdir)
    out = Path(out) if out is not None else run.workdir / "report"
    plots = render(run, out)
    (out / "report.md").write_text(markdown(run, plots, out))
    return plots


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dynjax.report",
        description="Plots and a short report.md of a dynjax run's workdir.",
    )
    parser.add_argument("workdir", help="the run's workdir (finished or still running)")
    parser.add_argument("--out", default=None, help="output directory (default WORKDIR/report)")
    args = parser.parse_args(argv)
    try:
        run = load_run(args.workdir)
    except (ReportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        import matplotlib
    except ImportError:
        print("error: the report needs matplotlib: pip install 'matplotlib>=3.8'", file=sys.stderr)
        return 2
    matplotlib.use("Agg")  # files only, no display
    try:
        plots = write_report(run, args.out)
    except OSError as e:
        print(f"error: cannot write the report: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(args.workdir) / "report"
    names = ", ".join(p.path.name for p in plots if p.path is not None) or "none yet"
    print(f"wrote {out / 'report.md'}; plots: {names}")
    for p in plots:
        if p.path is None:
            print(f"  skipped {p.name}: {p.reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
