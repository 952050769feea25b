"""Compile seconds and FLOPs of a pipeline stage's programs against the single program of the
same layers (issue 33 §3: a Plan change should cost <= 1.2x the single program's compile).

A Plan change that touches a stage (a moved layer, a capacity, a freeze) recompiles that stage's
forward and backward; its update does not change. With ``pipeline.recompute`` (the default) the
backward holds the forward again (it recomputes the stage from its stored input); with it off the
forward keeps the VJP's residuals and the backward is the pullback alone
(`dynjax.parallel.residuals`). Per ``--layers`` L: the train step of an L-layer model as one
program, against the forward + backward of stage 0 of a 2-stage pipeline of 2L layers (it holds L
layers and the embedding), recomputing and on residuals, each lowered and compiled fresh
(median of ``--repeats``, the persistent compilation cache off); the ratio of each to the single
program; and the XLA FLOPs (``cost_analysis()``) of each.

    python benchmarks/stage_compile.py                 # about 2 min on two cores
    python benchmarks/stage_compile.py --layers 4 --repeats 1
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

TARGET = 1.2  # a stage's forward + backward over the single program's compile


def experiment(layers: int, stages: int, recompute: bool = True) -> Experiment:
    """The single program takes the batch in one microbatch (a microbatch loop is a while loop,
    whose body ``cost_analysis`` counts once), the pipeline in 2."""
    c = default_config()
    c.mesh.stage = stages
    c.model.num_layers, c.model.d_model, c.model.num_heads, c.model.mlp_dim = layers, 64, 4, 128
    c.pipeline.recompute = recompute
    c.data.seq_len, c.data.max_tokens = 64, 20_000
    c.train.batch_size, c.train.microbatches = 8, 1 if stages == 1 else 2
    return Experiment.from_config(c)


def flops(compiled) -> float:
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def single(layers: int) -> tuple[float, float]:
    """(lower + compile seconds, FLOPs) of the L-layer single-program train step."""
    exp = experiment(layers, 1)
    start = time.perf_counter()
    compiled = exp.lower_train_step(exp.initial_plan()).compile()
    return time.perf_counter() - start, flops(compiled)


def stage(layers: int, recompute: bool) -> tuple[float, float]:
    """(lower + compile seconds, FLOPs per microbatch x microbatches) of stage 0's forward and
    backward in a 2-stage pipeline whose stage 0 holds ``layers`` layers."""
    exp = experiment(2 * layers, 2, recompute)
    programs = exp.pipeline_programs
    spec = exp.pipeline_spec(exp.initial_plan()).stages[0]
    programs.shapes(spec)  # abstract values: traced once, outside the timing
    start = time.perf_counter()
    compiled = [programs.lower_one(kind, spec).compile() for kind in ("fwd", "bwd")]
    seconds = time.perf_counter() - start
    return seconds, spec.microbatches * sum(flops(c) for c in compiled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    single(2)  # the process's first compile also pays JAX's own start-up
    print(f"lower + compile seconds, median of {args.repeats}; GFLOPs of one step's batch "
          "(the single program: embedding, layers, head and update; stage 0: embedding, layers)")
    print(f"{'layers':>6} {'single':>8} {'recompute':>10} {'ratio':>6} {'residuals':>10} "
          f"{'ratio':>6}   {'GFLOPs single':>13} {'recompute':>9} {'residuals':>9}")
    for layers in args.layers:
        runs = {
            "single": [single(layers) for _ in range(args.repeats)],
            "recompute": [stage(layers, True) for _ in range(args.repeats)],
            "residuals": [stage(layers, False) for _ in range(args.repeats)],
        }
        sec = {k: statistics.median(s for s, _ in v) for k, v in runs.items()}
        gf = {k: v[0][1] / 1e9 for k, v in runs.items()}
        print(f"{layers:>6} {sec['single']:>8.2f} {sec['recompute']:>10.2f} "
              f"{sec['recompute'] / sec['single']:>5.2f}x {sec['residuals']:>10.2f} "
              f"{sec['residuals'] / sec['single']:>5.2f}x   {gf['single']:>13.3f} "
              f"{gf['recompute']:>9.3f} {gf['residuals']:>9.3f}", flush=True)
    print(f"target: a stage's forward + backward <= {TARGET}x the single program's compile")


if __name__ == "__main__":
    main()
