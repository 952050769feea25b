"""Drawing a `Run` with matplotlib: one ``plot_*`` function per plot, each onto a given Axes or
Figure, or a new pyplot one. matplotlib is imported only by the functions that draw."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dynjax.runlog.arrays import (
    MARKS,
    event_marks,
    frozen_layers,
    is_number,
    layer_costs,
    scheme_series,
    series,
    stage_layers,
    stage_load,
)
from dynjax.runlog.workdir import Run

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

WIDTH = 10.0  # inches: every plot is WIDTH wide

# A plot of the run report (`dynjax.report.pngs.PLOTS`, `Plugin.report_plots`): name, title,
# drawing onto a given Figure, the reason to skip a run (None: draw), caption.
PlotEntry = tuple[str, str, Callable[[Run, "Figure"], Any], Callable[[Run], str | None], str]


def new_figure(fig: Figure | None, height: float) -> Figure:
    """``fig`` resized to WIDTH x height inches, or a new pyplot figure of that size."""
    if fig is None:
        import matplotlib.pyplot as plt

        return plt.figure(figsize=(WIDTH, height), layout="constrained")
    fig.set_size_inches(WIDTH, height)
    return fig


def _new_axes(ax: Axes | None, height: float = 4.5) -> Axes:
    return new_figure(None, height).add_subplot() if ax is None else ax


def mark_events(
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
    mark_events(ax, event_marks(run), ["recompile"])
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
    fig = new_figure(fig, 7.0 if efficiency else 4.5)
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
    mark_events(ax, event_marks(run), ["recompile"])
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
        mark_events(ax2, event_marks(run), ["recompile"], label=False)
        ax2.set_title("Model FLOPs utilization")
        ax2.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    return fig


def step_edges(steps: np.ndarray) -> np.ndarray:
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
    fig = new_figure(fig, 9.0)
    axes = fig.subplots(3, 1, sharex=True, height_ratios=(3, 1.6, 2))
    marks = event_marks(run)
    kinds = [k for k in PIPELINE_MARKS if k in marks]

    ax = axes[0]
    total = load.forward + load.backward
    for s in range(total.shape[1]):
        ax.plot(load.steps, total[:, s], "o-", ms=4, color=f"C{s}", label=f"stage {s}")
    _maybe_log(ax, total)
    mark_events(ax, marks, kinds, label=False)
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
    mark_events(ax, marks, kinds, label=False)
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
    mark_events(ax, marks, kinds, label=False)
    ax.set_title(
        "Bubble ratio (blue dots, left) and iteration seconds (brown squares, right), profiled"
    )
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if kinds:  # one legend for the vertical lines, under the figure
        proxies = [line_proxy(k) for k in kinds]
        fig.legend(
            proxies,
            [MARKS[k][0] for k in kinds],
            loc="outside lower center",
            ncol=len(kinds),
            fontsize="small",
        )
    return fig


def line_proxy(kind: str | None, color: str = "", style: Any = "-", width: float = 1.2) -> Any:
    """A legend handle: the line of a kind of `MARKS`, or of the given look."""
    from matplotlib.lines import Line2D

    if kind is not None:
        _, color, style = MARKS[kind]
    return Line2D([], [], color=color, ls=style, lw=width)


def _last_step(run: Run) -> int:
    return max((int(r["step"]) for r in run.metrics if is_number(r.get("step"))), default=0)


MAX_LAYER_LINES = 12


def plot_layer_costs(run: Run, fig: Figure | None = None) -> Figure:
    """Per-layer cost over time: the modelled cost (layer_costs.jsonl, a dense layer = 1) as a
    step x layer heatmap, and the profiled forward + backward seconds per layer."""
    costs = layer_costs(run)
    if costs is None:
        raise ValueError("no layer_costs.jsonl and no profiled layer times")
    panels = int(costs.steps.size > 0) + int(costs.profiled_steps.size > 0)
    fig = new_figure(fig, 0.6 + 3.4 * panels)
    axes = list(fig.subplots(panels, 1, squeeze=False, sharex=True)[:, 0])
    last = axes[-1]
    marks = event_marks(run)
    if costs.steps.size:
        ax = axes.pop(0)
        num_layers = costs.modelled.shape[1]
        mesh = ax.pcolormesh(
            step_edges(costs.steps),
            np.arange(num_layers + 1) - 0.5,
            costs.modelled.T,
            cmap="viridis",
            shading="flat",
        )
        fig.colorbar(mesh, ax=ax, label="relative cost (dense layer = 1)")
        ax.set_yticks(range(num_layers) if num_layers <= 24 else ax.get_yticks())
        ax.set_ylabel("layer")
        ax.set_title("Modelled cost per layer (Plan in force)")
        mark_events(ax, marks, ["recompile"])
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
            mark_events(ax, marks, ["recompile"])
            ax.set_ylabel("ms (forward + backward)")
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
            ax.grid(alpha=0.3, which="both")
        else:
            mesh = ax.pcolormesh(
                step_edges(costs.profiled_steps),
                np.arange(num_layers + 1) - 0.5,
                1e3 * costs.seconds.T,
                cmap="magma",
                shading="flat",
            )
            fig.colorbar(mesh, ax=ax, label="ms (forward + backward)")
            ax.set_ylabel("layer")
            mark_events(ax, marks, ["recompile"])
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
    if is_number(layers):
        ax.set_ylim(0, layers + 0.3)
        ax.axhline(layers, color="0.5", lw=1, ls=":", label=f"all {layers} layers")
    ax.yaxis.get_major_locator().set_params(integer=True)
    mark_events(ax, event_marks(run), ["recompile"])
    ax.set_xlabel("step")
    ax.set_ylabel("layers")
    ax.set_title("Layer freezing")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    return ax


def plot_scheme(run: Run, scheme: str, fig: Figure | None = None) -> Figure:
    """One panel per ``<scheme>/...`` metric (``scheme_series``): a line for a scalar, a line
    per layer (coloured by layer) for a per-layer list such as each layer's pruned density or
    plasticity."""
    import matplotlib as mpl

    metrics = scheme_series(run, scheme)
    if not metrics:
        raise ValueError(f"no {scheme}/ metrics")
    fig = new_figure(fig, 0.6 + 3.0 * len(metrics))
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
        finite = values[np.isfinite(values)]
        if finite.size and finite.min() > 0 and finite.max() > 20 * finite.min():
            ax.set_yscale("log")  # e.g. plasticity, from above 100 to below 1
        mark_events(ax, event_marks(run), ["recompile"])
        ax.set_title(key)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if values.ndim == 1 or values.shape[1] <= MAX_LAYER_LINES:
            ax.legend(
                handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small"
            )
    axes[-1].set_xlabel("step")
    return fig


def on_axes(draw: Callable[[Run, Any], Any], height: float) -> Callable[[Run, Figure], None]:
    """``draw(run, ax)`` as a report plot's drawing: onto one Axes of a WIDTH x ``height``
    figure."""

    def on(run: Run, fig: Figure) -> None:
        fig.set_size_inches(WIDTH, height)
        draw(run, fig.add_subplot())

    return on


def scheme_metrics_plot(scheme: str, name: str, title: str, caption: str) -> PlotEntry:
    """The report plot of every ``<scheme>/...`` metric a dynamism plugin logs
    (`plot_scheme`), skipped when the run logged none."""

    def skip(run: Run) -> str | None:
        return None if scheme_series(run, scheme) else f"no `{scheme}/...` metrics in metrics.jsonl"

    return name, title, lambda run, fig: plot_scheme(run, scheme, fig), skip, caption
