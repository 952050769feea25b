"""Run report: PNG plots and a short ``report.md`` of what a run wrote to its workdir
(docs/running.md "Run report": the files, each plot, the notebook functions).

    python -m dynjax.report WORKDIR [--out DIR]     # DIR defaults to WORKDIR/report

Reading the workdir, its arrays and their drawing live in `dynjax.runlog` (re-exported here);
this package adds which plots the report has (``pngs``: `PLOTS`, the run's own and each
scheme's `Plugin.report_plots`), the key numbers (``key_numbers``), report.md (``report_md``)
and the command (``cli``). The x axis of every plot is the optimizer step as metrics.jsonl
counts it: a Plan swapped in at loop step s (``swap_step``) first runs step s + 1 and is drawn
at x = s.
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
