"""The report's key numbers of a `Run` as plain data: losses, throughput, compiles and
recompiles, checkpoints and the controller's decisions."""

from __future__ import annotations

from typing import Any

import numpy as np

from dynjax.runlog.arrays import is_number, series
from dynjax.runlog.workdir import Run


def _median(values: np.ndarray) -> float | None:
    return float(np.median(values)) if values.size else None


def summary(run: Run) -> dict[str, Any]:
    """The report's key numbers as plain data (None where the run has no such data)."""
    loss_steps, loss = series(run.metrics, "loss")
    _, eval_loss = series(run.metrics, "eval_loss")
    _, rate = series(run.metrics, "tokens_per_sec")
    _, util = series(run.metrics, "mfu")
    all_steps = [int(r["step"]) for r in run.metrics if is_number(r.get("step"))]
    compiles = run.events_of("compile")
    recompiles = run.events_of("recompile")
    decisions = run.events_of("rebalance")
    repacks = run.events_of("repack")
    migrations = run.events_of("migrate")
    saved = sorted(
        {int(e["step"]) for e in run.events_of("checkpoint") if is_number(e.get("step"))}
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
                if is_number(r.get("model_flops_per_token"))
            ),
            None,
        ),
        "compile_seconds": [
            float(e["compile_seconds"]) for e in compiles if is_number(e.get("compile_seconds"))
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
