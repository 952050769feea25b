"""DynMo's dynamic-model cases through the pipeline simulator: static vs dynamic balancing.

Two kinds of rows. RECORDED rows take their per-layer costs from a trace that a real dynjax run
wrote (``layer_costs.jsonl`` and the ``profile`` events of ``events.jsonl``, copied into
``benchmarks/traces/<case>.jsonl`` by ``record``, below). SYNTHETIC rows, marked "(synthetic)",
take them from DynMo's per-case load models (seed 000 §2) and the idleness of its Fig. 1, for the
cases without a trace. Synthetic speedups test the balancers on plausible load shapes; neither
kind reproduces the paper's measurements, whose headline numbers are printed beside them.

Today all six are recorded on the pipeline of ``benchmarks/real_pipeline.py`` (16 layers, 2
stages that run at the same time, one process pinned to a core each; issue 33 §4); ``main`` uses
every ``traces/<case>.jsonl`` it finds (``recorded_case``) and drops that case's synthetic row.

The six-case table. Every case's row gives each balancer's iteration time: static uniform
(Megatron-LM), static by-param (DeepSpeed), partition and diffusion by time, re-packed (and the
devices it uses); the speedup of each over the best static layout and "best" (best static / best of
partition and diffusion: the paper's definition, seed 000 Fig. 3), beside the paper's number; "x
dense" for sparse attention and early exit (the paper's baseline there is the model without the
dynamism); eq. 2's imbalance under the uniform and the partition layout; and the balancing overhead
("ovh") that ``benchmarks/balance_overhead.py --case NAME`` measured on the recorded run's model and
appended to ``traces/overhead.jsonl``: one periodic profile's extra seconds (unit times rescaled
from the profiled step's own timeline) per ``every`` plain steps, ``every`` being the case's cadence
in the paper (its synthetic row's, `cadence`: every step for MoE, sparse attention and MoD, 1,000
for pruning, 500 for freezing and early exit; seed 000 §3.3.1, Fig. 3); "swaps" is the profile
after each Plan swap of the recorded run, which runs alone the units the swap made new (a Plan's
first profile; the only samples a trace with ``units`` keeps), at the measured seconds of a move or
of a resize (`swaps`, `swap_seconds`), over the run's steps. Migration (paid per move) and the
decision (on the Controller's thread) are printed under the table.

Extrapolation to the paper's setting (the "L x S" rows of a recorded case). The paper trains far
deeper models on 16 (MoE, MoD) or 24 pipeline stages (seed 000 Fig. 3); our runs have 16 layers
on 2. Each recorded case gets more rows with the synthetic row's depth and stages (MoE and MoD
32 x 16, the others 96 x 24): every measured layer stands for L / n consecutive copies of itself
(n: the run's layers; its forward and backward times and its state bytes; the embedding stays
with the first copy of layer 0 and the norm + head with the last copy of the last layer), M = 4
x S microbatches and 0.05 dense-layer forwards per hop as the synthetic rows, the memory cap
1.5x a dense uniform stage of the deeper model, and every balancer run exactly as for the
recorded rows. This is an extrapolation, not a measurement: the copies of a layer share its
measured noise (a slow measurement weighs L / n times), layers no deeper model would have (n
distinct layers, repeated) and the transfers are modelled. Copying each layer in a row also
groups layers of one kind: MoE's and MoD's layers alternate (MoE or routed every other layer),
and their 32 x 16 rows put two copies of a heavy layer on one stage and two of a light one on the
next, an imbalance a real 32-layer model, alternating too, would not have under the uniform
split. ``--tiled`` stacks the whole measured model L / n times instead (kinds keep alternating).

Recorded rows. Each profiled step of the run (every ``pipeline.profile_every`` steps and the first
step of every Plan) is one sample: its measured per-microbatch forward and backward seconds of every
layer (the embedding's counted in the first layer and the norm/head/loss's in the last, as
``Rebalance`` does), and each layer's memory: its parameter, Adam-moment and (trainable layers only)
gradient-accumulator bytes per device, which ``record`` checks against the stage memory the profile
measured. Stashed stage inputs and XLA temporaries are left out (they belong to a stage, not a
layer). Traces that record how a profile got its unit times (``units``; sparse attention on) keep
only the profiles that ran every unit alone (`read_measured`): the periodic ones rescale those by
each stage's busy time in their own step, and on these runs that put the first stage's layers at
3-10x their measured time (the dense run's timelines: stage 0's first forward, F0, takes 18-24 s in
every periodic profile against 0.12 s in the first; it waits for the steps dispatched before it
without blocking, so the first stage's busy time holds the previous steps' tail). The MoE and MoD
traces predate ``units`` and keep their rescaled samples (MoE's step 11: layer 0 at 3x step 1). A
sample stands for the steps until the next one. The balancers decide on the first profile of every
Plan (the run's own compile and each freeze, block-sparse switch or budget change, seed 000 §3.1),
and their layout holds from the step after it (no look-ahead). Times are in units of one dense
layer's forward: the median measured layer forward before the first change. Every layout is
simulated from the same measured times (a paired comparison), whatever layout the run itself trained
on (here the static uniform one, balancing off).
The "Plan medians" row replaces every sample's times by the element-wise median of its Plan's
samples: how much of the raw row is CPU timing noise. "imbalance" is eq. 2
(``dynjax.balance.imbalance``) of the stage loads (summed forward + backward of the measured layer
times) under the uniform and the partition layout, time-averaged; below the table, the same for the
uniform layout from the step timeline the run measured (per-stage mean F + B task seconds).

Synthetic rows. A 10,000-iteration training trajectory is sampled every 200 iterations. At each
sample the layer costs (forward, backward, memory) come from the case's model; every balancer holds
the layout it chose at its last rebalance, made from the profile of that iteration (for MoE, sparse
attention and MoD, rebalanced every iteration, the profile is the mean of the previous
PROFILE_WINDOW iterations: no look-ahead at the current iteration's routing noise).

Both. One 1F1B iteration (M = 4 x S microbatches for synthetic rows, seed 000 §5; the run's own
M for recorded ones) with a per-hop transfer of 0.05 dense-layer forwards is simulated per sample
and layout; the table shows the time-averaged iteration time in units of one dense layer's forward.

* static uniform: Megatron-LM's even split, fixed for the whole run.
* static by-param: DeepSpeed's ``partition_method='parameters'`` (``dynjax.balance.by_param`` of
  the layers' parameter counts, as ``pipeline.stage_layers='by_param'``), fixed for the whole run.
  Every case here has equal layers, so it equals uniform.
* partition: exact min-max by time under memory capacity, moving the fewest layers.
* diffusion: decentralised diffusion by time (max_iters=10), continuing from its last layout.
* re-packed: ``repack`` merges neighbouring stages of the partition layout down to the fewest
  workers whose simulated time stays within 5% of partition's, then ``partition`` rebalances them
  (seed 000 §3.4: re-pack "while maintaining comparable performance"). GPUs = mean stages used.

Per-worker memory capacity is 1.5x a dense uniform stage. "x dense" divides the iteration time of
the model *without* the dynamism under static uniform by partition's: the baseline the paper uses
for sparse attention and early exit. Synthetic rows take the dense load model; a recorded row
takes ``traces/<case>.dense.jsonl``, a run of the same command with the plugin off, where one was
recorded (sparse attention), else the samples before the run's first change. Both are
unpaired (another period of a shared CPU), marked "*". Balancing overhead is not simulated: it
is the measured "ovh" column.

    PYTHONPATH=. python3 benchmarks/dynmo_cases.py

Recording the traces (2026-11-28, the 2-core VM, this session's jobs only; 1-3 min each):
each case's static uniform run of ``benchmarks/real_pipeline.py`` (16 layers, d_model 128, 2
stages in 2 processes pinned to a core each, M = 4, the case's dynamism made strong and early as
there) with a profile every 5 steps, copied by ``record``; sparse attention's dense baseline is
the same run with the plugin off, 12 steps:

    PYTHONPATH=. python3 benchmarks/real_pipeline.py --case freezing \\
        --trace benchmarks/traces/freezing.jsonl        (likewise pruning, early_exit -> early_exit,
                                                         moe -> MoE, mod -> MoD, sparse_attention)
    PYTHONPATH=. python3 benchmarks/real_pipeline.py --case sparse_attention --dense --steps 12 \\
        --trace benchmarks/traces/sparse_attention.dense.jsonl

Each trace's first line holds the exact command that ran. The earlier traces (8 layers on a 4 x 2
pipeline of 8 fake CPU devices sharing 2 cores, 2026-11-23 to 11-27) are in the git history
with their analysis.

Overheads (2026-11-27 on the idle VM, one at a time, with one watcher thread per stage kept for
the pipeline's life and unit times kept across Plans: MoD and MoE ``--steps 6 --rounds 12``, 3 and
10 min; early exit ``--steps 3 --rounds 6``, 5 min; sparse attention ``--steps 2 --rounds 3``, 10
min; pruning and freezing are the 2026-11-25 measurement, which waited for each periodic profile
and ran every unit alone after each swap):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. python3 \\
        benchmarks/balance_overhead.py --case MoD --steps 6 --rounds 12 \\
        --record benchmarks/traces/overhead.jsonl        (likewise MoE)
    ... --case "early exit" --steps 3 --rounds 6 --record benchmarks/traces/overhead.jsonl
    ... --case "sparse attention" --steps 2 --rounds 3 --record benchmarks/traces/overhead.jsonl

Results: docs/benchmarks.md "DynMo cases" (the traces of 2026-11-28), printed by
``PYTHONPATH=. python3 benchmarks/dynmo_cases.py``; the overhead columns are the newest line of
each case in ``traces/overhead.jsonl`` (measured 2026-11-25/27 on the earlier 8-layer models).

Overheads. "ovh" is a periodic profile taken every step at the case's cadence, its unit times
rescaled from its own step's timeline, which watcher threads take while the training loop
dispatches the next steps (`Pipeline.start_profile_step`; the Profile joins the step's metrics
when the Monitor hands them over). The loop never waits for it, so what it costs is host work:
one thread wake-up per task of the step (each watcher waits for its stage's results in order;
counted on MoD: 28 per step, nearly every one a real sleep), the training thread's queue puts
and the Profile's arithmetic. Wall-clock differences of paired windows are noise of +-25% at
load 11-16 (2 cores); "cpu", the process's CPU seconds per periodic profile against a plain
step's, is the steadier measure, and still noisy: MoD 2.3% (21.1 ms against a 903 ms CPU step,
load ~15), MoE -1.1% (noise; 1,932 ms CPU step, load 11-15); early exit 0.0% at its cadence of 500
(81.8 ms per profile against a 1,520 ms CPU step, 5.4% were it every step, with a training-thread
share of 18.9 ms that no other run showed: load 10-12); sparse attention 0.1% is the earlier
measurement. MoD stays above the 2% target here. (Those were 2026-11-25/26 at load; on the idle
VM on 2026-11-27 the profile's own CPU, the watchers' plus the training thread's extra, is 0.4%
for MoE, 0.8% for MoD, 0.1% for sparse attention and 0.0% for early exit at 500, and the
process's CPU -1.6%, 1.4%, -2.2% and 0.0%.) An A/B in one
process at load 15-17 (plain steps, the earlier timing code and this one, 8 rotated rounds of 3
steps): extra CPU per profile 33.7 ms (3.9%) before, 25.0 ms (2.9%) now, of which the watchers
6.7-6.9 ms and the training thread 7.5-8.5 ms either way. What was cut: a small program per stage
and step for the ready marks (now the previous update's metric) and waits for transfers (a task
now starts after the task that computed its input); a variant that waited for an input's arrival
on the consumer's side only when it was not there yet added ~16 sleeps per step and cost more.
"swaps": the profile after a Plan swap (or a plugin's change of the model) runs alone the units
the swap made new, those whose timing signature (their one-unit program, less which of the equal
layers it is) no earlier measurement holds, and keeps the others' times
(`dynjax.parallel.profile.unit_seconds`). They are re-measured rather than rescaled because most
swaps change capacities or buckets of some layers only (MoE: the MoE layer of each [dense, MoE]
stage; early exit: the layers after an exit), and `rescaled_units` keeps the shares inside a
stage, so it would move a capacity change onto the stage's unchanged layers, which are what the
balancer moves. ``balance_overhead.py`` replays each recorded swap: a layer moved to the next
stage and back (a move), and the sizes of the layers whose cost the swap changed halved and back
(a resize; "all" for a swap that changed no cost, e.g. early exits turned on), the extra seconds
of the profiled step after each; `swap_seconds` adds them up per recorded swap. Over the recorded
runs that is 0.7% for MoE (9 swaps in 300 steps, 3 of them moves: 106 ms after a move, 170-523
ms after resizing one to four MoE layers, against a 1,334 ms step), 0.3% for MoD (2 moves, 168
ms), 1.0% for early exit (6 resizes, 185-596 ms against 659 ms) and 0.3% for sparse attention (4
swaps in 100 steps, -0.3 to 1.9 s against an 8.7 s step: one-layer resizes are under the noise);
when every unit ran alone after each swap these were 1.4-1.9%, 0.8%, 2.1% and 3.4%. A move of
MoE's layer 1 to stage 1 meets the MoE layer timed there already, and the move back the times
kept from before: neither runs a unit alone, and in training the profile after such a swap is
not waited for. The benchmark's figure for it is the wait for one isolated step, so the moves'
shares (all of MoD's, and the move counted for a swap that also resizes) are upper bounds.
Pruning (0.5%) and freezing (0.2%) are still the every-unit figures.
The periodic timelines agree with the waited-for ones within the noise: stage busy seconds
1.05-1.15x (MoE), 1.17-1.58x (MoD at load ~16), 0.80-0.86x (early exit), 1.03-1.16x (sparse
attention).
"""

