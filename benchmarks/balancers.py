"""Balancers against the exact optimum on synthetic cost vectors, and the runtime of ``partition``.

Table 1: max stage cost relative to the optimum (1.000 = optimal) for the static baselines
(``uniform`` = Megatron-LM, ``by_param`` = DeepSpeed ``parameters``), ``partition`` by time
(must be 1.000) and ``diffusion`` by time from the uniform layout with its default 10 rounds
(mean / max rounds used, share of runs converged). Mean over 20 draws per shape. Shapes, from
DynMo's per-case load models (seed 000 §2; synthesised, no measured traces yet):

* uniform: equal layers; random: U(0.5, 1.5).
* pruning: global magnitude pruning leaves each layer a different density ``d`` (mean 0.1); time
  is 0.25 (unpruned ops) + 0.75 * min(1, 4d) (sparse kernels beat dense below 25% density,
  seed 003 §C); parameter counts are ``d``, so by-param balances a proxy, not the time.
* freezing: the first 15-60% of layers frozen, cost 0 (seed 000 §2.3's model), the rest 1.
* early exit: full cost up to the first exit layer, then the fraction of tokens left decays
  exponentially with depth (seed 000 §2.5).
* MoE: attention 0.35 plus the FFN 0.65 times the hottest expert's load relative to the mean
  (1 + lognormal, median 1.4: routing skew, seed 000 §2.1).

Table 2: ``partition`` runtime, median of several runs, against the issue's targets.

    PYTHONPATH=. python3 benchmarks/balancers.py
"""

import time

import numpy as np

from dynjax.balance import by_param, diffusion_with_info, partition, stage_costs, uniform

SIZES = ((48, 8), (96, 16))
DRAWS = 20


def shapes(num_layers: int, rng: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per shape: (per-layer time, per-layer parameter count)."""
    ones = np.ones(num_layers)
    depth = np.arange(num_layers)
    density = np.clip(rng.lognormal(np.log(0.1), 0.6, num_layers), 0.01, 1.0)
    frozen = int(num_layers * rng.uniform(0.15, 0.6))
    first_exit = int(num_layers * rng.uniform(0.25, 0.5))
    decay = rng.uniform(0.1, 0.3) * num_layers
    tokens_left = np.exp(-np.maximum(depth - first_exit, 0) / decay)
    hottest = 1.0 + rng.lognormal(np.log(0.4), 0.6, num_layers)  # hottest expert / mean load
    return {
        "uniform": (ones, ones),
        "random": (rng.uniform(0.5, 1.5, num_layers), ones),
        "pruning": (0.25 + 0.75 * np.minimum(1.0, 4 * density), density),
        "freezing": (np.where(depth < frozen, 0.0, 1.0), ones),
        "early exit": (tokens_left, ones),
        "MoE": (0.35 + 0.65 * hottest, ones),
    }


def quality_table() -> None:
    print(f"Table 1: max stage cost / optimum (mean over {DRAWS} draws); diffusion from uniform, "
          "max_iters=10")
    header = (f"{'shape':<11} {'L x S':>7} {'uniform':>8} {'by-param':>9} {'partition':>10} "
              f"{'diffusion':>10} {'rounds mean/max':>16} {'converged':>10}")
    print(header)
    print("-" * len(header))
    for num_layers, num_stages in SIZES:
        rows: dict[str, list[list[float]]] = {}
        for draw in range(DRAWS):
            rng = np.random.default_rng([num_layers, draw])
            for name, (cost, params) in shapes(num_layers, rng).items():
                best = stage_costs(cost, partition(cost, num_stages)).max()
                start = uniform(num_layers, num_stages)
                diff = diffusion_with_info(cost, start)
                ratios = [
                    stage_costs(cost, counts).max() / best
                    for counts in (start, by_param(params, num_stages),
                                   partition(cost, num_stages, current=start), diff.counts)
                ]
                rows.setdefault(name, []).append([*ratios, diff.iterations, diff.converged])
        for name, values in rows.items():
            v = np.array(values)
            print(f"{name:<11} {f'{num_layers}x{num_stages}':>7} {v[:, 0].mean():>8.3f} "
                  f"{v[:, 1].mean():>9.3f} {v[:, 2].mean():>10.3f} {v[:, 3].mean():>10.3f} "
                  f"{f'{v[:, 4].mean():.1f} / {v[:, 4].max():.0f}':>16} {v[:, 5].mean():>10.0%}")


def median_ms(fn, runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def runtime_table() -> None:
    print("\nTable 2: partition runtime (pure NumPy/Python), random U(0, 1) layer costs")
    header = (f"{'layers':>7} {'stages':>7} {'option':<18} {'median ms':>10} {'runs':>5} "
              f"{'target ms':>10} {'met':>4}")
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    for num_layers, num_stages, target, runs in ((1024, 64, 10.0, 21), (10_000, 1024, 1000.0, 7)):
        costs = rng.random(num_layers)
        current = uniform(num_layers, num_stages)
        memory = rng.uniform(0.5, 1.5, num_layers)
        capacity = 1.5 * memory.sum() / num_stages
        cases = {
            "plain": lambda c=costs, s=num_stages: partition(c, s),
            "current=uniform": lambda c=costs, s=num_stages, u=current: partition(c, s, current=u),
            "memory cap 1.5x": lambda c=costs, s=num_stages, m=memory, k=capacity: partition(
                c, s, memory=m, capacity=k),
        }
        for option, fn in cases.items():
            ms = median_ms(fn, runs)
            print(f"{num_layers:>7} {num_stages:>7} {option:<18} {ms:>10.2f} {runs:>5} "
                  f"{target:>10.0f} {'yes' if ms < target else 'NO':>4}")


if __name__ == "__main__":
    quality_table()
    runtime_table()
