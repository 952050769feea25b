"""Early exit against the same model without it (seed 000 §2.5; CALM, Schuster et al. 2022).

Trains ``configs/early_exit.py`` for ``--steps`` steps with early exit on (the policy sizes each
layer's token bucket in the background) and with it off, from the same initialisation. Then,
for the model without exits, with exits but every bucket whole, and with the buckets the run
ended on: the compiled train step's FLOPs from ``cost_analysis()`` against the plain step's and
tokens/s (median of interleaved rounds, the machine is shared); and the share of tokens each
layer processed at the end of the run, with the final train and eval losses.

    PYTHONPATH=. python3 benchmarks/early_exit.py [--steps 300 --rounds 5] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax

from dynjax.config import load_config
from dynjax.experiment import Experiment
from dynjax.model.early_exit import NAME, PROCESSED
from dynjax.train import train
from dynjax.writers import read_jsonl


def overrides(enabled: bool, steps: int) -> list[str]:
    return [f"train.steps={steps}", "train.checkpoint_every=100000", f"train.eval_every={steps}",
            f"early_exit.enabled={enabled}"]


def final_tokens(workdir: Path, steps: int) -> tuple[int, ...] | None:
    """The token buckets of the Plan the run trained with at its end (None: never changed)."""
    swaps = [e for e in read_jsonl(workdir / "events.jsonl")
             if e["event"] == "recompile" and e.get("swap_step", steps + 1) <= steps]
    return tuple(swaps[-1]["plan"]["parts"][NAME]["tokens"]) if swaps else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/early_exit.py")
    parser.add_argument("--steps", type=int, default=300, help="training steps per setting")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds of 10 steps")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    args = parser.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for enabled in (False, True):
            workdir = Path(tmp) / str(enabled)
            cfg = load_config(args.config, [*args.set, *overrides(enabled, args.steps)])
            summary = train(cfg, workdir, progress=False)
            rows = [r for r in read_jsonl(workdir / "metrics.jsonl") if PROCESSED in r]
            runs[enabled] = (summary, final_tokens(workdir, args.steps),
                             rows[-1][PROCESSED] if rows else None)
    base, exits = (
        Experiment.from_config(load_config(args.config, [*args.set, *overrides(e, args.steps)]))
        for e in (False, True)
    )
    seq, layers = exits.settings.data.seq_len, exits.settings.model.num_layers
    whole = exits.initial_plan().with_part(NAME, active=True)
    ended = runs[True][1] or (seq,) * layers
    settings = {
        "no early exit": (base, base.initial_plan()),
        "exits, whole buckets": (exits, whole),
        "exits, final buckets": (exits, whole.with_part(NAME, tokens=ended)),
    }
    steps, flops = {}, {}
    for name, (exp, plan) in settings.items():
        compiled = exp.lower_train_step(plan).compile()
        flops[name] = compiled.cost_analysis()["flops"]
        steps[name] = (exp, exp.runtime(plan), compiled)
    rates: dict = {name: [] for name in settings}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, (exp, runtime, compiled) in steps.items():
            t0 = time.perf_counter()
            for t in range(10):
                metrics = runtime.step(compiled, exp.order.batch(r * 10 + t), None)
            jax.block_until_ready(metrics)
            if r:
                tokens = 10 * exp.settings.train.batch_size * seq
                rates[name].append(tokens / (time.perf_counter() - t0))
    base_rate = statistics.median(rates["no early exit"])
    print(f"\n{args.config}: FLOPs from cost_analysis(), tokens/s median of {args.rounds} rounds "
          f"x 10 steps ({jax.devices()[0].platform})")
    print(f"{'step':<24}{'FLOPs':>8}{'tokens/s':>11}{'speedup':>9}")
    for name in settings:
        rate = statistics.median(rates[name])
        print(f"{name:<24}{flops[name] / flops['no early exit']:>8.3f}{rate:>11,.0f}"
              f"{rate / base_rate:>8.2f}x")
    print(f"\nafter {args.steps} steps: final buckets {list(ended)} of {seq} tokens")
    print("tokens processed per layer:", [round(p, 3) for p in runs[True][2]])
    for enabled, label in ((False, "no early exit"), (True, "early exit")):
        summary = runs[enabled][0]
        print(f"{label:<14} train loss {summary.final_loss:.4f}  eval loss {summary.eval_loss:.4f}")


if __name__ == "__main__":
    main()