import argparse
import json
import os
import re
import subprocess
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import numpy as np

from dynjax.balance import (
    by_param,
    diffusion,
    imbalance,
    partition,
    repack,
    simulate,
    stage_costs,
    uniform,
)

ITERATIONS = 10_000
SAMPLE_EVERY = 200
COMM = 0.05  # per-hop activation transfer, in dense-layer forwards
CAPACITY_FACTOR = 1.5  # worker memory / dense uniform stage memory
REPACK_TOLERANCE = 1.05
PROFILE_WINDOW = 8  # iterations averaged into the profile when rebalancing every iteration
TRACES = Path(__file__).resolve().parent / "traces"
OVERHEADS = TRACES / "overhead.jsonl"  # written by benchmarks/balance_overhead.py --record
ADAM_MOMENTS = 2  # optimizer-state bytes per parameter byte (Adam's mu and nu)
PAPER = {  # seed 000 abstract / §5: (speedup, its baseline)
    "MoE": (1.23, "static Megatron-LM"),
    "pruning": (3.18, "static Megatron-LM"),
    "freezing": (2.23, "Egeria, no balancing"),
    "sparse attention": (4.02, "dense attention"),
    "early exit": (4.52, "no early exit"),
    "MoD": (1.17, "MoD w/o balancing"),
}
DENSE_BASELINE = ("sparse attention", "early exit")  # the paper's speedup is over no dynamism
# `benchmarks/real_pipeline.py --case NAME --json` of each case: its speedup measured on two
# stages that run at the same time (one pinned process each), issue 33 §1.
MEASURED = Path(__file__).resolve().parent / "results" / "real_pipeline"
MEASURED_NAMES = {"moe": "MoE", "pruning": "pruning", "freezing": "freezing",
                  "sparse_attention": "sparse attention", "early_exit": "early exit", "mod": "MoD"}


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
    every: int  # rebalance period in iterations; 1 = every iteration from the previous profile;
    #             0 = on the first profile of every Plan (`changes`), applied from the next sample
    paper: float  # seed 000 abstract / §5
    paper_baseline: str
    trace: Callable[[int], Layers]  # layer costs at an iteration (recorded: at a profiled step)
    dense: Layers  # the same model without its dynamism (memory: the capacity's reference)
    source: str = "(synthetic)"
    steps: tuple[int, ...] = tuple(range(0, ITERATIONS, SAMPLE_EVERY))  # the samples
    weights: tuple[float, ...] = ()  # iterations each sample stands for; () = equal
    params: tuple[float, ...] = ()  # per-layer parameter counts (by-param); () = equal
    micro: int = 0  # microbatches per iteration; 0 = 4 x stages (seed 000 §5)
    changes: tuple[int, ...] = ()  # every == 0: steps whose profile is a new Plan's first
    dense_steps: tuple[int, ...] = ()  # recorded: samples of the model before any change
    unit_seconds: float = 0.0  # recorded: seconds of one dense layer forward (the time unit)
    timeline_imbalance: float | None = None  # recorded: eq. 2 of the run's measured stage times
    variant: str = ""  # recorded: how the row treats the trace ("Plan medians", "96x24", ...)
    dense_samples: tuple[Layers, ...] = ()  # recorded: a run of the model without the dynamism
    extrapolated: bool = False  # recorded: to more layers or stages than the run had


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

    return Case("MoE", num_layers, 16, 1, *PAPER["MoE"], trace,
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

    return Case("pruning", num_layers, 24, 1000, *PAPER["pruning"], trace,
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

    return Case("freezing", num_layers, 24, 500, *PAPER["freezing"], trace,
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

    return Case("sparse attention", num_layers, 24, 1, *PAPER["sparse attention"], trace,
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

    return Case("early exit", num_layers, 24, 500, *PAPER["early exit"], trace,
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

    return Case("MoD", num_layers, 16, 1, *PAPER["MoD"], trace,
                dense_layers(num_layers))


# -- recorded traces --------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_measured(path: Path) -> list[dict]:
    """A trace's meta line and its samples whose units ran alone: a periodic profile rescales
    the units measured at the Plan's first step by each stage's busy time in its own step
    (``units`` = "rescaled", `dynjax.parallel.profile.rescaled_units`), and on 8 fake devices
    sharing 2 cores that inflates the first stage's layers up to 10x (the sparse-attention
    runs). Traces recorded before ``units`` was kept (MoE, MoD) keep every sample."""
    meta, *samples = read_jsonl(path)
    return [meta, *(s for s in samples if s.get("units", "measured") == "measured")]


def copies(x: np.ndarray | list, repeat: int, tiled: bool) -> np.ndarray:
    """Each entry ``repeat`` times in a row, or (``tiled``) the whole sequence ``repeat`` times."""
    return np.tile(x, repeat) if tiled else np.repeat(x, repeat)


def measured_layers(sample: dict, meta: dict, repeat: int = 1, tiled: bool = False) -> Layers:
    """One profiled step of a trace in seconds and bytes: the embedding's times and state in the
    first layer and the head's (norm, head, loss) in the last, whose stages run them (as
    ``Rebalance``). ``repeat`` r > 1 stands every measured layer for r consecutive copies of itself
    (times and state bytes; the embedding stays with the first copy of layer 0 and the head with
    the last copy of the last layer), a deeper model extrapolated from the measured one;
    ``tiled`` stacks the whole measured model r times instead, so layer kinds that alternate
    (MoE and dense, routed and full blocks) keep alternating."""
    fwd = np.array(sample["layer_forward_seconds"], dtype=float)
    bwd = np.array(sample["layer_backward_seconds"], dtype=float)
    memory = np.array(sample["layer_state_bytes"], dtype=float)
    # ``record``'s state model: the embedding's parameters, Adam moments and (when layer 0
    # trains) gradients; the norm + head's parameters, moments and gradients (always trained).
    embed, head = meta["embed_param_bytes"], meta["head_param_bytes"]
    ends = {0: embed * (1 + ADAM_MOMENTS + (0 not in sample["frozen_layers"])),
            -1: head * (2 + ADAM_MOMENTS)}
    for layer, extra in ends.items():
        memory[layer] -= extra
    fwd, bwd, memory = (copies(x, repeat, tiled) for x in (fwd, bwd, memory))
    for (key, layer), extra in zip((("embed_seconds", 0), ("head_seconds", -1)), ends.values(),
                                   strict=True):
        fwd[layer] += sample[key][0]
        bwd[layer] += sample[key][1]
        memory[layer] += extra
    return Layers(fwd, bwd, memory)


def deep_setting(name: str) -> tuple[int, int]:
    """(layers, stages) of the paper's setting for a case: its synthetic row's (seed 000 Fig. 3:
    16-way pipelines for MoE and MoD, 24-way for the others)."""
    return next((c.layers, c.stages) for c in synthetic_cases() if c.name == name)


def recorded_case(path: Path, *, smooth: bool = False, layers: int = 0, stages: int = 0,
                  tiled: bool = False) -> Case:
    """A case from a trace written by ``record``: one sample per profiled step of the run.

    ``smooth``: every sample's times become the element-wise median over the samples of its
    Plan (what the run measured, less the timing noise of a shared CPU). ``layers`` and
    ``stages`` (0: the run's) extrapolate the run to a deeper pipeline: every measured layer
    stands for ``layers / num_layers`` consecutive copies (``tiled``: the model stacked that many
    times; `measured_layers`), on M = 4 x ``stages`` microbatches as the synthetic rows; the
    copies share their layer's measured noise.
    A ``<case>.dense.jsonl`` beside the trace (a run of the same model without the dynamism)
    becomes the "x dense" baseline."""
    meta, *samples = read_measured(path)
    num_layers = layers or meta["num_layers"]
    repeat, rest = divmod(num_layers, meta["num_layers"])
    if rest or repeat < 1:
        raise ValueError(f"{path}: {num_layers} layers is no multiple of the run's "
                         f"{meta['num_layers']}")
    deep = num_layers != meta["num_layers"] or stages not in (0, len(meta["stage_layers"]))
    steps = tuple(s["step"] for s in samples)
    measured = {s["step"]: measured_layers(s, meta) for s in samples}
    layers_at = {s["step"]: measured_layers(s, meta, repeat, tiled) for s in samples}
    if smooth:
        for plan in {s["plan"] for s in samples}:
            group = [layers_at[s["step"]] for s in samples if s["plan"] == plan]
            fwd = np.median([g.fwd for g in group], axis=0)
            bwd = np.median([g.bwd for g in group], axis=0)
            for s in samples:
                if s["plan"] == plan:
                    layers_at[s["step"]] = Layers(fwd, bwd, layers_at[s["step"]].memory)
    first = samples[0]["plan"]
    dense_steps = tuple(s["step"] for s in samples if s["plan"] == first)
    # The unit: the median measured layer forward (no embedding, head) before the first change.
    unit = float(np.median([measured[t].fwd[1:-1] for t in dense_steps]))
    scaled = {t: Layers(v.fwd / unit, v.bwd / unit, v.memory) for t, v in layers_at.items()}
    changes = tuple(s["step"] for i, s in enumerate(samples)
                    if i == 0 or s["plan"] != samples[i - 1]["plan"])
    ends = steps[1:] + (meta["steps"] + 1,)
    dense_path = path.with_name(path.stem + ".dense.jsonl")
    dense_samples = ()
    if dense_path.is_file():
        dense_meta, *dense_runs = read_measured(dense_path)
        dense_samples = tuple(
            Layers(v.fwd / unit, v.bwd / unit, v.memory)
            for v in (measured_layers(s, dense_meta, repeat, tiled) for s in dense_runs))
    name = meta["case"]
    paper, baseline = PAPER.get(name, (float("nan"), "-"))
    weights = tuple(float(e - t) for t, e in zip(steps, ends, strict=True))
    timed = [(imbalance(s["stage_seconds"]), w)  # profiles whose timeline measured something
             for s, w in zip(samples, weights, strict=True) if s["stage_seconds"] is not None]
    shape = f"{num_layers}x{stages}" + (" tiled" if tiled else "")
    variant = ", ".join(v for v, on in ((shape, deep),
                                        ("Plan medians", smooth)) if on)
    return Case(
        name, num_layers, stages if deep else len(meta["stage_layers"]), 0, paper, baseline,
        scaled.__getitem__, scaled[dense_steps[0]],
        source=f"(recorded: {meta['source']}, {meta['devices']})", steps=steps,
        weights=weights, params=tuple(copies(meta["layer_params"], repeat, tiled).tolist()),
        micro=0 if deep else meta["microbatches"], changes=changes,
        dense_steps=dense_steps, unit_seconds=unit,
        timeline_imbalance=float(np.average([i for i, _ in timed], weights=[w for _, w in timed]))
        if timed else np.nan,
        variant=variant, dense_samples=dense_samples, extrapolated=deep,
    )


def record(workdir: Path, out: Path, case: str, devices: str, command: str = "",
           note: str = "") -> None:
    """Copy a run's trace into ``out``: its profiled ``layer_costs.jsonl`` lines (a run without
    plugins writes none: its ``profile`` events alone, at cost 1) joined with their ``profile``
    events (embedding and head times, the measured step timeline as per-stage F + B seconds) and
    the Plan each ran, plus per-layer parameter counts and state bytes.

    The state bytes model (parameters, Adam's two moments, a gradient accumulator for trainable
    layers, pruning's one-byte keep masks in the optimizer state for the matrices
    ``pruning.include`` selects, the embedding with layer 0 and norm + head with the last) is
    checked against the stage memory each profile measured: a scheme that stores its layers
    otherwise (e.g. pruned layers in a sparse format) fails here until this model learns it.
    """
    import jax  # the recorder builds the model's shapes; the benchmark itself needs no JAX
    import ml_collections

    from dynjax.config import default_config, gpt_config
    from dynjax.model import abstract_params

    # Keys added since the run count with their defaults (what that run did), as on resume.
    saved = json.loads((workdir / "config.json").read_text())
    cfg = default_config()
    cfg.update(ml_collections.ConfigDict(saved))
    num_layers = cfg.model.num_layers
    shapes = abstract_params(gpt_config(cfg))
    # FSDP (absent from runs before it: replicated) splits an array over the data devices when
    # one of its axes divides (`dynjax.parallel.mesh.param_shardings`); bytes are per device.
    data = cfg.mesh.data if saved.get("parallel", {}).get("fsdp", False) else 1

    def per_device(shape, itemsize):
        n = int(np.prod(shape)) * itemsize
        return n // data if data > 1 and any(d % data == 0 for d in shape) else n

    def count(tree, nbytes=False):
        leaves = jax.tree.leaves(tree)
        if nbytes:
            return sum(per_device(a.shape, a.dtype.itemsize) for a in leaves)
        return sum(int(np.prod(a.shape)) for a in leaves)

    layer_params = [count(shapes["layers"][i]) for i in range(num_layers)]
    layer_bytes = [count(shapes["layers"][i], True) for i in range(num_layers)]
    embed_bytes = sum(count(shapes[k], True) for k in ("embed", "pos") if k in shapes)
    head_bytes = sum(count(shapes[k], True) for k in ("norm", "head") if k in shapes)
    mask_bytes = [0] * num_layers  # pruning.masked: a bool per prunable weight, dense
    if cfg.get("pruning", {}).get("enabled", False):
        from dynjax.dynamism.pruning_math import prunable_leaves

        for name, leaf in prunable_leaves(shapes, cfg.pruning.include).items():
            mask_bytes[int(name.split("/")[1])] += per_device(leaf.shape, 1)

    events = read_jsonl(workdir / "events.jsonl")
    plans = [(0, e["plan"]) for e in events if e["event"] == "compile"]
    plans += [(e["swap_step"], e["plan"]) for e in events if e["event"] == "recompile"]
    profiles = [e for e in events if e["event"] == "profile"]

    def plan_at(step: int) -> int:
        return max(i for i, (swap, _) in enumerate(plans) if swap <= step)

    def state_bytes(frozen: set[int]) -> list[int]:
        out = []
        for i, b in enumerate(layer_bytes):
            extra = embed_bytes if i == 0 else head_bytes if i == num_layers - 1 else 0
            grads = (b + (embed_bytes if i == 0 else 0)) * (i not in frozen)
            grads += head_bytes if i == num_layers - 1 else 0
            out.append((b + extra) * (1 + ADAM_MOMENTS) + grads + mask_bytes[i])
        return out

    samples = []
    costs = workdir / "layer_costs.jsonl"
    if costs.is_file():
        lines = [line for line in read_jsonl(costs) if "layer_forward_seconds" in line]
    else:  # a run without plugins (the dense baseline) writes none: every profile, at cost 1
        lines = [{"step": p["step"] + 1, "layer_cost": [1.0] * num_layers,
                  **{k: p[k] for k in ("layer_forward_seconds", "layer_backward_seconds")}}
                 for p in profiles]
    for line in lines:
        # The profile of loop step s is layer_costs' step s + 1; its unit times must be the
        # line's (a profile whose timeline measured nothing keeps the times before it, so two
        # profiles may hold equal times: the step tells them apart).
        match = [p for p in profiles if p["step"] + 1 == line["step"]
                 and p["layer_forward_seconds"] == line["layer_forward_seconds"]
                 and p["layer_backward_seconds"] == line["layer_backward_seconds"]]
        if not match:
            raise ValueError(f"step {line['step']}: no profile event matches")
        profile = match[-1]  # a step trained again after a resume: the later one
        index = plan_at(profile["step"])
        plan = plans[index][1]
        frozen = set(plan.get("frozen_layers", ()))
        memory = state_bytes(frozen)
        bounds = np.cumsum([0, *plan["stage_layers"]])
        for s, m in enumerate(profile["stage_memory_bytes"]):
            measured = m["params"] + m["opt_state"] + m["grad_accumulator"]
            modelled = sum(memory[bounds[s]:bounds[s + 1]])
            if abs(measured - modelled) > 1e-3 * measured:
                raise ValueError(f"step {line['step']} stage {s}: state bytes measured "
                                 f"{measured}, modelled {modelled}")
        stage_seconds = None if profile["timeline"] is None else [  # None: measured nothing
            float(np.mean([t[3] - t[2] for t in tasks if t[0] == "F"])
                  + np.mean([t[3] - t[2] for t in tasks if t[0] == "B"] or [0.0]))
            for tasks in profile["timeline"]
        ]
        rounded = lambda xs: [round(float(x), 7) for x in xs]  # noqa: E731
        samples.append({
            "step": line["step"],
            "plan": index,
            "stage_layers": list(plan["stage_layers"]),
            "frozen_layers": sorted(frozen),
            "layer_cost": [round(c, 4) for c in line["layer_cost"]],
            "layer_forward_seconds": rounded(line["layer_forward_seconds"]),
            "layer_backward_seconds": rounded(line["layer_backward_seconds"]),
            "embed_seconds": rounded(profile["embed_seconds"]),
            "head_seconds": rounded(profile["head_seconds"]),
            "layer_state_bytes": memory,
            "stage_seconds": stage_seconds and rounded(stage_seconds),
            "iteration_seconds": None if stage_seconds is None
            else round(profile["iteration_seconds"], 5),
            "units": profile.get("units", "measured"),  # "rescaled": from the step's timeline
        })
    first = plans[0][1]
    cpu = "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in
                   Path("/proc/cpuinfo").read_text().splitlines() if "model name" in line)
    except (OSError, StopIteration):
        pass
    config_path = re.search(r"--config[ =](\S+)", command)
    meta = {
        "case": case,
        "source": config_path.group(1) if config_path else f"configs/{case}.py",
        "devices": devices,
        "command": command,
        "recorded": date.today().isoformat(),
        "machine": f"{cpu}, {os.cpu_count()} cores{', ' + note if note else ''}",
        "steps": cfg.train.steps,
        "num_layers": num_layers,
        "stage_layers": list(first["stage_layers"]),
        "microbatches": first["microbatches"],
        "schedule": first["schedule"],
        "balance": bool(cfg.balance.enabled),
        "layer_params": layer_params,
        "layer_param_bytes": layer_bytes,
        "embed_param_bytes": embed_bytes,
        "head_param_bytes": head_bytes,
        "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in [meta, *samples]))
    print(f"{out}: {len(samples)} profiled steps, {len(plans)} Plans, {out.stat().st_size:,} bytes")


# -- the simulation -----------------------------------------------------------------------------


def profile_at(case: Case, t: int) -> Layers:
    """What the monitor reports at iteration ``t``: that iteration's costs, or for per-iteration
    rebalancing the mean of the last ``PROFILE_WINDOW`` iterations (timings are noisy)."""
    if case.every != 1:
        return case.trace(t)
    window = [case.trace(i) for i in range(max(t - PROFILE_WINDOW + 1, 0), t + 1)]
    return Layers(*(np.mean([getattr(w, f) for w in window], axis=0)
                    for f in ("fwd", "bwd", "memory")))


def decision_at(case: Case, t: int) -> int | None:
    """The iteration whose profile the layout in force at ``t`` was chosen from (None: none yet)."""
    if case.every == 0:
        past = [c for c in case.changes if c < t]
        return past[-1] if past else None
    at = t - 1 if case.every == 1 else (t // case.every) * case.every
    return at if at >= 0 else None


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


def run(case: Case) -> dict:
    micro = case.micro or 4 * case.stages
    static = uniform(case.layers, case.stages)
    params = np.array(case.params) if case.params else np.ones(case.layers)
    by_params = by_param(params, case.stages)
    capacity = CAPACITY_FACTOR * case.dense.memory.sum() / case.stages
    layouts = {"partition": static, "diffusion": static, "re-packed": static}
    times: dict[str, list[float]] = {k: [] for k in ("static", "by-param", "dense", *layouts)}
    imb: dict[str, list[float]] = {"static": [], "partition": []}
    gpus: list[int] = []
    decisions: list[tuple[int, dict[str, tuple[int, ...]]]] = []
    last = None
    weights = case.weights or (1.0,) * len(case.steps)
    entries = []  # (sample, step it starts at, steps it stands for)
    for t, w in zip(case.steps, weights, strict=True):
        if case.every == 0 and t in case.changes and w > 1:  # a layout decided on t's profile
            entries += [(t, t, 1.0), (t, t + 1, w - 1.0)]  # holds from the next step on
        else:
            entries.append((t, t, w))
    for t, start, _ in entries:
        rebalance_at = decision_at(case, start)
        if rebalance_at is not None and rebalance_at != last:
            last = rebalance_at
            profile = profile_at(case, rebalance_at)
            kw = dict(memory=profile.memory, capacity=capacity)
            layouts["partition"] = partition(profile.time, case.stages,
                                             current=layouts["partition"], **kw)
            layouts["diffusion"] = diffusion(profile.time, layouts["diffusion"], **kw)
            layouts["re-packed"] = repacked(profile, layouts["partition"], capacity, micro)
            decisions.append((rebalance_at, dict(layouts)))
        now = case.trace(t)
        times["static"].append(iteration_time(now, static, micro))
        times["by-param"].append(iteration_time(now, by_params, micro))
        times["dense"].append(iteration_time(case.dense, static, micro))
        for name, layout in layouts.items():
            times[name].append(iteration_time(now, layout, micro))
        for name, layout in (("static", static), ("partition", layouts["partition"])):
            imb[name].append(imbalance(stage_costs(now.time, layout)))
        gpus.append(len(layouts["re-packed"]))
    weights = np.array([w for _, _, w in entries])
    out: dict = {name: float(np.average(v, weights=weights)) for name, v in times.items()}
    if case.dense_samples:  # recorded: a short run without the dynamism (median: its noise)
        out["dense"] = float(np.median([iteration_time(d, static, micro)
                                        for d in case.dense_samples]))
    elif case.dense_steps:  # recorded: the run's own samples before the first change
        before = np.isin([t for t, _, _ in entries], case.dense_steps)
        out["dense"] = float(np.average(np.array(times["static"])[before],
                                        weights=weights[before]))
    out["gpus"] = float(np.average(gpus, weights=weights))
    for name, v in imb.items():
        out[f"imbalance {name}"] = float(np.average(v, weights=weights))
    out["by-param layout"] = by_params
    out["decisions"] = decisions
    return out


def synthetic_cases() -> list[Case]:
    return [moe(), pruning(), freezing(), sparse_attention(), early_exit(), mixture_of_depths()]


def cases_with_traces(traces: Path = TRACES, deep: bool = True,
                      tiled: bool = False) -> list[Case]:
    """Every case: from its recorded trace where ``traces`` has ``<case>.jsonl`` (plus a
    per-Plan-median row and, with ``deep``, both extrapolated to the paper's depth and stages,
    `deep_setting`), recorded ones first; else synthetic."""
    recorded, synthetic = [], []
    for case in synthetic_cases():
        path = traces / f"{case.name.replace(' ', '_')}.jsonl"
        if not path.is_file():
            synthetic.append(case)
            continue
        recorded += [recorded_case(path), recorded_case(path, smooth=True)]
        if deep:
            kw = dict(layers=case.layers, stages=case.stages, tiled=tiled)
            recorded += [recorded_case(path, **kw), recorded_case(path, smooth=True, **kw)]
    return recorded + synthetic


def read_overheads(path: Path = OVERHEADS) -> dict[str, dict]:
    """``balance_overhead.py --record``'s measurements by case (the newest line of each)."""
    return {r["case"]: r for r in read_jsonl(path)} if path.is_file() else {}


def cadence(name: str) -> int:
    """Steps between a case's profiles: its synthetic row's rebalance period, the paper's
    (seed 000 §3.3.1, Fig. 3); `benchmarks/balance_overhead.py` prints the same."""
    return next(c.every for c in synthetic_cases() if c.name == name)


PlanSwap = tuple[bool, tuple[int, ...]]  # (layers moved, the layers whose cost changed)


def swaps(name: str, traces: Path = TRACES) -> tuple[list[PlanSwap], int]:
    """Each Plan swap of the case's recorded run, and its steps: whether it moved layers, and
    the layers whose cost it changed (a capacity, budget or bucket: a Plan's sizes give its
    layers' costs, seed 000 §2). The first profile after a swap runs alone the units it made
    new (`dynjax.train`'s ``profile_on_change``, `dynjax.parallel.profile.unit_seconds`); ([],
    0) without a trace."""
    path = traces / f"{name.replace(' ', '_')}.jsonl"
    if not path.is_file():
        return [], 0
    meta, *samples = read_jsonl(path)
    out = []
    for a, b in zip(samples, samples[1:], strict=False):
        if a["plan"] != b["plan"]:
            changed = tuple(i for i, (x, y) in enumerate(
                zip(a["layer_cost"], b["layer_cost"], strict=True)) if not np.isclose(x, y))
            out.append((a["stage_layers"] != b["stage_layers"], changed))
    return out, meta["steps"]


def resize_key(layers: tuple[int, ...]) -> str:
    """A resize's key in a record's ``resize_units_seconds``: its layers, or "all" for a swap
    that moved nothing and changed no layer's cost (e.g. early exits turned on: every exit
    layer's program changes)."""
    return ",".join(map(str, layers)) or "all"


def resizes(plan_swaps: list[PlanSwap]) -> list[str]:
    """The `resize_key`s of the swaps that changed layers' sizes (or, moving nothing, the
    model)."""
    return [resize_key(layers) for moved, layers in plan_swaps if layers or not moved]


def swap_seconds(r: dict, plan_swaps: list[PlanSwap]) -> float | None:
    """Seconds the profiles after ``plan_swaps`` add to a run, from a
    `benchmarks/balance_overhead.py` record ``r``: the profile after a move
    (``move_units_seconds``) plus, where the swap changed sizes, the profile after resizing
    those layers (``resize_units_seconds`` by `resize_key`). Records from before units kept
    their times across Plans hold one profile that runs every unit alone
    (``units_alone_seconds``), what each swap then cost. None where a swap that happened has
    no measurement."""
    if "units_alone_seconds" in r:
        return len(plan_swaps) * r["units_alone_seconds"]
    moves = sum(moved for moved, _ in plan_swaps)
    if moves and "move_units_seconds" not in r:
        return None
    measured = r.get("resize_units_seconds", {})
    keys = resizes(plan_swaps)
    if any(key not in measured for key in keys):
        return None
    return moves * r.get("move_units_seconds", 0.0) + sum(measured[key] for key in keys)


def overhead(name: str, measured: dict[str, dict], key: str = "profile_seconds",
             base: str = "plain_step_seconds", fmt: str = ".1%") -> str:
    """Profiling's share of training time at the case's `cadence`: one profile's extra
    seconds (``key``: periodic, rescaled from the step's timeline; or ``profile_cpu_seconds``,
    process CPU against ``base`` ``plain_step_cpu_seconds``) per ``every`` plain steps; for
    ``swaps``, the profiles after the Plan swaps of the recorded run (`swaps`, `swap_seconds`)
    over its steps instead; "-" if unmeasured."""
    r = measured.get(name, {})
    if key == "swaps":
        plan_swaps, steps = swaps(name)
        seconds = swap_seconds(r, plan_swaps) if r else None
        return f"{seconds / (steps * r[base]):{fmt}}" if steps and seconds is not None else "-"
    if key not in r:
        return "-"
    return f"{r[key] / (cadence(name) * r[base]):{fmt}}"


def label(case: Case) -> str:
    """A row's name: the case, or indented under it how the row treats the case's trace."""
    return f"  {case.variant}" if case.variant else case.name


def table(cases: list[Case], results: list[dict], header: str,
          row: Callable[[Case, dict], str]) -> None:
    print(header)
    print("-" * len(header))
    group = None
    for case, r in zip(cases, results, strict=True):
        if case.source != group:
            group = case.source
            print(group)
        print(f"{label(case):<27}" + row(case, r))


def main(deep: bool = True, tiled: bool = False) -> None:
    cases = cases_with_traces(deep=deep, tiled=tiled)
    results = [run(case) for case in cases]
    overheads = read_overheads()
    say = lambda text: print(textwrap.fill(text, 100) + "\n")  # noqa: E731
    say("DynMo cases through the pipeline simulator. Recorded rows: measured per-layer times of "
        "a dynjax run (benchmarks/traces/); synthetic rows: seed 000 §2 load models. Rows "
        "named L x S EXTRAPOLATE a recorded run to the paper's depth: each measured layer stands "
        "for L / n consecutive copies (n: the run's layers), on S stages (copies share their "
        "layer's measured noise; M = 4 x S and per-hop transfers as the synthetic rows).")
    say(f"Time-averaged simulated 1F1B iteration time, unit = one dense layer forward "
        f"(synthetic: {ITERATIONS:,} iterations sampled every {SAMPLE_EVERY}, M = 4 x S; "
        "recorded: every profiled step, the run's M; L x S rows: M = 4 x S):")
    rebal = lambda c: {0: "on Plan", 1: "1 it"}.get(c.every, c.every)  # noqa: E731
    table(cases, results,
          f"{'':<27}{'L x S':>6}{'rebal.':>8}{'static':>8}{'by-param':>9}{'partition':>10}"
          f"{'diffusion':>10}{'re-packed':>10}{'GPUs':>5}",
          lambda c, r: (
              f"{f'{c.layers}x{c.stages}':>6}{rebal(c):>8}"
              f"{r['static']:>8.1f}{r['by-param']:>9.1f}{r['partition']:>10.1f}"
              f"{r['diffusion']:>10.1f}{r['re-packed']:>10.1f}{r['gpus']:>5.1f}"))
    print()
    say("Speedup over the best static layout (uniform or by-param); best = best static / best of "
        "partition and diffusion (the paper's definition, seed 000 Fig. 3); imbalance (eq. 2) "
        "static uniform -> partition; ovh = one periodic profile (rescaled from its step's "
        "timeline) per the case's cadence, cpu = the same in process CPU time, swaps = the "
        "profiles after the recorded run's Plan swaps, each running alone the units its swap "
        "made new, over its steps (benchmarks/balance_overhead.py):")

    def speedups(c: Case, r: dict) -> str:
        best = min(r["static"], r["by-param"])
        return (f"{best / r['partition']:>6.2f}x{best / r['diffusion']:>6.2f}x"
                f"{best / r['re-packed']:>8.2f}x"
                f"{best / min(r['partition'], r['diffusion']):>6.2f}x{c.paper:>6.2f}x"
                + (f"{r['dense'] / r['partition']:>6.2f}x{'*' if c.unit_seconds else ' '}"
                   if c.name in DENSE_BASELINE else f"{'-':>7} ")
                + f"{r['imbalance static']:>5.2f}->{r['imbalance partition']:<4.2f}"
                f"{overhead(c.name, overheads, fmt='.0%'):>5}"
                f"{overhead(c.name, overheads, 'profile_cpu_seconds', 'plain_step_cpu_seconds'):>6}"
                f"{overhead(c.name, overheads, 'swaps'):>6}")

    table(cases, results,
          f"{'':<27}{'x part':>7}{'x diff':>7}{'x repack':>9}{'best':>7}{'paper':>7}"
          f"{'x dense':>8}{'imbalance':>11}{'ovh':>5}{'cpu':>6}{'swaps':>6}", speedups)
    print()
    say("The paper's baselines: " + "; ".join(f"{name}: {base}" for name, (_, base)
                                              in PAPER.items()) + ".")
    notes = []
    for case, r in zip(cases, results, strict=True):
        if not case.unit_seconds or case.extrapolated:  # L x S rows: layouts too long to list
            continue
        chosen = []
        for t, d in r["decisions"]:
            kinds = {}
            for kind, layout in d.items():
                kinds.setdefault("(" + ",".join(map(str, layout)) + ")", []).append(kind)
            chosen.append(f"step {t}: " + ", ".join(
                f"{layout} {'all' if len(k) == len(d) else '+'.join(k)}"
                for layout, k in kinds.items()))
        row = ", ".join(filter(None, (case.name, case.variant)))
        note = f"{row}: layouts chosen at " + "; ".join(chosen) + "."
        if not case.variant:
            note = (f"{row}: unit = {1e3 * case.unit_seconds:.2f} ms, "
                    f"{len(case.steps)} profiled steps, M = {case.micro}, by-param "
                    f"{list(r['by-param layout'])}, imbalance of the uniform layout from the "
                    f"run's step timeline {case.timeline_imbalance:.2f}; " + note.split(": ", 1)[1])
        notes.append(note)
    if notes:
        say("* recorded: the baseline ran at another time of a shared CPU (unpaired): the "
            "samples before the first change, or a run without the dynamism where "
            "traces/<case>.dense.jsonl exists.")
    for name, r in overheads.items():
        notes.append(
            f"{name} overhead ({r['recorded']}, {r['setting']}): plain step "
            f"{1e3 * r['plain_step_seconds']:.1f} ms; extra per profile rescaled from the "
            f"timeline {1e3 * r['profile_seconds']:.1f} ms, "
            + (f"every unit run alone {1e3 * r['units_alone_seconds']:.1f} ms"
               if "units_alone_seconds" in r else
               "after a swap (the units it made new run alone) " + ", ".join(
                   [f"{1e3 * r['move_units_seconds']:.1f} ms (a move)"]
                   + [f"{1e3 * t:.1f} ms "
                      f"({'every sized layer' if key == 'all' else 'layers ' + key} resized)"
                      for key, t in r.get("resize_units_seconds", {}).items()]))
            + "; decision "
            f"{1e3 * r['decision_seconds']:.2f} ms; migration {1e3 * r['migration_seconds']:.0f}"
            f" ms per move" + (
                f"; process CPU per plain step {1e3 * r['plain_step_cpu_seconds']:.1f} ms, extra "
                f"per periodic profile {1e3 * r['profile_cpu_seconds']:.1f} ms; training thread "
                f"CPU extra per periodic profile {1e3 * r['profile_thread_seconds']:.2f} ms; "
                + (f"watcher threads' CPU per periodic profile "
                   f"{1e3 * r['watcher_cpu_seconds']:.2f} ms; " if "watcher_cpu_seconds" in r
                   else "")
                + "stage busy time of the periodic profiles' timelines / the waited-for ones: "
                + " ".join(f"{x:.2f}" for x in r["busy_ratio"])
                if "profile_cpu_seconds" in r else "") + ".")
    for note in notes:
        say(note)
    say("Measured on a 2-stage pipeline whose stages run at the same time, one process pinned to "
        "a core each (benchmarks/real_pipeline.py --case NAME --json, in "
        "benchmarks/results/real_pipeline/): the static uniform and the balanced layout, "
        "tokens/s of each, the measured speedup, the simulator's from the profiled layer times "
        "alone and with a per-task overhead calibrated on the static run, the ideal bound and "
        "the paper's figure (16 or 24 stages, GPUs):")
    print(f"{'':<18}{'layouts':>12}{'static':>10}{'balanced':>10}{'measured':>10}"
          f"{'simul.':>9}{'calib.':>9}{'bound':>8}{'paper':>8}")
    for row in measured_rows():
        print(row)


def measured_rows(results: Path = MEASURED) -> list[str]:
    """One line per case `real_pipeline.py` measured on two pinned stages (its JSON in
    ``results``): layouts, tokens/s, the measured speedup of the balanced layout beside the
    simulator's (compute only, and with the per-task overhead calibrated on the static run),
    the ideal bound and the paper's figure."""
    rows = []
    for case, name in MEASURED_NAMES.items():
        path = results / f"{case}.json"
        if not path.exists():
            rows.append(f"{name:<18} not measured")
            continue
        r = json.loads(path.read_text())
        layouts = "/".join(",".join(map(str, r[k])) for k in ("static_layout", "balanced_layout"))
        calibrated = r.get("calibrated_speedup", float("nan"))
        rows.append(
            f"{name:<18}{layouts:>12}{r['static_tokens_per_sec']:>10,.0f}"
            f"{r['balanced_tokens_per_sec']:>10,.0f}{r['measured_speedup']:>9.2f}x"
            f"{r['predicted_speedup']:>8.2f}x{calibrated:>8.2f}x{r['bound_speedup']:>7.2f}x"
            f"{PAPER[name][0]:>7.2f}x"
        )
    return rows


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    rec = sub.add_parser("record", help="copy a run's trace into benchmarks/traces/")
    rec.add_argument("workdir", type=Path)
    rec.add_argument("out", type=Path)
    rec.add_argument("--case", required=True, help="the row it replaces, e.g. freezing")
    rec.add_argument("--devices", required=True, help='e.g. "4x2 fake CPU devices"')
    rec.add_argument("--run-command", default="", help="the dynjax.train command that ran")
    rec.add_argument("--note", default="", help="about the machine, e.g. shared cores")
    parser.add_argument("--no-deep", action="store_true",
                        help="leave out the L x S extrapolations of the recorded runs (faster)")
    parser.add_argument("--tiled", action="store_true",
                        help="extrapolate by stacking the measured model, not copying each layer")
    args = parser.parse_args()
    if args.command == "record":
        record(args.workdir, args.out, args.case, args.devices, args.run_command, args.note)
    else:
        main(deep=not args.no_deep, tiled=args.tiled)


if __name__ == "__main__":
    cli()
