"""Layer freezing, then re-packing (seed 000 §3.4, §4.2.3), on the real pipeline runtime.

Two runs of the same model and data on a (stage, data) = (4, 2) mesh with 8 layers (2 per stage;
``--layers``):
a policy freezes the first half of the layers once metrics step ``--freeze-at`` is seen (a frozen
prefix runs no backward), and in the second run the `Repack` policy, with its default
``balance.repack_max_slowdown = 0``, may then merge stages whose merging the simulator says costs
no step time; the freed sub-meshes are released. Per phase the table gives the stages and devices
in use, the median measured tokens/s, tokens/s per device, and the profiled iteration time of the
phase's layout with its device-seconds (iteration x devices), measured and as the simulator
predicts. Learning must not change: the losses of both runs are compared.

On a CPU the 8 fake devices share the machine's cores, so a stage's devices do not run in parallel
with another stage's and the measured times say nothing about a GPU cluster; per-device figures
are what re-packing is for (seed 000 Fig. 4: throughput / number of GPUs).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. \\
        python3 benchmarks/repack_freezing.py [--steps 160] [--freeze-at 30] [--workdir DIR] \\
        [--layers 8] [--microbatches 8]

``--layers 4 --microbatches 4 --steps 12 --freeze-at 2`` runs the code on a smaller pipeline (a
layer per stage, 4 microbatches), for a smoke test: the re-pack is decided at metrics step 10,
after the freeze's swap, and its Plan lands after the last step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from dynjax.config import load_config
from dynjax.recompile import Plan
from dynjax.recompile.rebalance import layer_times, predict_seconds
from dynjax.train import train
from dynjax.writers import read_jsonl

LAYERS, STAGES, DATA = 8, 4, 2


class FreezePrefix:
    """Freezes layers 0 .. n-1 once metrics of step ``at`` were seen (a stand-in for the
    freezing plugin: DynMo's layer-freezing case, seed 000 §4.2.3)."""

    name = "freeze"

    def __init__(self, at: int, layers: int) -> None:
        self.at, self.frozen = at, tuple(range(layers))

    def propose(self, history, plan: Plan) -> Plan | None:
        if history.latest_step is not None and history.latest_step >= self.at:
            if plan.frozen_layers != self.frozen:
                return plan.replace(frozen_layers=self.frozen)
        return None


def run(workdir: Path, args: argparse.Namespace, repack: bool) -> list[dict]:
    steps = args.steps
    overrides = [
        f"model.num_layers={args.layers}",
        f"mesh.stage={STAGES}",
        f"mesh.data={DATA}",
        f"train.steps={steps}",
        "train.log_every=1",
        f"train.eval_every={steps}",
        f"train.checkpoint_every={steps}",
        "recompile.delta_launch=1",
        *([f"train.microbatches={args.microbatches}"] if args.microbatches else []),
    ]
    if repack:
        overrides += ["balance.repack=True", "balance.repack_every=10", "balance.memory_bytes=8e9"]
    cfg = load_config("configs/quickstart.py", overrides)
    train(cfg, workdir, policies=[FreezePrefix(args.freeze_at, args.layers // 2)], progress=False)
    return read_jsonl(workdir / "events.jsonl")


def phases(workdir: Path, events: list[dict], steps: int, micro: int) -> list[dict]:
    """One row per Plan the run trained with: its steps, stages, throughput and profile."""
    swaps = [e for e in events if e["event"] == "recompile"]
    bounds = [0] + [e["swap_step"] for e in swaps] + [steps]
    plans = [next(e for e in events if e["event"] == "compile")["plan"]]
    plans += [e["plan"] for e in swaps]
    rates = {
        r["step"]: r["tokens_per_sec"] for r in read_jsonl(workdir / "metrics.jsonl")
        if "tokens_per_sec" in r
    }
    profiles = {e["step"]: e for e in events if e["event"] == "profile"}
    rows = []
    for (start, end), plan in zip(zip(bounds, bounds[1:], strict=False), plans, strict=True):
        # Skip the profiled first step of each phase and the step after it (its rate covers it).
        window = [rates[s] for s in range(start + 3, end + 1) if s in rates]
        counts = plan["stage_layers"]
        profile = profiles.get(start)
        devices = len(counts) * DATA
        row = {
            "steps": f"{start}-{end}",
            "layout": counts,
            "frozen": len(plan["frozen_layers"]),
            "devices": devices,
            "tok_s": statistics.median(window) if window else float("nan"),
        }
        if profile is not None and profile["iteration_seconds"] is not None:  # None: untimed
            metrics = {
                "profile/layer_forward_seconds": profile["layer_forward_seconds"],
                "profile/layer_backward_seconds": profile["layer_backward_seconds"],
                "profile/embed_seconds": profile["embed_seconds"],
                "profile/head_seconds": profile["head_seconds"],
            }
            fwd, bwd = layer_times(metrics)
            predicted = predict_seconds(fwd, bwd, counts, Plan(microbatches=micro), 0.0)
            row["iteration"] = profile["iteration_seconds"]
            row["predicted"] = predicted
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--freeze-at", type=int, default=30)
    parser.add_argument("--workdir", type=Path, help="keep the runs here (default: a temp dir)")
    parser.add_argument("--layers", type=int, default=LAYERS, help="layers (the first half freeze)")
    parser.add_argument(
        "--microbatches", type=int, help="1F1B microbatches (default: twice the stages)"
    )
    args = parser.parse_args()
    micro = args.microbatches or 2 * STAGES  # train.microbatches = 0: twice the stages
    root = args.workdir or Path(tempfile.mkdtemp(prefix="repack_freezing_"))
    results = {}
    for name, repack in (("freeze only", False), ("freeze + re-pack", True)):
        workdir = root / name.replace(" ", "_").replace("+", "and")
        events = run(workdir, args, repack)
        results[name] = (workdir, phases(workdir, events, args.steps, micro), events)
    print(f"{args.layers} layers of configs/quickstart.py on a ({STAGES}, {DATA}) mesh, "
          f"M = {micro} 1F1B microbatches; first {args.layers // 2} layers frozen from metrics "
          f"step {args.freeze_at}. Workdirs under {root}.")
    header = (f"{'run':<17}{'steps':>9} {'layout':<14}{'frozen':>7}{'devices':>8}{'tok/s':>9}"
              f"{'tok/s/dev':>10}{'iter s':>8}{'dev-s':>7}{'pred s':>8}{'pred dev-s':>11}")
    print(header)
    print("-" * len(header))
    for name, (_, rows, _) in results.items():
        for r in rows:
            measured = (f"{r['iteration']:>8.3f}{r['iteration'] * r['devices']:>7.2f}"
                        f"{r['predicted']:>8.3f}{r['predicted'] * r['devices']:>11.3f}"
                        if "iteration" in r else f"{'-':>8}{'-':>7}{'-':>8}{'-':>11}")
            print(f"{name:<17}{r['steps']:>9} {str(tuple(r['layout'])):<14}{r['frozen']:>7}"
                  f"{r['devices']:>8}{r['tok_s']:>9.0f}{r['tok_s'] / r['devices']:>10.0f}"
                  + measured)
    for name, (workdir, _, _) in results.items():
        losses = [r["loss"] for r in read_jsonl(workdir / "metrics.jsonl") if "loss" in r]
        print(f"{name}: final train loss {losses[-1]:.4f}")
    for name, (_, _, events) in results.items():
        for e in events:
            if e["event"] == "release":
                print(f"{name}: released stage sub-meshes {e['stages']} at step {e['step']} "
                      f"(devices {[d['id'] for d in e['devices']]})")
            if e["event"] == "repack" and e["accepted"]:
                print(f"{name}: repack at metrics step {e['metrics_step']}: {e['old']} -> "
                      f"{e['new']}, predicted {e['predicted_old_seconds']:.4f} -> "
                      f"{e['predicted_new_seconds']:.4f} s, memory per stage "
                      f"{[round(m / 1e6, 1) for m in e['predicted_stage_memory_bytes']]} MB")


if __name__ == "__main__":
    main()
