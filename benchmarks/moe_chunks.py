"""MPipeMoE's chunked MoE layer (issue 12 §3, seed 002 §III), CPU, measured in one run.

1. Memory: XLA ``memory_analysis()`` temp bytes of one expert-parallel MoE layer's training
   step (forward and backward, 4 fake CPU devices, per device) for n in {1, 2, 4, 8} partitions
   and each memory reuse strategy, and the saving against the unchunked layer (n = 1, none)
   next to eq. 5-6's bound, ΔM_act + ΔM_buf = 2 B (2M (n-2)/n + H (n-1)/n) elements, B the
   dispatched rows per device. On CPU "pinned_host" is the same RAM and XLA counts the offloaded
   residuals (S1-S3) in the temp bytes; only S4's column is a device-memory saving here.
2. Step time (CPU) of the layer's training step vs n for a few B (groups per device), the
   unrolled partitions (none) and the scan (S4); medians of timed rounds, ratios to n = 1. The
   overlap of all-to-all and experts that chunking exists for needs a GPU: not measured here.
3. Alg. 1 in the loop: `AdaptiveGranularity` picks n from the live step times of part 2's
   programs at each B; its n's time against the best fixed n's (target within 5%).

    PYTHONPATH=. python benchmarks/moe_chunks.py [--rounds 9] [--parts memory,time] [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from dynjax.dynamism.moe.granularity import (  # noqa: E402
    STEP_CHUNKS,
    STEP_ROWS,
    STEP_SECONDS,
    AdaptiveGranularity,
    chunks_of,
    saved_bytes,
)
from dynjax.model import MoE, SlotLayout  # noqa: E402
from dynjax.model.moe import REUSE, Chunking  # noqa: E402
from dynjax.parallel import expert_parallel, make_mesh  # noqa: E402
from dynjax.recompile import History, Plan  # noqa: E402

SHARDS, E, K, S = 4, 8, 2, 128
CHUNKS = (1, 2, 4, 8)


def layer_step(moe: MoE, groups: int, chunking: Chunking):
    """The jitted training step of one MoE layer (gradients of params and input) and its input:
    ``groups`` sequences per device, capacity factor 1."""
    graphdef, params = nnx.split(moe)
    par = expert_parallel(make_mesh(1, 1, SHARDS))
    caps = (S * K // E,) * E
    cot = jax.random.normal(jax.random.key(1), (groups * SHARDS, S, moe.w_in.shape[1]))

    def loss(p, v):
        y, _ = nnx.merge(graphdef, p)(v, capacities=caps, parallel=par, chunking=chunking)
        return jnp.sum(y * cot)

    x = jax.random.normal(jax.random.key(0), cot.shape)
    return jax.jit(jax.grad(loss, argnums=(0, 1))), params, x, groups * SlotLayout(caps).total


def memory_table(d: int, h: int, groups: int) -> None:
    moe = MoE(d, h, E, K, out_std=0.02, rngs=nnx.Rngs(0))
    temp, rows = {}, 0
    for n in CHUNKS:
        for reuse in REUSE:
            fn, params, x, rows = layer_step(moe, groups, Chunking(n, reuse))
            temp[n, reuse] = fn.lower(params, x).compile().memory_analysis().temp_size_in_bytes
    base = temp[1, "none"]
    mib = 2**20
    print(f"\n1. temp MiB per device of one MoE layer's training step (CPU, {SHARDS} fake devices;"
          f" M={d}, H={h}, B={rows} dispatched rows per device, float32)")
    print("   n | " + " | ".join(f"{r:>6}" for r in REUSE) + " | eq.5-6 bound | S4 saving / bound")
    for n in CHUNKS:
        bound = 2 * saved_bytes(rows, d, h, n)
        saving = base - temp[n, "S4"]
        ratio = f"{saving / bound:6.1%}" if bound > 0 else "   n/a (bound <= 0)"
        cells = " | ".join(f"{temp[n, r] / mib:6.2f}" for r in REUSE)
        print(f"   {n} | {cells} | {bound / mib:8.2f} MiB | {saving / mib:6.2f} MiB = {ratio}")
    print("   saving = temp(n=1, none) - temp(n, S4); bound = 2 * eq. 5 (ΔM_act + ΔM_buf)")


def interleaved(programs: dict, rounds: int) -> dict:
    """Median seconds of each program, timed once per round in turn (drift on the shared
    machine hits every program alike)."""
    for fn, params, x in programs.values():
        jax.block_until_ready(fn(params, x))
    times = {key: [] for key in programs}
    for _ in range(rounds):
        for key, (fn, params, x) in programs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(params, x))
            times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(t) for key, t in times.items()}


def time_tables(d: int, h: int, group_counts, rounds: int) -> None:
    moe = MoE(d, h, E, K, out_std=0.02, rngs=nnx.Rngs(0))
    print(f"\n2. CPU step time of the layer's training step vs n (M={d}, H={h}; medians of "
          f"{rounds} interleaved rounds; ratio = time(n) / time(n=1, none); overlap gains "
          "need a GPU)")
    print("   B rows | reuse | " + " | ".join(f"n={n:<13}" for n in CHUNKS))
    adaptive = []
    for groups in group_counts:
        programs, rows = {}, 0
        for reuse in ("none", "S4"):
            for n in CHUNKS:
                fn, params, x, rows = layer_step(moe, groups, Chunking(n, reuse))
                programs[n, reuse] = (fn, params, x)
        seconds = interleaved(programs, rounds)
        base = seconds[1, "none"]
        for reuse in ("none", "S4"):
            cells = " | ".join(
                f"{seconds[n, reuse] * 1e3:6.1f}ms {seconds[n, reuse] / base:4.2f}x" for n in CHUNKS
            )
            print(f"   {rows:6d} | {reuse:>5} | {cells}")
        adaptive.append((rows, programs, seconds))
    print("\n3. Alg. 1 (AdaptiveGranularity, 3 trials + 1 warm-up per n) on live CPU step times, "
          "strategy none")
    print("   B rows | chosen n | its time | best fixed n | its time | ratio")
    policy = AdaptiveGranularity(CHUNKS, trials=3, warmup=1)
    for rows, programs, seconds in adaptive:
        plan = Plan().with_part("moe", capacities=((1,),), chunks=(1,), memory_reuse="none")
        entries = []
        for step in range(24):
            n = chunks_of(plan)[0]
            fn, params, x = programs[n, "none"]
            t0 = time.perf_counter()
            jax.block_until_ready(fn(params, x))
            entries.append((step, {STEP_ROWS: rows, STEP_CHUNKS: n,
                                   STEP_SECONDS: time.perf_counter() - t0}))
            proposal = policy.propose(History.of(entries), plan)
            if proposal is not None:
                plan = proposal.plan
        chosen = chunks_of(plan)[0]
        best = min(CHUNKS, key=lambda n: seconds[n, "none"])
        a, b = seconds[chosen, "none"], seconds[best, "none"]
        print(f"   {rows:6d} | {chosen:8d} | {a * 1e3:6.1f}ms | {best:12d} | {b * 1e3:6.1f}ms | "
              f"{a / b:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--parts", default="memory,time", help="which tables: memory, time")
    ap.add_argument("--quick", action="store_true", help="toy widths, one B (the code runs)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} devices")
    # B groups per device: at least the largest n of CHUNKS, which splits them.
    scale, group_counts = (8, (8,)) if args.quick else (1, (8, 16, 32))
    if "memory" in args.parts:
        memory_table(d=256 // scale, h=1024 // scale, groups=8)
    if "time" in args.parts:
        time_tables(d=64 // scale, h=256 // scale, group_counts=group_counts, rounds=args.rounds)


if __name__ == "__main__":
    main()
