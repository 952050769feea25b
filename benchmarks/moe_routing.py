"""Routing variants (issue 12 §2) on `configs/moe.py` shrunk, CPU, one run each in this process.

Trains the same model and data three ways, the balance loss off in all (``moe.aux_loss_weight=0``):
token choice (the baseline), token choice with auxiliary-loss-free bias balancing
(DeepSeek-V3 §2.1.2) and expert choice (Zhou et al. 2022). Prints, over the second half of the
steps (medians of the logged steps): the fraction of (token, choice) pairs dropped, the busiest
expert's load over the mean (max/mean, per MoE layer, then the mean over layers), the tokens no
expert computed, and the training loss; ratios against token choice.

    PYTHONPATH=. python benchmarks/moe_routing.py [--steps 120] [--rates 1e-3,1e-2]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
from pathlib import Path

import numpy as np

from dynjax.train import train
from dynjax.writers import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def moe_config(steps: int):
    """`configs/moe.py` with a smaller model, batch and run (CPU, 2 shared cores)."""
    spec = importlib.util.spec_from_file_location("moe_config", ROOT / "configs" / "moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.data.path = str(ROOT / "tests" / "data" / "corpus.txt")
    c.data.seq_len = 64
    c.data.max_tokens = 200_000
    c.model.d_model = 64
    c.model.mlp_dim = 128
    c.moe.expert_mlp_dim = 128
    c.moe.aux_loss_weight = 0.0
    c.train.batch_size = 8
    c.train.steps = steps
    c.train.warmup_steps = steps // 10
    c.train.log_every = 1
    c.train.eval_every = 10 * steps
    c.train.checkpoint_every = 10 * steps
    return c


def variants(steps: int, rates: list[float]) -> dict:
    out = {"token choice": moe_config(steps)}
    for rate in rates:
        biased = moe_config(steps)
        biased.moe.bias_balancing.enabled = True
        biased.moe.bias_balancing.rate = rate
        out[f"token choice + bias (rate {rate:g})"] = biased
    expert = moe_config(steps)
    expert.moe.routing = "expert_choice"
    out["expert choice"] = expert
    return out


def summary(workdir: Path) -> dict[str, float]:
    rows = [r for r in read_jsonl(workdir / "metrics.jsonl") if "loss" in r]
    late = rows[len(rows) // 2 :]
    imbalance = [
        float(np.mean([max(layer) / np.mean(layer) for layer in r["tokens_per_expert"]]))
        for r in late
    ]
    return {
        "dropped": statistics.median(r["dropped_fraction"] for r in late),
        "max/mean load": statistics.median(imbalance),
        "unrouted": statistics.median(float(np.mean(r["moe/unrouted"])) for r in late),
        "loss": statistics.median(r["loss"] for r in late),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--rates", default="1e-3,1e-2", help="bias balancing rates, comma-separated")
    args = ap.parse_args()
    results, rates = {}, [float(r) for r in args.rates.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, cfg) in enumerate(variants(args.steps, rates).items()):
            workdir = Path(tmp) / str(i)
            train(cfg, workdir, progress=False)
            results[name] = summary(workdir)
    base = next(iter(results.values()))
    tokens = 8 * 64  # batch x seq: the tokens of a step, per MoE layer
    print(f"configs/moe.py shrunk (d=64, seq 64, batch 8, 8 experts, top-2, factor 1.25, "
          f"aux loss off), {args.steps} steps, CPU; medians over the second half of the steps")
    print("| routing | dropped pairs | max/mean expert load | unrouted tokens per layer | loss |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        ratio = lambda k, r=r: f" ({r[k] / base[k]:.2f}x)" if r is not base and base[k] else ""
        print(
            f"| {name} | {r['dropped']:.4f}{ratio('dropped')} | "
            f"{r['max/mean load']:.3f}{ratio('max/mean load')} | "
            f"{r['unrouted']:.1f} of {tokens} | {r['loss']:.4f}{ratio('loss')} |"
        )


if __name__ == "__main__":
    main()
