"""Run report: PNG plots and a short ``report.md`` of what a run wrote to its workdir.

    python -m dynjax.report WORKDIR [--out DIR]     # DIR defaults to WORKDIR/report

It reads the files of docs/running.md "What a run writes" (``metrics.jsonl``, ``events.jsonl``,
``layer_costs.jsonl``, ``config.json``, and ``process_<i>/`` of a multi-process run), on a
finished run or a live one (a torn last line is skipped). A plot whose data the run does not
have is skipped, with a line in report.md saying why.

Data and drawing are kept apart, one module each:

* ``workdir`` -- `load_run` reads a workdir into a `Run`.
* ``arrays`` -- pure functions turn its records into NumPy arrays (`series`, `plan_changes`,
  `stage_load`, `layer_costs`, `frozen_layers`, `scheme_series`, `event_marks`), testable
  without matplotlib; ``key_numbers``: `summary`.
* ``plots`` -- small ``plot_*`` functions draw them (matplotlib, imported when drawing).
* ``pngs`` -- which plots the report has (`PLOTS`: the run's own, then each dynamism scheme's,
  `dynjax.dynamism.base.Plugin.report_plots`) and `render`, which writes them as PNGs.
* ``report_md`` -- `markdown` (report.md's text) and `write_report` (PNGs + report.md).
* ``cli`` -- `main`, the ``python -m dynjax.report`` command.

In a notebook::

    from dynjax.report import load_run, plot_layer_costs, plot_loss
    run = load_run("workdirs/run")
    plot_loss(run)                      # a new figure, or plot_loss(run, ax=my_axes)
    plot_layer_costs(run)

A scheme's own plots live beside its plugin (`Plugin.report_plots` names them).

The x axis of every plot is the optimizer step as metrics.jsonl counts it (steps done): a Plan
swapped in at loop step s (``swap_step``) first runs step s + 1, and is drawn at x = s.
"""

from dynjax.report.cli import main
from dynjax.report.key_numbers import summary
from dynjax.report.pngs import DPI, PLOTS, Plot, PlotEntry, render
from dynjax.report.report_md import markdown, write_report
from dynjax.runlog.arrays import (
    MARKS,
    Frozen,
    LayerCosts,
    StageLoad,
    event_marks,
    frozen_layers,
    layer_costs,
    plan_changes,
    plans_at,
    scheme_series,
    series,
    stage_layers,
    stage_load,
)
from dynjax.runlog.plots import (
    WIDTH,
    plot_freezing,
    plot_layer_costs,
    plot_loss,
    plot_pipeline,
    plot_scheme,
    plot_throughput,
)
from dynjax.runlog.workdir import ReportError, Run, load_run

__all__ = [
    "DPI",
    "MARKS",
    "PLOTS",
    "WIDTH",
    "Frozen",
    "LayerCosts",
    "Plot",
    "PlotEntry",
    "ReportError",
    "Run",
    "StageLoad",
    "event_marks",
    "frozen_layers",
    "layer_costs",
    "load_run",
    "main",
    "markdown",
    "plan_changes",
    "plans_at",
    "plot_freezing",
    "plot_layer_costs",
    "plot_loss",
    "plot_pipeline",
    "plot_scheme",
    "plot_throughput",
    "scheme_series",
    "render",
    "series",
    "stage_layers",
    "stage_load",
    "summary",
    "write_report",
]
