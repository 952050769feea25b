"""Compile seconds of a Plan change against depth: layers scanned (``model.scan_layers``) or not.

A Plan change that touches a pipeline stage's layers (capacities, plugin records, frozen
layers, a migrated layer) recompiles that stage's forward and backward programs; its
update program does not depend on them. Table 1: the seconds to trace, lower and compile
stage 0's ``fwd`` + ``bwd`` programs of a 2-stage pipeline whose stage 0 holds 4, 16 or 48
layers, dense and MoE (every layer an MoE block), small widths on CPU, median of
``--repeats`` fresh lowerings with the persistent compilation cache off; target (issue 15
§3): with scan, 48 layers <= 2x the 4-layer time. Table 2 (``--step``): the same for the
whole single-program train step, whose per-parameter optimizer update is not scanned.
Table 3: the single-program step at 4, 8 and 16 layers (``--step-layers``), scanned against
unrolled: the two compiled steps' calls alternate (this machine's load drifts), median seconds
of ``--steps`` calls each, and each step's XLA temporaries. "scan" forces every run to scan
(``model.scan_min_layers=2``); the default scans runs of `SCAN_MIN_LAYERS` or more.

    python benchmarks/scan_compile.py               # about 8 min on two shared cores
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

from dynjax.config import default_config  # noqa: E402
from dynjax.experiment import Experiment  # noqa: E402
from dynjax.parallel.stage_programs import lower_stage  # noqa: E402

TARGET = 2.0  # 48-layer over 4-layer compile seconds, scanned


# (d_model, mlp_dim, seq_len, batch_size): the compile tables' narrow model, and table 3's,
# whose activations weigh as in a real model's step
COMPILE_SHAPE, STEP_SHAPE = (64, 128, 64, 8), (128, 512, 128, 16)


def experiment(
    layers: int, moe: bool, scan: bool, stages: int = 1, shape: tuple = COMPILE_SHAPE
) -> Experiment:
    c = default_config()
    c.mesh.stage = stages
    c.model.num_layers, c.model.num_heads = layers, 4
    c.model.d_model, c.model.mlp_dim, c.data.seq_len, c.train.batch_size = shape
    c.model.scan_layers, c.model.scan_min_layers = scan, 2
    c.moe.every, c.moe.num_experts, c.moe.top_k = (1 if moe else 0), 4, 2
    c.data.max_tokens = 20_000
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


class TimedStep:
    """A compiled single-program step on fresh state and a fixed batch, called one at a time."""

    def __init__(self, exp: Experiment) -> None:
        plan = exp.initial_plan()
        self.compiled = compile_seconds(exp)[1]
        self.temp_mb = self.compiled.memory_analysis().temp_size_in_bytes / 1e6
        state = exp.init_state()
        self.params, self.opt_state = state["params"], state["opt_state"]
        self.batch = exp.device_batch(exp.order.batch(0), plan=plan)
        self.times: list[float] = []

    def __call__(self) -> None:
        start = time.perf_counter()
        state = self.compiled(self.params, self.opt_state, self.batch)
        self.params, self.opt_state, metrics = state
        jax.block_until_ready(metrics["loss"])
        self.times.append(time.perf_counter() - start)

    def median(self) -> float:
        return statistics.median(self.times[1:])  # the first call also allocates


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
    parser.add_argument("--step-layers", type=int, nargs="+", default=[4, 8, 16],
                        help="layers of table 3's models")
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
        "Table 3: ms per single-program step (d_model, mlp, seq, batch = "
        f"{', '.join(map(str, STEP_SHAPE))}), calls alternating, median of {args.steps}; XLA "
        "temporaries MB"
    )
    print(f"{'model':6} {'layers':>6} {'unrolled':>9} {'scan':>7} {'scan/unrolled':>14} "
          f"{'temp MB unrolled':>17} {'scan':>6}")
    for moe in args.moe:
        for layers in args.step_layers:
            steps = {scan: TimedStep(experiment(layers, moe, scan, shape=STEP_SHAPE))
                     for scan in (False, True)}
            for _ in range(args.steps + 1):
                for step in steps.values():
                    step()
            ms = {scan: 1e3 * step.median() for scan, step in steps.items()}
            print(
                f"{'MoE' if moe else 'dense':6} {layers:6d} {ms[False]:9.1f} {ms[True]:7.1f} "
                f"{ms[True] / ms[False]:14.2f} {steps[False].temp_mb:17.1f} "
                f"{steps[True].temp_mb:6.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
