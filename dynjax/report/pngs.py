"""The plots of the report (name, title, when to skip, caption) and writing them as PNG files.

A dynamism scheme's own plots come from its plugin (`dynjax.dynamism.base.Plugin.report_plots`,
walked over `dynjax.dynamism.BUILTIN`), after the run's loss and throughput."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dynjax.dynamism import BUILTIN, Schemes
from dynjax.runlog import plots as drawing
from dynjax.runlog.arrays import layer_costs, series, stage_load
from dynjax.runlog.plots import PlotEntry, on_axes
from dynjax.runlog.workdir import Run

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


def scheme_plots(schemes: Schemes) -> tuple[PlotEntry, ...]:
    """Every scheme's own plots (`Plugin.report_plots`), in scheme order."""
    return tuple(entry for plugin in schemes.plugins for entry in plugin.report_plots())


_RUN_PLOTS: tuple[PlotEntry, ...] = (
    (
        "loss",
        "Loss",
        on_axes(drawing.plot_loss, 4.5),
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
