"""MoE's plots in the run report (`dynjax.report`): each expert's routed tokens against its
capacity, per MoE layer and step (seed 001 §4.1: the per-expert capacities the Plan holds).

The report walks its schemes' plots (`MoEPlugin.report_plots`, the `dynjax.report.pngs.PLOTS`
entries of `PLOTS` here), so it names no scheme; this module is imported by the report only.
The arrays (`expert_load`) need no matplotlib; `plot_expert_load` draws them.

In a notebook::

    from dynjax.dynamism.moe.report import expert_load, plot_expert_load
    from dynjax.report import load_run
    run = load_run("workdirs/moe")
    plot_expert_load(run)
    load = expert_load(run)             # load.tokens [T, L, E], load.capacity [T, L, E]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dynjax.dynamism.moe.part import NAME
from dynjax.model import facts
from dynjax.runlog.arrays import MARKS, by_step, event_marks, is_number, plan_changes, plans_at
from dynjax.runlog.plots import line_proxy, mark_events, new_figure, step_edges
from dynjax.runlog.workdir import Run

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TOKENS = "tokens_per_expert"  # metrics.jsonl: [MoE layers, E] routed token-choices of a step


def moe_layer_indices(run: Run) -> list[int] | None:
    """The model layers holding an MoE block, None without a config that says."""
    every, layers = run.config_value("moe.every"), run.config_value("model.num_layers")
    if not (is_number(every) and is_number(layers)):
        return None
    return list(facts.moe_layer_indices(layers, every))


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
    if is_number(batch) and batch > 0:
        return int(batch)
    seq, k = run.config_value("data.seq_len"), run.config_value("moe.top_k")
    if tokens is not None and tokens.size and is_number(seq) and is_number(k) and seq * k > 0:
        return int(round(float(tokens[0, 0].sum()) / (seq * k)))
    return None


def expert_load(run: Run) -> ExpertLoad | None:
    """`ExpertLoad` of an MoE run; None when metrics.jsonl has no ``tokens_per_expert``."""
    logged = by_step(run.metrics, TOKENS)
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
        caps = np.asarray(_capacities(plan or {}), dtype=np.float64)
        if groups is not None and caps.shape == shape:
            capacity[t] = caps * groups
    layers = moe_layer_indices(run)
    if layers is None or len(layers) != shape[0]:
        layers = list(range(shape[0]))
    return ExpertLoad(np.array(steps, dtype=np.int64), tokens, capacity, layers)


def _capacities(plan: dict) -> list:
    """The capacities of a logged Plan: in MoE's part, or a top-level field of older runs'."""
    return plan.get("parts", {}).get(NAME, {}).get("capacities") or plan.get("capacities") or []


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
    fig = new_figure(fig, 0.6 + 2.8 * num_layers)
    axes = fig.subplots(num_layers, 2, squeeze=False, width_ratios=(3, 2), sharex=True)
    marks = event_marks(run)
    edges = step_edges(load.steps)
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
        mark_events(ax, marks, ["recompile"], label=False)
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
        handles.append(line_proxy(None, color="0.2", style=(0, (3, 3)), width=2))
        labels.append("capacity (dashed, expert's colour)")
    if "recompile" in marks:
        handles.append(line_proxy("recompile"))
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


PLOTS = (
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
)
