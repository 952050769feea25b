"""Mixture of depths against the same model without it (seed 000 §2.6; Raposo et al. 2024 report
upwards of 50% faster steps at equal parameters).

For ``configs/mod.py`` (8 layers, every other block routed) at capacity 1 (no MoD: the plugin
off), 0.5 and 0.125: the compiled train step's FLOPs from ``cost_analysis()`` against the dense
step's, tokens/s of the step (median over interleaved rounds, the machine is shared) and the
train and eval loss after ``--steps`` steps of training each from the same initialisation.

    PYTHONPATH=. python3 benchmarks/mod.py [--steps 150 --rounds 3] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax

from dynjax.config import load_config
from dynjax.experiment import Experiment
from dynjax.train import train

CAPACITIES = (None, 0.5, 0.125)  # None: the plugin off


def overrides(capacity: float | None, steps: int) -> list[str]:
    out = [f"train.steps={steps}", "train.checkpoint_every=100000", f"train.eval_every={steps}"]
    if capacity is None:
        return out + ["mod.enabled=False"]
    return out + [f"mod.capacity={capacity}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/mod.py")
    parser.add_argument("--steps", type=int, default=150, help="training steps per setting")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds of 10 steps")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    args = parser.parse_args()
    steps: dict = {}
    flops: dict = {}
    for capacity in CAPACITIES:
        cfg = load_config(args.config, [*args.set, *overrides(capacity, args.steps)])
        exp = Experiment.from_config(cfg)
        plan = exp.initial_plan()
        compiled = exp.lower_train_step(plan).compile()
        flops[capacity] = compiled.cost_analysis()["flops"]
        steps[capacity] = (exp, exp.runtime(plan), compiled)
    rates: dict = {c: [] for c in CAPACITIES}
    for r in range(args.rounds + 1):  # round 0 warms up
        for capacity, (exp, runtime, compiled) in steps.items():
            t0 = time.perf_counter()
            for t in range(10):
                metrics = runtime.step(compiled, exp.order.batch(r * 10 + t), None)
            jax.block_until_ready(metrics)
            if r:
                tokens = 10 * exp.settings.train.batch_size * exp.settings.data.seq_len
                rates[capacity].append(tokens / (time.perf_counter() - t0))
    losses = {}
    for capacity in CAPACITIES:
        cfg = load_config(args.config, [*args.set, *overrides(capacity, args.steps)])
        with tempfile.TemporaryDirectory() as workdir:
            summary = train(cfg, workdir, progress=False)
        losses[capacity] = (summary.final_loss, summary.eval_loss)
    base_rate = statistics.median(rates[None])
    print(f"\n{args.config}: FLOPs from cost_analysis(), tokens/s median of {args.rounds} rounds x "
          f"10 steps ({jax.devices()[0].platform}), loss after {args.steps} steps")
    print(f"{'capacity':<14}{'FLOPs':>8}{'tokens/s':>11}{'speedup':>9}{'train loss':>12}"
          f"{'eval loss':>11}")
    for capacity in CAPACITIES:
        rate = statistics.median(rates[capacity])
        name = "1 (no MoD)" if capacity is None else f"{capacity:g}"
        print(f"{name:<14}{flops[capacity] / flops[None]:>8.3f}{rate:>11,.0f}"
              f"{rate / base_rate:>8.2f}x{losses[capacity][0]:>12.4f}{losses[capacity][1]:>11.4f}")


if __name__ == "__main__":
    main()
