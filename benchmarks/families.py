"""Training tokens/s of the Llama family against GPT at equal parameter count (issue 30).

GPT is ``--gpt-config`` (default the quickstart model); the Llama side is ``--llama-config``
(default configs/llama_tiny.py made dense: no MoE layers, no shared expert) at GPT's width, depth
and heads, keeping its grouped-query attention, with its SwiGLU width (``model.mlp_dim``) chosen
so that the two parameter counts are as close as one unit of that width allows (`matched`). Both
run the per-step work of ``dynjax.train`` (step_throughput.py's `dynjax_loop`) on the same
batches in one process; rounds alternate GPT, Llama, GPT, ... and the table reports medians
(the machine is shared and noisy). FLOPs per token (`dynjax.flops`) are printed beside: at equal
parameters a SwiGLU MLP does the same matmul work as a GELU one, so a ratio far from 1 is the
step's other work (norms, biases, attention's grouped keys).

    python benchmarks/families.py [--steps 20] [--rounds 3] [--set model.num_layers=2 ...]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
from step_throughput import dynjax_loop

from dynjax.config import gpt_config, load_config
from dynjax.experiment import Experiment
from dynjax.flops import config_flops_per_token
from dynjax.model.gpt import abstract_params

DENSE = ("moe.every=0", "moe.shared_expert_dim=0")  # llama_tiny.py without its MoE layers
SHAPE = ("model.d_model", "model.num_layers", "model.num_heads", "data.seq_len",
         "train.batch_size", "model.vocab_size")  # what the Llama side takes from GPT's config


def param_count(cfg: ml_collections.ConfigDict) -> int:
    """The model's parameters, counted from their shapes (nothing is initialised)."""
    model = gpt_config(cfg)
    shapes = abstract_params(model)
    return sum(math.prod(a.shape) for a in jax.tree.leaves(shapes))


def matched(gpt: ml_collections.ConfigDict, llama: ml_collections.ConfigDict) -> int:
    """``llama``'s ``model.mlp_dim`` (set on it) that brings its parameter count closest to
    ``gpt``'s: the count is linear in that width, so two counts give the slope."""
    target = param_count(gpt)
    llama.model.mlp_dim = 1
    one = param_count(llama)
    llama.model.mlp_dim = 2
    slope = param_count(llama) - one
    llama.model.mlp_dim = max(1, round(1 + (target - one) / slope))
    return llama.model.mlp_dim


def configs(gpt_path: str, llama_path: str, overrides: Sequence[str]
            ) -> dict[str, ml_collections.ConfigDict]:
    """GPT's config and the Llama config at its shape and parameter count."""
    gpt = load_config(gpt_path, overrides)
    llama = load_config(llama_path, [*DENSE, *overrides])
    for key in SHAPE:
        section, name = key.split(".")
        llama[section][name] = gpt[section][name]
    if gpt.model.num_heads % max(llama.model.num_kv_heads, 1):
        llama.model.num_kv_heads = 0  # GPT's heads do not group: multi-head attention
    matched(gpt, llama)
    return {"gpt": gpt, "llama": llama}


def model_diff(base: ml_collections.ConfigDict, other: ml_collections.ConfigDict) -> list[str]:
    """``other``'s ``model`` keys that differ from ``base``'s, as ``--config.`` overrides (what
    a ``dynjax.train`` run of ``base`` needs to train ``other``'s model: gpu_suite.py's)."""
    return [f"model.{key}={value if isinstance(value, str) else repr(value)}"
            for key, value in other.model.items() if value != base.model[key]]


def describe(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    m = cfg.model
    return {"params": param_count(cfg), "d_model": m.d_model, "layers": m.num_layers,
            "heads": m.num_heads, "kv_heads": m.num_kv_heads or m.num_heads,
            "mlp_dim": m.mlp_dim, "flops_per_token": config_flops_per_token(cfg)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpt-config", default="configs/quickstart.py")
    parser.add_argument("--llama-config", default="configs/llama_tiny.py")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for both sides, e.g. model.num_layers=2")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    cfgs = configs(args.gpt_config, args.llama_config, args.set)
    facts = {name: describe(cfg) for name, cfg in cfgs.items()}
    loops, controllers, tokens = {}, [], 0
    for name, cfg in cfgs.items():
        exp = Experiment.from_config(cfg)
        loops[name], controller = dynjax_loop(exp, exp.initial_plan())
        controllers.append(controller)
        loops[name](3, 0)  # compile and warm up
        tokens = args.steps * exp.settings.train.batch_size * exp.settings.data.seq_len
    rates: dict[str, list[float]] = {name: [] for name in cfgs}
    for r in range(args.rounds):
        for name, run in loops.items():
            rates[name].append(tokens / run(args.steps, 3 + r * args.steps))
    for controller in controllers:
        controller.stop()
    ratios = [ll / g for ll, g in zip(rates["llama"], rates["gpt"], strict=True)]
    gap = facts["llama"]["params"] / facts["gpt"]["params"] - 1
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}, jax {jax.__version__}; "
          f"median of {args.rounds} interleaved rounds x {args.steps} steps, "
          f"{cfgs['gpt'].train.batch_size} x {cfgs['gpt'].data.seq_len} tokens a step")
    print(f"{'family':<8}{'params':>12}{'d_model':>9}{'layers':>8}{'heads':>7}{'kv':>5}"
          f"{'mlp_dim':>9}{'MFLOP/token':>13}{'tokens/s':>12}")
    for name, f in facts.items():
        print(f"{name:<8}{f['params']:>12,}{f['d_model']:>9}{f['layers']:>8}{f['heads']:>7}"
              f"{f['kv_heads']:>5}{f['mlp_dim']:>9}{f['flops_per_token'] / 1e6:>13.2f}"
              f"{statistics.median(rates[name]):>12,.0f}")
    print(f"llama/gpt tokens/s: {statistics.median(ratios):.3f} (rounds {min(ratios):.3f} to "
          f"{max(ratios):.3f}); parameters {gap:+.2%}")
    result = {
        "families": {name: {**f, "tokens_per_sec": statistics.median(rates[name]),
                            "rounds_tokens_per_sec": rates[name]} for name, f in facts.items()},
        "ratio": statistics.median(ratios), "ratios": ratios, "param_gap": gap,
        "steps": args.steps, "rounds": args.rounds, "device": jax.devices()[0].device_kind,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
