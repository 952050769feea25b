"""report.md: the key numbers, the recompiles, the processes and each plot (or why it is
missing), and `write_report`, which writes it with its PNGs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynjax.report.key_numbers import summary
from dynjax.report.pngs import PLOTS, Plot, render
from dynjax.runlog.workdir import Run, load_run


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
