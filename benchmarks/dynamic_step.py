"""Compute that shrinks: the training step of a dynamic model against the same model kept whole.

Per runtime, the step of one model under each variant against the step under the baseline
(the config's initial Plan and weights, nothing frozen or pruned), measured end to end:
`exp.runtime(plan, state).step(...)` on the batches of `exp.order`, host batch placement
included, blocking on the metrics at the end of each round of ``--steps`` steps. A variant is a
Plan and an initial state derived from the baseline's (`Variant`); one the config cannot run is
skipped with a note. Rounds alternate over the variants (A, B, A, B...; the machine is shared
and noisy) and the table reports medians. Variants so far:

* ``frozen prefix``: ``plan.replace(frozen_layers=(0 .. L/2-1))`` (seed 000 §2.3, §4.2.3). A
  frozen prefix, embedding included, runs its forward only: no backward, no update. With a
  layer's backward at about twice its forward, the layers' FLOPs fall to
  (L/2 * 1 + L/2 * 3) / (L * 3) = 2/3; the embedding's and head's FLOPs add to both.
* ``pruned 90% global`` (seed 000 §2.2, §4.2.2; needs ``pruning.enabled``,
  ``pruning.granularity=block`` and ``pruning.sparse_below`` > 0): the same weights pruned as
  the plugin's pruning event does it (`pruning.prune`: one global magnitude ranking of the
  ``block_size`` blocks of every prunable matrix, 90% of them zeroed, the keep masks and zeroed
  Adam moments in the optimizer state), and the Plan the plugin's `SparsePath` policy proposes
  for them: the linears whose busiest block-column keeps at most ``sparse_below`` of its
  block-rows multiply block-sparsely with width K (`dynjax.model.sparse_linear`), the others
  stay dense (masked).
* ``pruned 90% per matrix``: the same, but each matrix ranked on its own scale (the masks
  `pruning.prune` picks on a copy with every prunable matrix divided by its RMS, applied to the
  real weights by `pruning.prune_stage`): every matrix keeps about 10% of its blocks.

Runtimes: the single-program step (one device) and the MPMD pipeline on ``--stages`` x
``--data`` fake CPU devices (the script sets ``--xla_force_host_platform_device_count=8``
before importing JAX). FLOPs per step come from ``cost_analysis()`` of the compiled programs,
which on this JAX counts the FLOPs of one device (a block-sparse Plan's are counted on the same
Plan with its block-sparse matmuls compiled as one batched step, ``loop=False``: XLA counts a
loop's body once; the timed step keeps the loop): the single-program step's is the whole step;
a pipeline step's is, over its stage programs, (FLOPs x runs per step x devices of the stage's
sub-mesh): the forward and backward programs run once per microbatch, the gradient norm and
the update once per step (the update of parameters replicated over the data axis counts once
per device). A pipeline stage's backward program recomputes the stage's forward from its input
(activation checkpointing at stage boundaries), so there a layer costs about 1 + 3 and the
frozen prefix's share is (L/2 * 1 + L/2 * 4) / (L * 4) = 5/8. On a CPU the fake devices share
the machine's cores, so the pipeline's time is its stages' work on those cores plus host
dispatch, not a parallel pipeline's. "compile s" is lowering + compiling in this process: the
variant measured second reuses the pipeline stage programs whose specs it shares.

    PYTHONPATH=. python3 benchmarks/dynamic_step.py [--config configs/freezing.py] \\
        [--rounds 7] [--steps 4] [--pipeline-steps 2] [--stages 4 --data 2] [--no-pipeline] \\
        [--set KEY=VALUE ...]

Measured 2026-11-23 on a shared 2-core CPU VM (load average about 8 from other engineers'
jobs during the run; jax 0.10.2, 8 fake CPU devices), the defaults above, 64 s in all, with
configs/freezing.py as is (8 layers, d_model 128, batch 16 x 128; its freezing plugin enabled,
so both variants also compute the per-layer gradient norms its policy reads; no policy runs):

    single-program step, 1 device
    median of 7 rounds x 4 steps
    variant                tok/s  step ms  ratio    min    max  GFLOP/step  FLOP ratio  compile s
    ---------------------------------------------------------------------------------------------
    none                   4,859    421.5   1.00   1.00   1.00      23.515       1.000        7.9
    frozen prefix L/2      7,969    257.0   1.49   1.41   1.74      15.817       0.673        4.8

    pipeline step, (stage, data) = (4, 2), layers (2, 2, 2, 2), 1f1b with M = 8
    median of 7 rounds x 2 steps
    variant                tok/s  step ms  ratio    min    max  GFLOP/step  FLOP ratio  compile s
    ---------------------------------------------------------------------------------------------
    none                   5,575    367.3   1.00   1.00   1.00      28.649       1.000        9.6
    frozen prefix L/2      9,002    227.5   1.65   1.53   1.76      17.555       0.613        3.2

The FLOP ratios are the expected ones (0.673 against 2/3 plus the embedding and head; 0.613
against 5/8), and the measured speedups are about their inverses (1/0.673 = 1.49, 1/0.613 =
1.63). "ratio" is the median of per-round ratios; the ratio of the median times (1.64 for the
single-program step) differs by the noise between rounds. The pipeline's step being faster than
the single-program one despite more FLOPs is probably a CPU effect (programs of different fake
devices run on both cores at once), not measured here.

Pruning, measured 2026-11-23 on the same shared 2-core VM (load average 4.1 at the start, 6.8 at
the end; jax 0.10.2, 8 fake CPU devices), the defaults above on configs/pruning.py with block
granularity at the plugin's block size (32) and the policy threshold of the config's block
example, 54 s in all:

    PYTHONPATH=. python3 benchmarks/dynamic_step.py --config configs/pruning.py \\
        --set pruning.granularity=block --set pruning.sparse_below=0.5

configs/pruning.py: 4 layers, d_model 128, 4 heads, mlp 512, vocab 256, batch 16 x 128 tokens,
float32. "none" is the dense model: the same weights, the pruning plugin enabled but nothing
pruned (its masks all True, every linear dense). The Plans (layer, linear, K of 4 block-rows, 16
for mlp/down; linears not named stay dense):

    pruned 90% global: (0, attn/qkv, 2), (0, attn/out, 0), (0, mlp/down, 0), (1, attn/qkv, 2),
      (1, attn/out, 0), (1, mlp/up, 2), (1, mlp/down, 0), (2, attn/qkv, 2), (2, attn/out, 0),
      (2, mlp/up, 2), (2, mlp/down, 0), (3, attn/qkv, 2), (3, attn/out, 0), (3, mlp/up, 2),
      (3, mlp/down, 0)
    pruned 90% per matrix: (0, attn/qkv, 1), (0, attn/out, 1), (0, mlp/up, 2), (0, mlp/down, 4),
      (1, attn/qkv, 1), (1, attn/out, 0), (1, mlp/up, 1), (1, mlp/down, 2), (2, attn/qkv, 1),
      (2, attn/out, 0), (2, mlp/up, 1), (2, mlp/down, 4), (3, attn/qkv, 2), (3, attn/out, 1),
      (3, mlp/up, 2), (3, mlp/down, 4)

    single-program step, 1 device
    median of 7 rounds x 4 steps
    variant                   tok/s  step ms  ratio    min    max  GFLOP/step  FLOP ratio  compile s
    ------------------------------------------------------------------------------------------------
    none                      8,983    228.0   1.00   1.00   1.00      11.976       1.000        0.8
    frozen prefix L/2        15,180    134.9   1.73   0.89   2.22       8.123       0.678        0.5
    pruned 90% global       226,998      9.0  24.01  19.74  37.12       0.442       0.037        0.4
    pruned 90% per matrix     9,848    208.0   1.08   0.77   1.78       3.937       0.329        1.1

    pipeline step, (stage, data) = (4, 2), layers (1, 1, 1, 1), 1f1b with M = 8
    median of 7 rounds x 2 steps
    variant                   tok/s  step ms  ratio    min    max  GFLOP/step  FLOP ratio  compile s
    ------------------------------------------------------------------------------------------------
    none                      9,119    224.6   1.00   1.00   1.00      14.282       1.000        2.1
    frozen prefix L/2        16,486    124.2   1.59   1.45   1.81       8.973       0.628        1.6
    pruned 90% global        57,862     35.4   4.98   4.25   6.66       0.546       0.038        2.6
    pruned 90% per matrix    11,280    181.6   1.17   0.98   1.37       4.713       0.330        2.9

(Compile times are small: earlier runs had filled the persistent compilation cache. A run just
before, load 4.1-5.4, gave median ratios 1.67 / 21.97 / 1.11 single-program and 1.62 / 5.14 /
1.18 pipeline for the three variants, at the same FLOPs.)

What the pruning rows say.

* ``pruned 90% global`` is not a 90%-sparse model but a model without its blocks: the global
  ranking zeroes every block of every attn/out and mlp/down matrix first (they are initialised
  1/sqrt(2L) smaller, `dynjax.model.gpt`), so both residual branches of every block output zero
  (K = 0), XLA drops all the work feeding them, and what remains is the embedding and the head:
  0.442 GFLOP, 3.7% of the dense step's. Its 24x (5.0x on the pipeline, where dispatch and
  transfers of 4 stages x 8 microbatches stay) is that, not the block-sparse matmul. The same
  happens in a run: configs/pruning.py at block granularity (8 layers, blocks of 16; the trace of
  `benchmarks/dynmo_cases.py`) had attn/out at K = 0 in 6 of its 8 layers and mlp/down in 7 after
  its second event (46% sparsity), for the rest of the run.
* ``pruned 90% per matrix`` is the block-sparse matmul at work, and gains far less than its FLOPs:
  1.08x (single program; rounds 0.77-1.78x on the loaded machine) and 1.17x (pipeline) for a
  FLOP ratio of 0.33, where 1/0.33 = 3x would follow the FLOPs. The matmul alone at this model's
  sizes (below, same session, load 5.0-5.2) is the reason: with d_model 128 a 32-block matrix has
  4 block-rows, K is 1 or 2 of 4 (mlp/down: 2 or 4 of 16), and at 2048 tokens the XLA path's
  per-block-column loop runs its forward 0.4-0.8x as fast as the dense matmul at K = 2/4 and
  0.5-1.1x at K = 1/4; forward + backward gains 1.2-1.5x at K = 1/4 (FLOPs 0.25) and loses at
  K = 2/4 (0.58-0.95x). ``sparse_below=0.5`` switches the K = 2/4 linears too (the policy
  compares K with the block-rows, not with a measured break-even), and the attention products
  (QK^T, AV), the embedding and head are not pruned.

    PYTHONPATH=. python benchmarks/sparse_matmul.py --shapes 128x384,128x128,128x512,512x128 \\
        --densities 0.5,0.25

    | density |  weight |    K |    pass | dense_ms | sparse_ms | speedup | cpu_speedup | flops |
    |---------|---------|------|---------|----------|-----------|---------|-------------|-------|
    |   0.500 | 128x384 |  2/4 |     fwd |    0.964 |     1.888 |   0.510 |       0.510 | 0.500 |
    |   0.500 | 128x384 |  2/4 | fwd+bwd |    2.931 |     5.031 |   0.583 |       0.682 | 0.504 |
    |   0.250 | 128x384 |  1/4 |     fwd |    0.694 |     1.410 |   0.492 |       0.747 | 0.250 |
    |   0.250 | 128x384 |  1/4 | fwd+bwd |    3.439 |     2.850 |   1.207 |       1.212 | 0.253 |
    |   0.500 | 128x128 |  2/4 |     fwd |    0.333 |     0.800 |   0.416 |       0.416 | 0.500 |
    |   0.500 | 128x128 |  2/4 | fwd+bwd |    1.352 |     1.688 |   0.801 |       0.805 | 0.504 |
    |   0.250 | 128x128 |  1/4 |     fwd |    0.358 |     0.616 |   0.581 |       0.589 | 0.250 |
    |   0.250 | 128x128 |  1/4 | fwd+bwd |    1.724 |     1.137 |   1.516 |       1.450 | 0.253 |
    |   0.500 | 128x512 |  2/4 |     fwd |    1.338 |     2.745 |   0.488 |       0.498 | 0.500 |
    |   0.500 | 128x512 |  2/4 | fwd+bwd |    5.532 |     8.576 |   0.645 |       0.736 | 0.504 |
    |   0.250 | 128x512 |  1/4 |     fwd |    1.244 |     1.907 |   0.652 |       0.665 | 0.250 |
    |   0.250 | 128x512 |  1/4 | fwd+bwd |    5.045 |     3.683 |   1.370 |       1.369 | 0.253 |
    |   0.500 | 512x128 | 8/16 |     fwd |    1.322 |     1.610 |   0.821 |       0.820 | 0.500 |
    |   0.500 | 512x128 | 8/16 | fwd+bwd |    6.590 |     6.906 |   0.954 |       1.025 | 0.503 |
    |   0.250 | 512x128 | 4/16 |     fwd |    1.352 |     1.184 |   1.142 |       1.103 | 0.250 |
    |   0.250 | 512x128 | 4/16 | fwd+bwd |    6.027 |     3.939 |   1.530 |       1.410 | 0.252 |

  (the printed table with its padding narrowed and its ``ideal`` column, K / rows, left out.)
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dynjax.config import load_config  # noqa: E402
from dynjax.dynamism import pruning  # noqa: E402
from dynjax.dynamism.pruning_math import prunable_leaves  # noqa: E402
from dynjax.experiment import Experiment  # noqa: E402
from dynjax.recompile import Plan  # noqa: E402
from dynjax.recompile.policy import History  # noqa: E402

PRUNED_SPARSITY = 0.9


class NotApplicable(Exception):
    """A variant that the config cannot run (the message says what it needs)."""


# A variant: (experiment, baseline Plan, the baseline's initial host state) -> (its Plan, its
# initial host state). Every variant starts from the same weights; one may change them (a
# pruned copy) besides its Plan, or raise `NotApplicable`.
Variant = Callable[[Experiment, Plan, dict[str, Any]], tuple[Plan, dict[str, Any]]]


def frozen_prefix(exp: Experiment, plan: Plan, host: dict[str, Any]) -> tuple[Plan, dict]:
    layers = exp.cfg.model.num_layers
    return plan.replace(frozen_layers=tuple(range(layers // 2))), host


def pruned_blocks(exp: Experiment, plan: Plan, host: dict[str, Any]) -> tuple[Plan, dict]:
    """What a block-pruning run holds at ``PRUNED_SPARSITY``, through the plugin's own functions:
    one global selection of blocks over the whole model, ranked as the config's
    ``pruning.scale`` says (`pruning.prune` with `pruning.ranking_scales`, the event a run's
    `before_step` makes; weights zeroed, masks and Adam moments in the optimizer state), then
    the Plan its `SparsePath` policy proposes from the busiest block-columns that the plugin's
    weight hook (`pruning.zero_pattern`) reports: block-sparse matmuls for the linears at or
    below ``pruning.sparse_below``."""
    p = exp.cfg.pruning
    if not (p.enabled and p.granularity == "block" and p.sparse_below > 0):
        raise NotApplicable(
            "needs pruning.enabled=True, pruning.granularity='block' and pruning.sparse_below > 0"
        )
    [policy] = pruning.PruningPlugin().policies(exp.cfg, exp)
    state = jax.device_put(host, jax.devices()[0])  # the whole model as one stage
    pruning.prune(
        [state],
        PRUNED_SPARSITY,
        include=p.include,
        granularity="block",
        block_size=p.block_size,
        scales=pruning.ranking_scales(exp.cfg),
    )
    host = jax.device_get(state)
    weights = prunable_leaves(host["params"], p.include)
    columns = []
    for i, record in enumerate(pruning.PruningPlugin.records(exp, plan)):
        layer = {path: weights[f"layers/{i}/{path}"] for path in record.paths}
        columns.append(np.asarray(pruning.zero_pattern(layer, record)[1][pruning.COLUMN_BLOCKS]))
    proposal = policy.propose(History.of([(0, {pruning.COLUMN_BLOCKS: np.stack(columns)})]), plan)
    return (plan if proposal is None else proposal.plan), host


# name -> the variant (the first entry is the baseline).
VARIANTS: dict[str, Variant] = {
    "none": lambda exp, plan, host: (plan, host),
    "frozen prefix L/2": frozen_prefix,
    f"pruned {PRUNED_SPARSITY:.0%}": pruned_blocks,
}


def flop_plan(plan: Plan) -> Plan:
    """The Plan whose compiled step ``cost_analysis`` counts in full: block-sparse matmuls as
    one batched step (their loop's body is counted once), otherwise ``plan`` itself."""
    if plan.part(pruning.NAME).get("sparse"):
        return plan.with_part(pruning.NAME, loop=False)
    return plan


def _flops(compiled) -> float:
    """FLOPs of one run of a compiled program on one device (a dict, or a list of them)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return float(cost.get("flops", 0.0))  # absent: no arithmetic (a frozen stage's sqnorm)


def step_flops(exp: Experiment, executable) -> float:
    """FLOPs of one training step over all devices (see the module docstring)."""
    if not hasattr(executable, "programs"):  # the single-program step on one device
        return _flops(executable)
    spec, meshes = executable.spec, exp.pipeline_programs.transport.stage_meshes
    total = 0.0
    for (kind, s), program in executable.programs.items():
        runs = spec.microbatches if kind in ("fwd", "bwd") else 1
        total += _flops(program) * runs * meshes[s].devices.size
    return total


def variants(exp: Experiment) -> dict[str, tuple[Plan, dict[str, Any]]]:
    """Each applicable variant's (Plan, initial host state); prints the others."""
    base, host = exp.initial_plan(), exp.init_host_state()
    out = {}
    for name, variant in VARIANTS.items():
        try:
            out[name] = variant(exp, base, host)
        except NotApplicable as why:
            print(f"skipped {name!r}: {why}")
    return out


def describe(plan: Plan) -> str:
    """The Plan part that makes a variant, for the table's notes."""
    sparse = plan.part(pruning.NAME).get("sparse", ())
    if sparse:
        return "block-sparse (layer, linear, K): " + ", ".join(
            f"({i}, {lin}, {k})" for i, lin, k in sparse
        )
    if plan.frozen_layers:
        return f"frozen layers {plan.frozen_layers}"
    return "the baseline Plan"


def measure(
    exp: Experiment, runs_of: dict[str, tuple[Plan, dict[str, Any]]], steps: int, rounds: int
) -> dict[str, dict]:
    """Compile each Plan, then time ``rounds`` alternating rounds of ``steps`` steps each."""
    runs, out = {}, {}
    for name, (plan, host) in runs_of.items():
        t0 = time.perf_counter()
        executable = exp.lower_train_step(plan).compile()
        compile_s = time.perf_counter() - t0
        counting = flop_plan(plan)
        counted = executable if counting == plan else exp.lower_train_step(counting).compile()
        runtime = exp.runtime(plan, host)
        jax.block_until_ready(runtime.step(executable, exp.order.batch(0), None))  # warm up
        runs[name] = (runtime, executable)
        out[name] = {"flops": step_flops(exp, counted), "compile_s": compile_s, "secs": []}
    for r in range(rounds):
        for name, (runtime, executable) in runs.items():
            start = 1 + r * steps  # every variant trains on the same batches
            t0 = time.perf_counter()
            for t in range(start, start + steps):
                metrics = runtime.step(executable, exp.order.batch(t), None)
            jax.block_until_ready(metrics)
            out[name]["secs"].append((time.perf_counter() - t0) / steps)
    return out


def report(title: str, exp: Experiment, results: dict[str, dict], steps: int, rounds: int) -> None:
    tokens = exp.cfg.train.batch_size * exp.cfg.data.seq_len
    base = results[next(iter(results))]
    print(f"\n{title}\nmedian of {rounds} rounds x {steps} steps")
    header = (
        f"{'variant':<22}{'tok/s':>9}{'step ms':>9}{'ratio':>7}{'min':>7}{'max':>7}"
        f"{'GFLOP/step':>12}{'FLOP ratio':>12}{'compile s':>11}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        # Per-round ratios of this variant's time to the baseline's time of the same round.
        ratios = [b / s for b, s in zip(base["secs"], r["secs"], strict=True)]
        step = statistics.median(r["secs"])
        print(
            f"{name:<22}{tokens / step:>9,.0f}{1e3 * step:>9.1f}"
            f"{statistics.median(ratios):>7.2f}{min(ratios):>7.2f}{max(ratios):>7.2f}"
            f"{r['flops'] / 1e9:>12.3f}{r['flops'] / base['flops']:>12.3f}"
            f"{r['compile_s']:>11.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/freezing.py")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=4, help="single-program steps per round")
    parser.add_argument("--pipeline-steps", type=int, default=2, help="pipeline steps per round")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--data", type=int, default=2)
    parser.add_argument("--no-pipeline", action="store_true")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    args = parser.parse_args()
    began = time.perf_counter()

    cfg = load_config(args.config, args.set)
    m = cfg.model
    print(
        f"{args.config}: {m.num_layers} layers, d_model {m.d_model}, {m.num_heads} heads, "
        f"mlp {m.mlp_dim}, vocab {m.vocab_size}, batch {cfg.train.batch_size} x "
        f"{cfg.data.seq_len} tokens, {cfg.train.dtype}; {jax.devices()[0].device_kind} "
        f"x{jax.device_count()} (fake), jax {jax.__version__}, {os.cpu_count()} cores"
    )
    print(
        "ratio = tok/s of the variant / tok/s of 'none' in the same round (median, min, max "
        "over rounds); FLOP ratio = variant / 'none'"
    )

    exp = Experiment.from_config(cfg)
    plans = variants(exp)
    for name, (plan, _) in plans.items():
        print(f"{name}: {describe(plan)}")
    results = measure(exp, plans, args.steps, args.rounds)
    report("single-program step, 1 device", exp, results, args.steps, args.rounds)

    if not args.no_pipeline:
        mesh = [f"mesh.stage={args.stages}", f"mesh.data={args.data}"]
        cfg = load_config(args.config, [*args.set, *mesh])
        exp = Experiment.from_config(cfg)
        plans = variants(exp)
        base = next(iter(plans.values()))[0]
        results = measure(exp, plans, args.pipeline_steps, args.rounds)
        report(
            f"pipeline step, (stage, data) = ({args.stages}, {args.data}), layers "
            f"{base.stage_layers}, {base.schedule} with M = {base.microbatches}",
            exp,
            results,
            args.pipeline_steps,
            args.rounds,
        )
    print(f"\ntotal {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
