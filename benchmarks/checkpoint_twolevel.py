"""What checkpointing costs the training loop (seed 004 §3, §5.1-§5.2, issue 13): per step and per
checkpoint, in the loop, for

- ``none``: no checkpoint until the last step;
- ``full_sync``: full checkpoints to storage every ``--every`` steps, Orbax synchronous (the
  save returns once written);
- ``full_async``: the same, Orbax asynchronous (the save returns once the arrays are copied to
  host, and is written in the background);
- ``pec_async``: partial expert checkpoints (K = 1) to storage every ``--every`` steps, Orbax
  asynchronous (one level, seed 004 §3);
- ``two_level``: an in-memory snapshot every step (K_snapshot = ``--snapshot-experts``) and a
  persist of its K_persist = 1 freshest experts every ``--every`` steps (two levels, §5.1).

The model: ``--layers`` layers, MoE every other one, 16 experts, on the local devices. Each mode
trains ``--steps`` steps in a fresh workdir (the compilation cache warm after the first run),
``--repeats`` times, modes interleaved. Per run the seconds per step come from the logged
``tokens_per_sec`` of the steps after ``--every`` + 1 (the loop runs ahead of the device, so a
step's time is the wall time between its metrics and the previous step's): before, the warm-up
and the first storage save, which writes every expert in every mode (PEC and persists need a
first copy of each). The window holds the saves of steps 2 x ``--every``, 3 x ``--every``, ...
before the last step (the last step's save comes after the last step's time). Per run: the
median step and the mean step (the mean includes the steps that persist or save, which the
median hides); printed are the medians over repeats, and the ratio of each to ``none``
measured in the same run. The overhead per checkpoint is what the loop loses to checkpointing
per storage save or persist: (mean step - ``none``'s mean step) x window steps / saves in the
window, and its ratio
to ``full_sync``'s is seed 004's "checkpointing overhead" comparison (-98.9% for MoC-Async, §6);
it includes what background writes take from the training on a shared CPU, and it is the
difference of two noisy means. The stall is the part spent inside the loop's checkpoint calls,
per storage save: its ``blocking_seconds`` (``checkpoint`` events, the window's) plus
``--every`` snapshot calls' ``stall_seconds`` (``snapshot`` events: the device copy dispatch and
any wait for the previous fill); printed with its ratio to ``full_sync``'s, and each part's
median.

    PYTHONPATH=. python3 benchmarks/checkpoint_twolevel.py [--steps 30 --every 10 --repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from pathlib import Path

from dynjax.config import default_config
from dynjax.train import train
from dynjax.writers import read_jsonl

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "corpus.txt"


def config(args: argparse.Namespace, mode: str):
    c = default_config()
    c.data.path = str(CORPUS)
    c.data.seq_len, c.data.max_tokens = 64, 200_000
    c.train.steps, c.train.batch_size, c.train.log_every = args.steps, 8, 1
    c.train.eval_every, c.train.warmup_steps = 10**6, 2
    c.model.num_layers, c.model.d_model, c.model.num_heads = args.layers, 128, 4
    c.model.mlp_dim = 256
    c.moe.every, c.moe.num_experts, c.moe.top_k = 2, 16, 2
    c.checkpoint.async_save = True
    c.train.checkpoint_every = args.steps  # none: only the last step
    if mode in ("full_sync", "full_async"):
        c.train.checkpoint_every, c.checkpoint.async_save = args.every, mode == "full_async"
    elif mode == "pec_async":
        c.train.checkpoint_every, c.checkpoint.experts_per_save = args.every, 1
    elif mode == "two_level":
        c.checkpoint.snapshot_every, c.checkpoint.persist_every = 1, args.every
        c.checkpoint.snapshot_experts, c.checkpoint.persist_experts = args.snapshot_experts, 1
    return c


def run(args: argparse.Namespace, mode: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config(args, mode)
        train(cfg, tmp, progress=False)
        tokens = cfg.train.batch_size * cfg.data.seq_len
        rows = read_jsonl(Path(tmp) / "metrics.jsonl")
        seconds = [
            tokens / r["tokens_per_sec"]
            for r in rows
            if "tokens_per_sec" in r and r["step"] > args.every + 1
        ]
        events = read_jsonl(Path(tmp) / "events.jsonl")
        snaps = [
            e["stall_seconds"]
            for e in events
            if e["event"] == "snapshot" and e["step"] > args.every
        ]
        saves = [
            e["blocking_seconds"]
            for e in events
            if e["event"] == "checkpoint" and args.every < e["step"] < args.steps
        ]
    return {
        "median_step": statistics.median(seconds),
        "mean_step": statistics.fmean(seconds),
        "snapshot_stall": statistics.median(snaps) if snaps else 0.0,
        "save_blocking": statistics.median(saves) if saves else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--snapshot-experts", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("absl").setLevel(logging.ERROR)
    modes = ("none", "full_sync", "full_async", "pec_async", "two_level")
    run(args, "two_level")  # warm the compilation cache
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode in modes:
            results[mode].append(run(args, mode))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
    base = med["none"]
    window = args.steps - args.every - 1
    saves = len(range(2 * args.every, args.steps, args.every))
    overhead = {m: (r["mean_step"] - base["mean_step"]) * window / saves for m, r in med.items()}
    stall = {m: r["save_blocking"] + args.every * r["snapshot_stall"] for m, r in med.items()}
    print(
        f"{args.layers} layers, MoE every 2nd of 16 experts, {args.steps} steps, storage every "
        f"{args.every} (full, or K = 1 for pec_async and two_level's persist), snapshot every "
        f"step of {args.snapshot_experts} experts/layer, medians of {args.repeats}"
    )
    print(
        f"{'mode':<10} {'median s/step':>13} {'/ none':>6} {'mean s/step':>11} {'/ none':>6} "
        f"{'overhead s/ckpt':>15} {'/ full_sync':>11} {'stall s/ckpt':>12} {'/ full_sync':>11} "
        f"{'save blocking s':>15} {'snapshot stall s':>16}"
    )
    for m in modes:
        r = med[m]
        print(
            f"{m:<10} {r['median_step']:>13.4f} {r['median_step'] / base['median_step']:>6.2f} "
            f"{r['mean_step']:>11.4f} {r['mean_step'] / base['mean_step']:>6.2f} "
            f"{overhead[m]:>15.4f} {overhead[m] / overhead['full_sync']:>11.3f} "
            f"{stall[m]:>12.4f} {stall[m] / stall['full_sync']:>11.3f} "
            f"{r['save_blocking']:>15.4f} {r['snapshot_stall']:>16.4f}"
        )


if __name__ == "__main__":
    main()
