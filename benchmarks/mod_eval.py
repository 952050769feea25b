"""Mixture of depths evaluated causally against top-k (Raposo et al. §3.5; seed 000 §2.6).

Trains ``configs/mod.py`` once (``dynjax.train``, checkpoints every ``--every`` steps), then
evaluates each checkpoint's parameters on the run's validation batches twice: routing by the
causal predictor (``mod.eval_routing="predictor"``, what sampling can do and what the run's
``eval_loss`` reports) and by the sequence's top-k (``"topk"``, the training's routing, which
looks ahead). Beside them: the predictors' accuracy at that step (metrics.jsonl; always saying
"skipped" scores 1 - capacity) and the fraction of tokens each routed layer computed at
evaluation under the predictor (the top-k computes exactly the capacity).

    PYTHONPATH=. python3 benchmarks/mod_eval.py [--steps 300 --every 100] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import jax
import numpy as np

from dynjax.checkpoint import Checkpointer
from dynjax.config import load_config
from dynjax.dynamism.moe.checkpoint import EXPERT_STACKS
from dynjax.experiment import Experiment
from dynjax.model.mod import ACCURACY, ROUTED
from dynjax.parallel.stage import forward_loss
from dynjax.train import train
from dynjax.writers import read_jsonl

ROUTINGS = ("predictor", "topk")


def routed_fraction(exp: Experiment, params) -> np.ndarray:
    """[routed layers] mean fraction of tokens each computed over the validation batches, the
    forward run as at evaluation."""
    plan = exp.initial_plan()
    spec = dataclasses.replace(exp.step_spec(plan), inference=True)
    fractions = [
        forward_loss(
            exp.stage_setup, spec, None, params, b.inputs, {"targets": b.targets}, None
        )[3][ROUTED]
        for b in exp.val_batches
    ]
    return np.mean(jax.device_get(fractions), axis=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/mod.py")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=100, help="checkpoint and evaluate every")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    args = parser.parse_args()
    base = [*args.set, f"train.steps={args.steps}", f"train.checkpoint_every={args.every}",
            f"train.eval_every={args.every}", f"train.keep_checkpoints={args.steps // args.every}"]
    exps = {r: Experiment.from_config(load_config(args.config, [*base, f"mod.eval_routing={r}"]))
            for r in ROUTINGS}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        summary = train(exps["predictor"].cfg, workdir, progress=False)
        accuracy = {r["step"]: r[ACCURACY] for r in read_jsonl(workdir / "metrics.jsonl")
                    if ACCURACY in r}
        checkpoints = Checkpointer(workdir / "checkpoints", stacks=EXPERT_STACKS,
                                   keep=len(summary.checkpoints), async_save=False)
        for step in summary.checkpoints:
            host_state, _ = checkpoints.restore(step, exps["predictor"].abstract_state)
            losses = {}
            for routing, exp in exps.items():
                state = exp.place_state(host_state)
                params, plan = state["params"], exp.initial_plan()
                losses[routing] = exp.runtime(plan, state).evaluate(plan)
            fraction = routed_fraction(exps["predictor"], params)
            logged = max(s for s in accuracy if s <= step)  # the last logged by then
            rows.append((step, accuracy[logged], fraction, losses))
        checkpoints.close()
    capacity = exps["predictor"].cfg.mod.capacity
    print(f"\n{args.config}: eval loss over {len(exps['predictor'].val_batches)} validation "
          f"batches, capacity {capacity:g}; run's eval_loss at the end {summary.eval_loss:.4f}")
    print(f"{'step':>5}  {'predictor accuracy':<26}{'routed at eval (predictor)':<30}"
          f"{'eval predictor':>15}{'eval top-k':>12}{'gap':>8}")
    for step, acc, fraction, losses in rows:
        gap = losses["predictor"] - losses["topk"]
        acc_s = " ".join(f"{a:.3f}" for a in acc)
        frac_s = " ".join(f"{f:.3f}" for f in fraction)
        print(f"{step:>5}  {acc_s:<26}{frac_s:<30}{losses['predictor']:>15.4f}"
              f"{losses['topk']:>12.4f}{gap:>+8.4f}")


if __name__ == "__main__":
    main()
