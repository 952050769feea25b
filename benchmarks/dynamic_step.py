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
* ``pruned 90%`` (seed 000 §2.2, §4.2.2; needs ``pruning.enabled``,
  ``pruning.granularity=block`` and ``pruning.sparse_below`` > 0): the same weights pruned as
  the plugin's pruning event does it (`pruning.prune` with `pruning.ranking_scales`: one global
  ranking of the ``block_size`` blocks of every prunable matrix, 90% of them zeroed, the keep
  masks and zeroed Adam moments in the optimizer state), and the Plan the plugin's `SparsePath`
  policy proposes for them: the linears whose block-columns, cut into ``pruning.column_groups``
  widths, compute at most ``sparse_below`` of the dense blocks multiply block-sparsely
  (`dynjax.model.sparse_linear`), the others stay dense (masked). Run it with
  ``pruning.scale=init``: ranked raw (the default), every ``attn/out`` and ``mlp/down`` block
  goes first, the residual branches then output zero and XLA drops their work, and the step
  measures a model without its blocks (24x faster at 3.7% of the FLOPs, measured), not the
  block-sparse matmul.

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

Pruning, measured 2026-11-23 on the same 2-core VM, before column groups (every block-column of
a linear computed the busiest column's K blocks; since 2026-12-01 the columns fall into groups of
their own width: docs/benchmarks.md "Block-sparse path" has the step measured with them, 1.08x
at a FLOP ratio of 0.158 on the 4x-wider model below) (load average 1.6-3.1, mostly this run;
jax 0.10.2, 8 fake CPU devices). configs/pruning.py (4 layers, vocab 256, batch 16 x 128 tokens,
float32) at block granularity with the plugin's block size (32); "none" is the dense model: the
same weights, the pruning plugin enabled but nothing pruned (masks all True, every linear
dense). First at its own width, d_model 128, 59 s:

    PYTHONPATH=. python3 benchmarks/dynamic_step.py --config configs/pruning.py \
        --set pruning.granularity=block --set pruning.sparse_below=0.5 --set pruning.scale=init

    pruned 90%: block-sparse (layer, linear, K of 4 block-rows, 16 for mlp/down): (0, attn/qkv,
      1), (0, attn/out, 1), (0, mlp/up, 1), (0, mlp/down, 2), (1, attn/qkv, 1), (1, attn/out, 0),
      (1, mlp/up, 1), (1, mlp/down, 4), (2, attn/qkv, 1), (2, attn/out, 1), (2, mlp/up, 1),
      (2, mlp/down, 4), (3, attn/qkv, 2), (3, attn/out, 2), (3, mlp/up, 2), (3, mlp/down, 4)

    single-program step, 1 device, median of 7 rounds x 4 steps
    variant                   tok/s  step ms  ratio    min    max  GFLOP/step  FLOP ratio  compile s
    none                     14,041    145.9   1.00   1.00   1.00      11.976       1.000        0.7
    frozen prefix L/2        19,836    103.2   1.43   1.38   1.46       8.123       0.678        0.4
    pruned 90%               13,911    147.2   0.99   0.97   1.07       4.413       0.368        7.2

    pipeline step, (stage, data) = (4, 2), layers (1, 1, 1, 1), 1f1b with M = 8, 7 rounds x 2
    none                     11,553    177.3   1.00   1.00   1.00      14.282       1.000        1.8
    frozen prefix L/2        19,319    106.0   1.64   1.43   1.80       8.973       0.628        1.0
    pruned 90%               10,640    192.5   0.89   0.69   1.05       5.358       0.375       13.4

Then 4x wider, where a matrix has 16 block-rows (64 for mlp/down), 112 s:

    ... --set model.d_model=512 --set model.mlp_dim=2048 --set model.num_heads=8 \
        --rounds 5 --steps 2 --pipeline-steps 1

    pruned 90%: (layer, linear, K of 16, 64 for mlp/down): (0, attn/qkv, 6), (0, attn/out, 4),
      (0, mlp/up, 6), (0, mlp/down, 16), (1, attn/qkv, 6), (1, attn/out, 4), (1, mlp/up, 4),
      (1, mlp/down, 8), (2, attn/qkv, 4), (2, attn/out, 4), (2, mlp/up, 6), (2, mlp/down, 8),
      (3, attn/qkv, 6), (3, attn/out, 4), (3, mlp/up, 4), (3, mlp/down, 16)

    single-program step, 1 device, median of 5 rounds x 2 steps
    none                      2,688    761.9   1.00   1.00   1.00     164.056       1.000        2.5
    frozen prefix L/2         4,348    471.0   1.61   1.57   1.94     109.900       0.670        2.1
    pruned 90%                2,151    952.3   0.89   0.76   0.93      51.977       0.317        8.4

    pipeline step, (4, 2), layers (1, 1, 1, 1), 1f1b with M = 8, 5 rounds x 1 step
    none                      1,433   1429.0   1.00   1.00   1.00     194.800       1.000        7.0
    frozen prefix L/2         2,484    824.3   1.72   1.66   1.77     121.371       0.623        2.5
    pruned 90%                1,597   1282.2   1.12   0.95   1.37      66.625       0.342       19.0

