"""The plots of the report (name, title, when to skip, caption) and writing them as PNG files.

A dynamism scheme's own plots come from its plugin (`dynjax.dynamism.base.Plugin.report_plots`,
walked over `dynjax.dynamism.BUILTIN`), after the run's loss and throughput."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynjax.dynamism import BUILTIN, Schemes
from dynjax.runlog import plots as drawing
from dynjax.runlog.arrays import (
    frozen_layers,
    layer_costs,
    scheme_series,
    series,
    stage_load,
)
from dynjax.runlog.workdir import Run

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 100  # every PNG is drawing.WIDTH * DPI = 1000 pixels wide


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
        fig.set_size_inches(drawing.WIDTH, height)
        draw(run, fig.add_subplot())

    return on


def _scheme_plot(scheme: str, name: str, title: str, caption: str) -> tuple:
    """The `PLOTS` entry drawing every ``<scheme>/...`` metric a dynamism plugin logs."""

    def skip(run: Run) -> str | None:
        return None if scheme_series(run, scheme) else f"no `{scheme}/...` metrics in metrics.jsonl"

    return name, title, lambda run, fig: drawing.plot_scheme(run, scheme, fig), skip, caption


# name, title, drawing onto a given Figure, the reason to skip (None = draw), caption
PlotEntry = tuple[str, str, Callable[[Run, "Figure"], Any], Callable[[Run], str | None], str]


def scheme_plots(schemes: Schemes) -> tuple[PlotEntry, ...]:
    """Every scheme's own plots (`Plugin.report_plots`), in scheme order."""
    return tuple(entry for plugin in schemes.plugins for entry in plugin.report_plots())


_RUN_PLOTS: tuple[PlotEntry, ...] = (
    (
        "loss",
        "Loss",
        _axes_plot(drawing.plot_loss, 4.5),
        lambda r: None if series(r.metrics, "loss")[0].size else "no `loss` in metrics.jsonl yet",
        "Training loss per logged step and evaluation loss; red dashes: recompiles swapped in.",
    ),
    (
        "throughput",
        "Throughput",
        drawing.plot_throughput,
        lambda r: (
            None
            if series(r.metrics, "tokens_per_sec")[0].size
            else "no `tokens_per_sec` in metrics.jsonl yet (logged from the second logged step on)"
        ),
        "Tokens per second over each logging interval (points; log scale when they spread over "
        "20x) and their rolling median; MFU and model TFLOP/s per device when logged.",
    ),
)
_LAYER_PLOTS: tuple[PlotEntry, ...] = (
    (
        "pipeline",
        "Pipeline: measured stage load and rebalancing",
        drawing.plot_pipeline,
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
        drawing.plot_layer_costs,
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
        _axes_plot(drawing.plot_freezing, 4.0),
        lambda r: (
            None
            if frozen_layers(r) is not None
            else "no Plan froze a layer (no `frozen_layers` in the compile/recompile events)"
        ),
        "The frozen prefix (layers 0..n-1 frozen: no backward) of each Plan over time.",
    ),
    _scheme_plot(
        "freezing",
        "freezing_metrics",
        "Layer freezing: measurements",
        "Each `freezing/...` metric over time, e.g. each layer's plasticity (one line per layer).",
    ),
    _scheme_plot(
        "pruning",
        "pruning",
        "Pruning",
        "Each `pruning/...` metric over time (per-layer lists: one line per layer).",
    ),
)
PLOTS: tuple[PlotEntry, ...] = _RUN_PLOTS + scheme_plots(BUILTIN) + _LAYER_PLOTS


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
