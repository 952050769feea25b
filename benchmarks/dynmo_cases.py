"""DynMo's six dynamic-model cases through the pipeline simulator: static vs dynamic balancing.

The cost traces are SYNTHESISED from DynMo's per-case load models (seed 000 §2) and the idleness
of its Fig. 1: the dynamism plugins that would produce measured per-layer traces do not exist yet.
Speedups here therefore test the balancers on plausible load shapes; they are not a reproduction
of the paper's measurements, whose headline numbers are printed beside them for reference.

For each case a 10,000-iteration training trajectory is sampled every 200 iterations. At each
sample the layer costs (forward, backward, memory) come from the case's model; every balancer
holds the layout it chose at its last rebalance, made from the profile of that iteration (for
MoE, sparse attention and MoD, rebalanced every iteration, the profile is the mean of the
previous PROFILE_WINDOW iterations: no look-ahead at the current iteration's routing noise).
One 1F1B iteration with M = 4 x S microbatches (seed 000 §5) and a per-hop transfer of 0.05 is
simulated per sample and layout; the table shows the time-averaged iteration time in units of
one dense layer's forward.

* static uniform: Megatron-LM's even split, fixed for the whole run.
* partition: exact min-max by time under memory capacity, moving the fewest layers.
* diffusion: decentralised diffusion by time (max_iters=10), continuing from its last layout.
* re-packed: ``repack`` merges neighbouring stages of the partition layout down to the fewest
  workers whose simulated time stays within 5% of partition's, then ``partition`` rebalances them
  (seed 000 §3.4: re-pack "while maintaining comparable performance"). GPUs = mean stages used.

Per-worker memory capacity is 1.5x a dense uniform stage. "vs dense" divides the iteration time of
the model *without* the dynamism (static uniform) by partition's: the baseline the paper uses for
sparse attention and early exit. Balancing overhead (profiling, migration) is not modelled.

    PYTHONPATH=. python3 benchmarks/dynmo_cases.py
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dynjax.balance import diffusion, partition, repack, simulate, uniform

ITERATIONS = 10_000
SAMPLE_EVERY = 200
COMM = 0.05  # per-hop activation transfer, in dense-layer forwards
CAPACITY_FACTOR = 1.5  # worker memory / dense uniform stage memory
REPACK_TOLERANCE = 1.05
PROFILE_WINDOW = 8  # iterations averaged into the profile when rebalancing every iteration


@dataclass(frozen=True)
class Layers:
    """Per-layer costs at one iteration."""

    fwd: np.ndarray  # [L] forward time of one microbatch
    bwd: np.ndarray  # [L] backward time of one microbatch
    memory: np.ndarray  # [L] parameters, optimizer state, stashed activations

    @property
    def time(self) -> np.ndarray:
        return self.fwd + self.bwd


@dataclass(frozen=True)
class Case:
    name: str
    layers: int
    stages: int
    every: int  # rebalance period in iterations; 1 = every iteration from the previous profile
    paper: float  # seed 000 abstract / §5
    paper_baseline: str
    trace: Callable[[int], Layers]  # layer costs at an iteration
    dense: Layers  # the same model without its dynamism


def dense_layers(num_layers: int, fwd: float = 1.0) -> Layers:
    ones = np.ones(num_layers)
    return Layers(fwd * ones, 2 * fwd * ones, ones)


def noise(case_seed: int, t: int) -> np.random.Generator:
    return np.random.default_rng([case_seed, t])


def moe() -> Case:
    """§2.1: a layer waits for its hottest expert; routing skew persists per layer, plus noise."""
    num_layers, seed = 32, 1
    skew = np.random.default_rng(seed).lognormal(np.log(0.35), 0.5, num_layers)

    def trace(t: int) -> Layers:
        hottest = 1.0 + skew * noise(seed, t).lognormal(0.0, 0.3, num_layers)
        fwd = 0.35 + 0.65 * hottest / 1.35  # normalised so balanced routing costs ~1
        return Layers(fwd, 2 * fwd, np.ones(num_layers))

    return Case("MoE", num_layers, 16, 1, 1.23, "static Megatron-LM", trace,
                dense_layers(num_layers, (0.35 + 0.65 / 1.35)))


def pruning() -> Case:
    """§2.2 + seed 003 eq. 2: cubic gradual global pruning to 90% at 4k..7k; layers keep
    different densities (deeper ones pruned more); sparse kernels win below 25% density."""
    num_layers, seed = 96, 2
    rng = np.random.default_rng(seed)
    depth = np.linspace(0.0, 1.0, num_layers)
    share = np.exp(0.8 * (1 - 2 * depth) + rng.normal(0.0, 0.45, num_layers))

    def sparsity(t: int) -> float:
        if t < 4000:
            return 0.0
        step = min((t // 1000) * 1000, 7000)
        return 0.9 * (1 - (1 - (step - 3000) / 4000) ** 3)  # S_i = 0, S_f = 0.9, n = 4, dt = 1000

    def trace(t: int) -> Layers:
        keep = 1.0 - sparsity(t)
        density = np.clip(keep * share / share.mean(), 0.005, 1.0)
        fwd = 0.25 + 0.75 * np.minimum(1.0, 4.0 * density)
        memory = 0.6 * np.minimum(1.0, 2.0 * density) + 0.4  # CSR: values + indices
        return Layers(fwd, 2 * fwd, memory)

    return Case("pruning", num_layers, 24, 1000, 3.18, "static Megatron-LM", trace,
                dense_layers(num_layers))


def freezing() -> Case:
    """§2.3: Egeria freezes converged layers front to back; a frozen layer costs 0 (its output is
    cached) and keeps only its weights."""
    num_layers = 96

    def trace(t: int) -> Layers:
        frozen = int(0.75 * num_layers * np.clip((t - 1000) / 8000, 0.0, 1.0))
        live = np.arange(num_layers) >= frozen
        fwd = live.astype(float)
        return Layers(fwd, 2 * fwd, np.where(live, 1.0, 0.15))

    return Case("freezing", num_layers, 24, 500, 2.23, "Egeria (unbalanced freezing)", trace,
                dense_layers(num_layers))


def sparse_attention() -> Case:
    """§2.4: hash-based sparse flash attention; each layer keeps a different, fluctuating
    fraction of attention blocks. Dense layer: 0.4 MLP/projections + 1.6 attention (long
    sequences)."""
    num_layers, seed = 96, 4
    base = np.random.default_rng(seed).uniform(0.05, 0.45, num_layers)

    def trace(t: int) -> Layers:
        kept = np.clip(base * noise(seed, t).lognormal(0.0, 0.25, num_layers), 0.02, 1.0)
        fwd = 0.4 + 1.6 * kept
        return Layers(fwd, 2 * fwd, np.ones(num_layers))

    return Case("sparse attention", num_layers, 24, 1, 4.02, "dense attention", trace,
                dense_layers(num_layers, 2.0))


def early_exit() -> Case:
    """§2.5: tokens leave after the first exit layer; the share left decays with depth, faster
    as the model grows confident over training."""
    num_layers = 96
    first_exit = num_layers // 4
    depth = np.arange(num_layers)

    def trace(t: int) -> Layers:
        scale = num_layers * (0.6 - 0.5 * min(t / ITERATIONS, 1.0))
        left = np.exp(-np.maximum(depth - first_exit, 0) / scale)
        return Layers(left, 2 * left, 0.6 + 0.4 * left)

    return Case("early exit", num_layers, 24, 500, 4.52, "no early exit", trace,
                dense_layers(num_layers))


def mixture_of_depths() -> Case:
    """§2.6: every other block is routed (expert choice, ~half the tokens); the predictor's
    misestimates and the MoE underneath make the processed share fluctuate."""
    num_layers, seed = 32, 6
    routed = np.arange(num_layers) % 2 == 1
    bias = np.random.default_rng(seed).lognormal(0.0, 0.15, num_layers)

    def trace(t: int) -> Layers:
        share = np.where(routed, 0.5 * bias * noise(seed, t).lognormal(0.0, 0.2, num_layers), 1.0)
        fwd = np.minimum(share, 1.0)
        return Layers(fwd, 2 * fwd, np.ones(num_layers))

    return Case("MoD", num_layers, 16, 1, 1.17, "MoD w/o balancing", trace,
                dense_layers(num_layers))


def profile_at(case: Case, t: int) -> Layers:
    """What the monitor reports at iteration ``t``: that iteration's costs, or for per-iteration
    rebalancing the mean of the last ``PROFILE_WINDOW`` iterations (timings are noisy)."""
    if case.every > 1:
        return case.trace(t)
    window = [case.trace(i) for i in range(max(t - PROFILE_WINDOW + 1, 0), t + 1)]
    return Layers(*(np.mean([getattr(w, f) for w in window], axis=0)
                    for f in ("fwd", "bwd", "memory")))


def iteration_time(layers: Layers, counts: tuple[int, ...], micro: int) -> float:
    starts = np.concatenate(([0], np.cumsum(counts)))[:-1]
    fwd = np.add.reduceat(layers.fwd, starts)
    bwd = np.add.reduceat(layers.bwd, starts)
    return simulate(fwd, bwd, micro, schedule="1f1b", comm=COMM).iteration_time


def repacked(profile: Layers, balanced: tuple[int, ...], capacity: float,
             micro: int) -> tuple[int, ...]:
    """Fewest workers within ``REPACK_TOLERANCE`` of the balanced time (bisection on the count)."""
    kw = dict(memory=profile.memory, capacity=capacity)
    goal = REPACK_TOLERANCE * iteration_time(profile, balanced, micro)
    lo, hi, best = len(repack(profile.time, balanced, **kw)), len(balanced), balanced
    while lo < hi:
        mid = (lo + hi) // 2
        merged = repack(profile.time, balanced, target=mid, **kw)
        layout = partition(profile.time, mid, current=merged, **kw)
        if iteration_time(profile, layout, micro) <= goal:
            hi, best = mid, layout
        else:
            lo = mid + 1
    return best


def run(case: Case) -> dict[str, float]:
    micro = 4 * case.stages
    static = uniform(case.layers, case.stages)
    capacity = CAPACITY_FACTOR * case.dense.memory.sum() / case.stages
    layouts = {"partition": static, "diffusion": static, "re-packed": static}
    times: dict[str, list[float]] = {k: [] for k in ("static", "dense", *layouts)}
    gpus: list[int] = []
    last = None
    for t in range(0, ITERATIONS, SAMPLE_EVERY):
        rebalance_at = t - 1 if case.every == 1 else (t // case.every) * case.every
        if rebalance_at >= 0 and rebalance_at != last:
            last = rebalance_at
            profile = profile_at(case, rebalance_at)
            kw = dict(memory=profile.memory, capacity=capacity)
            layouts["partition"] = partition(profile.time, case.stages,
                                             current=layouts["partition"], **kw)
            layouts["diffusion"] = diffusion(profile.time, layouts["diffusion"], **kw)
            layouts["re-packed"] = repacked(profile, layouts["partition"], capacity, micro)
        now = case.trace(t)
        times["static"].append(iteration_time(now, static, micro))
        times["dense"].append(iteration_time(case.dense, static, micro))
        for name, layout in layouts.items():
            times[name].append(iteration_time(now, layout, micro))
        gpus.append(len(layouts["re-packed"]))
    out = {name: float(np.mean(v)) for name, v in times.items()}
    out["gpus"] = float(np.mean(gpus))
    return out


def main() -> None:
    cases = [moe(), pruning(), freezing(), sparse_attention(), early_exit(), mixture_of_depths()]
    print("DynMo cases on SYNTHETIC cost traces (seed 000 §2 load models, Fig. 1 idleness; no "
          "measured traces yet).")
    print(f"Time-averaged simulated 1F1B iteration time over {ITERATIONS:,} iterations, sampled "
          f"every {SAMPLE_EVERY}; M = 4 x S microbatches; unit = one dense layer forward.")
    header = (f"{'case':<17}{'L x S':>7}{'rebal.':>7}{'static':>9}{'partition':>10}"
              f"{'diffusion':>10}{'re-packed':>10}{'GPUs':>6} | {'x part':>7}{'x diff':>7}"
              f"{'x repack':>9}{'x vs dense':>11} | {'paper':>6}  paper's baseline")
    print(header)
    print("-" * len(header))
    for case in cases:
        r = run(case)
        rebalance = "1 it" if case.every == 1 else f"{case.every}"
        print(f"{case.name:<17}{f'{case.layers}x{case.stages}':>7}{rebalance:>7}"
              f"{r['static']:>9.1f}{r['partition']:>10.1f}{r['diffusion']:>10.1f}"
              f"{r['re-packed']:>10.1f}{r['gpus']:>6.1f} | "
              f"{r['static'] / r['partition']:>6.2f}x{r['static'] / r['diffusion']:>6.2f}x"
              f"{r['static'] / r['re-packed']:>8.2f}x{r['dense'] / r['partition']:>10.2f}x | "
              f"{case.paper:>5.2f}x  {case.paper_baseline}")


if __name__ == "__main__":
    main()
