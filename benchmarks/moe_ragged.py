"""Ragged against static MoE dispatch (issue 12 §1), CPU, ratios measured in one run.

1. Compile seconds (lower + compile) of a Plan's train step for 8 and 64 experts: the static
   path compiles a matmul pair per expert, the ragged path one ``ragged_dot`` pair per layer.
   On the ragged path a per-expert capacity change within the bucketed totals compiles nothing
   at all (the Compiler's cache holds it); the column is what a new *total* costs.
2. Step time of both paths at the same capacities (medians of timed rounds, alternating).
3. Recompiles per 1,000 steps of `DynamicCapacity`, simulated on synthetic skewed, drifting
   loads (a real 1,000-step run does not fit the shared 2-core machine): a static Plan change
   recompiles unless one of the last `recompile.cache_size` Plans had it; a ragged one only when
   its key (the bucketed totals) is not among those.

    PYTHONPATH=. python benchmarks/moe_ragged.py [--rounds 5] [--steps 10] [--sections 1,2,3]
        [--experts 8,64] [--layers 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import OrderedDict

import jax
import numpy as np

from dynjax.config import default_config
from dynjax.dynamism.moe import MoEPlugin
from dynjax.dynamism.moe.capacity import LOADS, DynamicCapacity, ragged_totals
from dynjax.dynamism.moe.part import capacities_of, moe_context
from dynjax.experiment import Experiment
from dynjax.recompile import History


def small_config(num_experts: int, dispatch: str, layers: int = 8):
    c = default_config()
    c.data.path = "tests/data/corpus.txt"
    c.data.seq_len = 64
    c.data.max_tokens = 200_000
    c.train.batch_size = 8
    c.model.num_layers = layers
    c.model.d_model = 64
    c.model.num_heads = 4
    c.model.mlp_dim = 128
    c.moe.every = 1
    c.moe.num_experts = num_experts
    c.moe.top_k = 2
    c.moe.dispatch = dispatch
    return c


def compile_seconds(exp: Experiment, plan) -> float:
    t0 = time.perf_counter()
    exp.lower_train_step(plan).compile()
    return time.perf_counter() - t0


def uneven(exp: Experiment, seed: int):
    """Per-expert capacities between factor 0.5 and 2 (a DynamicCapacity-like Plan)."""
    rng = np.random.default_rng(seed)
    moe = moe_context(exp.facts)
    lo, hi = moe.group_tokens * moe.top_k // moe.num_experts // 2, moe.group_tokens
    caps = rng.integers(max(lo, 1), hi // 2 + 1, size=(moe.num_moe_layers, moe.num_experts))
    return exp.initial_plan().with_part("moe", capacities=tuple(map(tuple, caps.tolist())))


def step_times(exps: dict[str, Experiment], plan, steps: int, rounds: int) -> dict[str, float]:
    """Median seconds per step of each Experiment at ``plan``, rounds alternating."""
    runs = {}
    for name, exp in exps.items():
        fn = exp.lower_train_step(plan).compile()
        state = exp.init_state()
        batches = [exp.device_batch(exp.order.batch(t), plan=plan) for t in range(steps)]
        runs[name] = [fn, state, batches, []]
    for _ in range(rounds + 1):  # the first round warms up
        for run in runs.values():
            fn, state, batches, times = run
            t0 = time.perf_counter()
            for b in batches:
                state["params"], state["opt_state"], m = fn(state["params"], state["opt_state"], b)
            jax.block_until_ready(m["loss"])
            times.append((time.perf_counter() - t0) / steps)
    return {name: statistics.median(run[3][1:]) for name, run in runs.items()}


def simulated_recompiles(exp: Experiment, steps: int, cache_size: int) -> dict[str, int]:
    """Recompiles of DynamicCapacity over ``steps`` synthetic steps, static vs ragged keys."""
    ctx = moe_context(exp.facts)
    c = next(p for p in exp.plugins if isinstance(p, MoEPlugin)).settings.capacity
    policy = DynamicCapacity.from_settings(ctx, c)
    rng = np.random.default_rng(0)
    groups, pairs = exp.ctx.batch_size, ctx.group_tokens * ctx.top_k
    logits = rng.normal(0, 0.5, size=(ctx.num_moe_layers, ctx.num_experts))
    plan, entries = exp.initial_plan(), []
    key = {
        "static": lambda p: p,
        "ragged": lambda p: ragged_totals(ctx, capacities_of(p), 1, c.bucket),
    }
    caches = {name: OrderedDict({fn(plan): None}) for name, fn in key.items()}
    counts = {"static": 0, "ragged": 0, "plan changes": 0}
    for t in range(steps):
        logits += rng.normal(0, 0.05, size=logits.shape)  # the routing drifts
        p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
        loads = np.stack([rng.multinomial(pairs, q, size=groups) for q in p])
        entries = (entries + [(t, {LOADS: np.minimum(loads, ctx.group_tokens)})])[-c.window :]
        proposal = policy.propose(History.of(entries), plan)
        if proposal is None:
            continue
        plan = proposal.plan
        counts["plan changes"] += 1
        for name, cache in caches.items():
            k = key[name](plan)
            if k not in cache:
                counts[name] += 1
            cache[k] = None
            cache.move_to_end(k)
            while len(cache) > cache_size:
                cache.popitem(last=False)
    return counts


def compile_table(experts: list[int], layers: int) -> None:
    print(f"\n1. compile seconds of a Plan's train step ({layers} layers, all MoE, d=64, S=64, "
          "B=8)")
    print("experts | static s | ragged s | static/ragged")
    for e in experts:
        exps = {d: Experiment.from_config(small_config(e, d, layers)) for d in ("static", "ragged")}
        secs = {d: [] for d in exps}
        for r in range(2):  # uneven capacities, new ones each time: no cache helps
            for d, exp in exps.items():
                secs[d].append(compile_seconds(exp, uneven(exp, 100 * e + r)))
        s, g = statistics.median(secs["static"]), statistics.median(secs["ragged"])
        print(f"{e:7d} | {s:8.2f} | {g:8.2f} | {s / g:6.2f}x", flush=True)


def step_table(experts: list[int], steps: int, rounds: int, layers: int) -> None:
    print(f"\n2. seconds per step, medians of {rounds} rounds of {steps} steps")
    print("experts | capacities | static ms | ragged ms | static/ragged")
    for e in experts:
        exps = {d: Experiment.from_config(small_config(e, d, layers)) for d in ("static", "ragged")}
        for label, plan in (("factor 1.25", exps["static"].initial_plan()),
                            ("uneven", uneven(exps["static"], e))):
            t = step_times(exps, plan, steps, rounds)
            ratio = t["static"] / t["ragged"]
            print(f"{e:7d} | {label:10s} | {1e3 * t['static']:9.1f} | {1e3 * t['ragged']:9.1f} "
                  f"| {ratio:6.2f}x", flush=True)


def recompile_table(sim_steps: int, layers: int) -> None:
    print(f"\n3. DynamicCapacity over {sim_steps} simulated steps (8 experts, drifting loads)")
    exp = Experiment.from_config(small_config(8, "ragged", layers))
    counts = simulated_recompiles(exp, sim_steps, exp.settings.recompile.cache_size)
    per = 1000 / sim_steps
    print(f"plan changes {counts['plan changes'] * per:.0f} | static recompiles "
          f"{counts['static'] * per:.0f} | ragged recompiles {counts['ragged'] * per:.0f} "
          "(per 1,000 steps)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--sim-steps", type=int, default=1000)
    ap.add_argument("--sections", default="1,2,3", help="which tables to print")
    ap.add_argument("--experts", default="8,64", help="expert counts of tables 1 and 2")
    ap.add_argument("--layers", type=int, default=8, help="layers of the model (all MoE)")
    args = ap.parse_args()
    sections = {int(v) for v in args.sections.split(",")}
    experts = [int(v) for v in args.experts.split(",")]
    print(f"backend: {jax.default_backend()} (CPU numbers)")

    if 1 in sections:
        compile_table(experts, args.layers)
    if 2 in sections:
        step_table(experts, args.steps, args.rounds, args.layers)
    if 3 in sections:
        recompile_table(args.sim_steps, args.layers)


if __name__ == "__main__":
    main()
