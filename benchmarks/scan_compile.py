"""Compile seconds of a Plan change against depth: layers scanned (``model.scan_layers``) or not.

A Plan change that touches a pipeline stage's layers (capacities, plugin records, frozen
layers, a migrated layer) recompiles that stage's forward and backward programs; its
update program does not depend on them. Table 1: the seconds to trace, lower and compile
stage 0's ``fwd`` + ``bwd`` programs of a 2-stage pipeline whose stage 0 holds 4, 16 or 48
layers, dense and MoE (every layer an MoE block), small widths on CPU, median of
``--repeats`` fresh lowerings with the persistent compilation cache off; target (issue 15
§3): with scan, 48 layers <= 2x the 4-layer time. Table 2 (``--step``): the same for the
whole single-program train step, whose per-parameter optimizer update is not scanned.
Table 3: the median step time of the single-program 16-layer step (``--step-layers``), scan
against unrolled.

    python benchmarks/scan_compile.py               # about 5 min on two shared cores
    python benchmarks/scan_compile.py --layers 4 16 --repeats 1 --step --models moe
    python benchmarks/scan_compile.py --layers 2 --repeats 1 --steps 1 --step-layers 2  # tiny
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dynjax.config import default_config  # noqa: E402
from dynjax.experiment import Experiment  # noqa: E402
from dynjax.parallel.stage_programs import lower_stage  # noqa: E402

TARGET = 2.0  # 48-layer over 4-layer compile seconds, scanned


def experiment(layers: int, moe: bool, scan: bool, stages: int = 1) -> Experiment:
    c = default_config()
    c.mesh.stage = stages
    c.model.num_layers, c.model.d_model, c.model.num_heads, c.model.mlp_dim = layers, 64, 4, 128
    c.model.scan_layers = scan
    c.moe.every, c.moe.num_experts, c.moe.top_k = (1 if moe else 0), 4, 2
    c.data.seq_len, c.data.max_tokens = 64, 20_000
    c.train.batch_size = 8
    return Experiment.from_config(c)


def stage_seconds(exp: Experiment) -> float:
    """Lower + compile seconds of stage 0's forward and backward programs."""
    programs = exp.pipeline_programs
    stage = exp.pipeline_spec(exp.initial_plan()).stages[0]
    mesh = programs.transport.stage_meshes[0]
    shapes = programs.shapes(stage)  # abstract values: traced once, outside the timing
    start = time.perf_counter()
    for kind in ("fwd", "bwd"):
        lower_stage(kind, exp.pipeline_programs.setup, stage, mesh, shapes).compile()
    return time.perf_counter() - start


def compile_seconds(exp: Experiment) -> tuple[float, jax.stages.Compiled]:
    start = time.perf_counter()
    compiled = exp.lower_train_step(exp.initial_plan()).compile()
    return time.perf_counter() - start, compiled


def step_seconds(exp: Experiment, compiled, steps: int) -> float:
    """Median wall seconds of ``steps`` calls of ``compiled`` on fresh state and a fixed batch."""
    state = exp.init_state()
    params, opt_state = state["params"], state["opt_state"]
    rng = np.random.default_rng(0)
    batch = {
        k: jax.device_put(rng.integers(0, 256, a.shape).astype(a.dtype), a.sharding)
        for k, a in exp.abstract_batch(exp.initial_plan()).items()
    }
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        params, opt_state, metrics = compiled(params, opt_state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first call also allocates


def table(title: str, args, measure) -> dict[tuple[bool, int], float]:
    """Print one compile-seconds table; returns the scanned medians by (moe, layers)."""
    print(title)
    print(f"{'model':6} {'layers':>6} {'unrolled':>9} {'scan':>7} {'scan/unrolled':>14}")
    scanned = {}
    for moe in args.moe:
        for layers in args.layers:
            row = {scan: statistics.median(measure(layers, moe, scan)) for scan in (False, True)}
            scanned[moe, layers] = row[True]
            print(
                f"{'MoE' if moe else 'dense':6} {layers:6d} {row[False]:9.2f} {row[True]:7.2f} "
                f"{row[True] / row[False]:14.2f}",
                flush=True,
            )
    lo, hi = min(args.layers), max(args.layers)
    for moe in args.moe:
        ratio = scanned[moe, hi] / scanned[moe, lo]
        verdict = "meets" if ratio <= TARGET else "misses"
        print(
            f"  {'MoE' if moe else 'dense'}: scan {hi} / {lo} layers = {ratio:.2f} "
            f"({verdict} the <= {TARGET:.0f}x target)"
        )
    return scanned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 48])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps of table 3")
    parser.add_argument("--step-layers", type=int, default=16, help="layers of table 3's model")
    parser.add_argument("--step", action="store_true", help="also table 2 (slow unrolled)")
    parser.add_argument("--models", nargs="+", choices=("dense", "moe"), default=["dense", "moe"])
    args = parser.parse_args()
    args.moe = [name == "moe" for name in args.models]
    jax.config.update("jax_enable_compilation_cache", False)

    def stage(layers: int, moe: bool, scan: bool) -> list[float]:
        exp = experiment(2 * layers, moe, scan, stages=2)  # stage 0 holds `layers` layers
        return [stage_seconds(exp) for _ in range(args.repeats)]

    table(
        f"Table 1: lower + compile seconds of stage 0's fwd + bwd, median of {args.repeats}",
        args,
        stage,
    )
    if args.step:

        def step(layers: int, moe: bool, scan: bool) -> list[float]:
            exp = experiment(layers, moe, scan)
            return [compile_seconds(exp)[0] for _ in range(args.repeats)]

        table(
            f"Table 2: lower + compile seconds of the train step, median of {args.repeats}",
            args,
            step,
        )
    print(
        f"Table 3: seconds per single-program step at {args.step_layers} layers, median of "
        f"{args.steps}"
    )
    for moe in args.moe:
        times = {}
        for scan in (False, True):
            exp = experiment(args.step_layers, moe, scan)
            times[scan] = step_seconds(exp, compile_seconds(exp)[1], args.steps)
        print(
            f"{'MoE' if moe else 'dense':6} unrolled {times[False]:.4f}  scan {times[True]:.4f}  "
            f"scan/unrolled {times[True] / times[False]:.2f}"
        )


if __name__ == "__main__":
    main()