and with ``--set pruning.sparse_below=0.25`` (only the linears at K <= 1/4 sparse; single
program only, 42 s): none 2,698 tok/s, frozen 1.58x, pruned 90% 0.81x (0.76-0.92) at a FLOP
ratio of 0.525.

What the pruning rows say. The 90%-pruned model is not faster on this CPU, at either width,
although its compiled step has a third of the FLOPs:

* K was the *busiest* block-column's count (bucketed), and every column computed K blocks: at
  10% overall density the busiest columns keep 25-37% of their block-rows (6 of 16), so the
  sparse matmuls ran at 25-37% of the dense FLOPs, not 10% (what column groups fix).
* At those widths the XLA block-sparse path is about as fast as the dense matmul on CPU
  (`benchmarks/sparse_matmul.py`: 0.84-0.96x at 50%, 1.3-1.8x at 25% for MLP-sized weights in
  isolation; at d_model 128 a matrix has 4 block-rows and K = 1-2 of 4, where the forward is
  0.4-1.1x). Inside the model it does worse than in isolation (0.81x end to end with only the
  K <= 1/4 linears sparse): each sparse linear also derives its block index from the weight's
  zero pattern, and the smaller attention matrices (512x512, 512x1536) gain less than the
  MLP-sized ones the matmul benchmark times; this was not profiled further.
* The attention products (QK^T, AV), embedding and head are not pruned.

The frozen rows of the same runs are as before (1.43-1.61x single, 1.64-1.72x pipeline). The GPU
path (the Pallas kernel) is unmeasured: no GPU was available.
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
    layers = exp.settings.model.num_layers
    return plan.replace(frozen_layers=tuple(range(layers // 2))), host


def pruned_blocks(exp: Experiment, plan: Plan, host: dict[str, Any]) -> tuple[Plan, dict]:
    """What a block-pruning run holds at ``PRUNED_SPARSITY``, through the plugin's own functions:
    one global selection of blocks over the whole model, ranked as the config's
    ``pruning.scale`` says (`pruning.prune` with `pruning.ranking_scales`, the event a run's
    `before_step` makes; weights zeroed, masks and Adam moments in the optimizer state), then
    the Plan its `SparsePath` policy proposes from the block-column counts that the plugin's
    weight hook (`pruning.zero_pattern`) reports: block-sparse matmuls, their columns cut into
    ``pruning.column_groups`` widths, for the linears at or below ``pruning.sparse_below``."""
    p = exp.cfg.pruning
    if not (p.enabled and p.granularity == "block" and p.sparse_below > 0):
        raise NotApplicable(
            "needs pruning.enabled=True, pruning.granularity='block' and pruning.sparse_below > 0"
        )
    plugin = next(p for p in exp.plugins if isinstance(p, pruning.PruningPlugin))
    [policy] = plugin.policies()
    state = jax.device_put(host, jax.devices()[0])  # the whole model as one stage
    pruning.prune(
        [state],
        PRUNED_SPARSITY,
        include=p.include,
        granularity="block",
        block_size=p.block_size,
        scales=pruning.ranking_scales(
            p.scale, exp.model_cfg, prunable_leaves(host["params"], p.include)
        ),
    )
    host = jax.device_get(state)
    weights = prunable_leaves(host["params"], p.include)
    columns = []
    for i, record in enumerate(plugin.records(plan)):
        layer = {path: weights[f"layers/{i}/{path}"] for path in record.paths}
        columns.append(np.asarray(pruning.zero_pattern(layer, record)[1][pruning.COLUMN_COUNTS]))
    proposal = policy.propose(History.of([(0, {pruning.COLUMN_COUNTS: np.stack(columns)})]), plan)
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
        return "block-sparse (layer, linear, widths K x columns): " + ", ".join(
            f"({i}, {lin}, " + "+".join(f"{k}x{n}" for k, n in w) + ")" for i, lin, w in sparse
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
    tokens = exp.settings.train.batch_size * exp.settings.data.seq_len
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
