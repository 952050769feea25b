"""Per-step losses of every config in `configs/`, single program and 2-stage pipeline.

A refactor that keeps every behaviour keeps these curves: record them before the change
(`--record FILE`), then compare the changed code against the record (`--check FILE`), within a
relative tolerance, reporting which runs are bitwise equal. Each run is a fresh
`python -m dynjax.train` process with the tests' XLA flags (8 fake CPU devices, LLVM's
optimizations off), so a record and a check made on the same jax compare like with like.

    python benchmarks/config_losses.py --record benchmarks/results/config_losses.json
    python benchmarks/config_losses.py --check benchmarks/results/config_losses.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
XLA_FLAGS = (
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true"
)
MODES = {"single": [], "pipeline": ["--config.mesh.stage=2"]}
# Each config's dynamism brought inside the short run: its first decisions within 40 steps.
OVERRIDES = {
    "early_exit": ["--config.early_exit.start_step=10"],
    "freezing": ["--config.freezing.start_step=10", "--config.freezing.every=5"],
    "moe": ["--config.moe.capacity.policy=dynamic", "--config.moe.capacity.window=5"],
    "pruning": [
        "--config.pruning.start_step=10", "--config.pruning.every=10", "--config.pruning.steps=2"
    ],
}


def run(config: pathlib.Path, mode: str, steps: int) -> dict:
    """One training run's per-step losses and gradient norms, or the error that refused it."""
    with tempfile.TemporaryDirectory() as workdir:
        cmd = [
            sys.executable, "-m", "dynjax.train", "--config", str(config),
            f"--config.train.steps={steps}", "--config.train.log_every=1",
            "--config.train.checkpoint_every=100000", "--workdir", workdir,
            *MODES[mode], *OVERRIDES.get(config.stem, []),
        ]  # fmt: skip
        env = {**os.environ, "XLA_FLAGS": XLA_FLAGS, "JAX_PLATFORMS": "cpu"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
        records = [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")]
        events = [json.loads(line) for line in open(f"{workdir}/events.jsonl")]
    records = [r for r in records if "loss" in r]
    return {
        "loss": [r["loss"] for r in records],
        "grad_norm": [r.get("grad_norm") for r in records],
        # Plans swap in when their background compile is ready, so a dynamic run's curve is
        # only comparable where its swaps landed at the same steps.
        "swap_steps": [e["swap_step"] for e in events if e.get("event") == "recompile"],
        "events": sorted({e.get("event", "?") for e in events}),
    }


def record(steps: int, names: list[str]) -> dict:
    out = {"steps": steps, "runs": {}}
    for config in sorted((ROOT / "configs").glob("*.py")):
        if names and config.stem not in names:
            continue
        for mode in MODES:
            result = run(config, mode, steps)
            out["runs"][f"{config.stem}/{mode}"] = result
            print(f"{config.stem:18s} {mode:9s} {_brief(result)}", flush=True)
    return out


def _brief(result: dict) -> str:
    if "error" in result:
        return f"refused: {result['error'][:100]}"
    return (
        f"{len(result['loss'])} steps, last loss {result['loss'][-1]:.6f}, "
        f"swaps at {result['swap_steps']}, events {result['events']}"
    )


def compare(reference: dict, current: dict, rtol: float) -> int:
    """Print one line per run; return the number of runs that differ beyond ``rtol``."""
    bad = 0
    for key, ref in reference["runs"].items():
        cur = current["runs"].get(key)
        if cur is None:
            continue
        if "error" in ref or "error" in cur:
            same = ref.get("error") == cur.get("error")
            verdict = "same refusal" if same else f"DIFFERS: {ref} vs {cur}"
        else:
            pairs = [
                (a, b)
                for field in ("loss", "grad_norm")
                for a, b in zip(ref[field], cur[field], strict=True)
                if a is not None
            ]
            worst = max(abs(a - b) / max(abs(a), 1e-30) for a, b in pairs)
            same = worst <= rtol
            verdict = "bitwise" if worst == 0 else f"max rel diff {worst:.2e}"
            if not same and ref["swap_steps"] != cur["swap_steps"]:
                same = True  # not comparable: another compile time moved a swap
                first = min(ref["swap_steps"][:1] + cur["swap_steps"][:1])
                before = _equal_steps(ref["loss"][: first - 1], cur["loss"][: first - 1])
                verdict = (
                    f"swaps moved {ref['swap_steps']} -> {cur['swap_steps']}; before the first, "
                    f"{before}"
                )
            elif not same:
                verdict = "DIFFERS: " + verdict
        bad += not same
        print(f"{key:28s} {verdict}")
    return bad


def _equal_steps(ref: list[float], cur: list[float]) -> str:
    """How the two curves compare over the steps both ran with the same Plans."""
    worst = max((abs(a - b) / max(abs(a), 1e-30) for a, b in zip(ref, cur, strict=True)), default=0)
    return f"steps 1-{len(ref)} " + ("bitwise" if worst == 0 else f"max rel diff {worst:.2e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", type=pathlib.Path)
    ap.add_argument("--check", type=pathlib.Path)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rtol", type=float, default=1e-6)
    ap.add_argument("--configs", default="", help="comma-separated config names (default all)")
    args = ap.parse_args()
    names = [n for n in args.configs.split(",") if n]
    if args.record:
        args.record.write_text(json.dumps(record(args.steps, names), indent=1) + "\n")
        return 0
    if args.check:
        reference = json.loads(args.check.read_text())
        current = record(reference["steps"], names)
        bad = compare(reference, current, args.rtol)
        print(f"{bad} run(s) differ beyond rtol {args.rtol}")
        return 1 if bad else 0
    ap.error("give --record FILE or --check FILE")
    return 2


if __name__ == "__main__":
    sys.exit(main())
