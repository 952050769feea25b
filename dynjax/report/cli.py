"""``python -m dynjax.report WORKDIR [--out DIR]``: the report of a run, ``error: ...`` (exit 2)
when the workdir cannot be read or the report cannot be written."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from dynjax.report.report_md import write_report
from dynjax.runlog.workdir import ReportError, load_run


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
