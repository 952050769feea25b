"""DynMo's speedup measured on a pipeline whose two stages have a core each.

Each stage is one process pinned to its own core (``python -m dynjax.launch.local --processes 2
--pin-cores``: XLA:CPU single-threaded, one core per process), so wall time can show what the
simulator of `dynjax.balance` only predicts elsewhere: a stage left idle by a slower one. The
stages overlap as 1F1B allows (``--parallel-check`` below; docs/benchmarks.md "Stages on cores
of their own").

``--case NAME`` takes one of DynMo's six dynamic models (`CASES`: each case's config file with
16 narrow layers and its dynamism made strong and early enough to matter in a short run) and
trains it, in interleaved rounds (the machine is shared, so both layouts see the same load):

* **static**: the uniform layout (Megatron-LM), 8 + 8 layers;
* **balanced**: the layout dynjax's balancer picks for this model: `dynjax.balance.partition` of
  the per-layer forward + backward seconds (embedding counted in the first layer, head in the
  last, as `Rebalance` does) of the newest profile the first static run took after its dynamism
  settled (the first step of every Plan is profiled). It runs fixed from step 0, not switched
  to by a rebalance mid-run: a run switching layouts would put the background compile and the
  migration into the measured window; their cost is what ``benchmarks/balance_overhead.py``
  measures. Both runs go through the same dynamism (pruning events, freezes, bucket shrinks);
  only the layout differs.
* with ``--refine N``, round 0 goes on: up to N more runs, each of the layout `partition` picks
  from the previous balanced run's own settled profile, until one keeps its layout; the
  in-loop balancer decides again every ``balance.every`` steps from fresh layer times the same
  way. Later rounds and the figures take the last layout; the earlier ones are listed with
  their tokens/s, since a later profile can misjudge too (docs/benchmarks.md "Stages on cores
  of their own").

Throughput is the median tokens/s of the steps after the run's last Plan swap and last profile
(`steady_tokens_per_sec`), so compiles, swaps and profiled steps are left out. Printed per case:
tokens/s of each layout (per round and median), the measured speedup (median of the rounds'
balanced / static ratios), the simulator's predicted speedup (`dynjax.balance.simulate` of both
layouts from the same profile's layer times and the run's schedule and microbatches), the
simulated and measured step seconds, and the ideal bound: the static layout's slowest stage
over total work / stages, all that a re-layout could gain. The profile times each layer's
compute alone; a step also pays each task's host dispatch and cross-process transfer and the
update, which on these small models is most of a step. So the simulator is also given a
per-task overhead calibrated on the static run (`task_overhead`: the seconds per task that make
its simulated step the measured one) and predicts the balanced run's step with it, a layout it
was not calibrated on: that prediction against the measured balanced step is the simulator's
check. ``--json FILE`` writes
``static_tokens_per_sec``, ``balanced_tokens_per_sec``, ``measured_speedup``,
``predicted_speedup``, ``bound_speedup`` (and the layouts and per-round figures).

    PYTHONPATH=. python3 benchmarks/real_pipeline.py --case freezing [--json out.json]

``--parallel-check`` shows that the pinned stages run in parallel: the same balanced 2-stage
pipeline (a dense 16-layer model, 8 + 8 layers) on two cores, pinned, and on one core (both
processes on the launcher's first core, XLA:CPU single-threaded alike), interleaved; the
printed ratio is two cores' step seconds over one core's (ideal: (M + 1) / (2 M) for 1F1B on 2
balanced stages with M microbatches, 0.625 at M = 4; 1.0: nothing ran in parallel):

    PYTHONPATH=. python3 benchmarks/real_pipeline.py --parallel-check

``--schedules`` compares the runtime's schedules on that pipeline (issue 33 §2): the same
dense model, uniform layouts, 1F1B on 2 stages (8 + 8 layers) against interleaved 1F1B with 2
chunks per stage (4 logical stages of 4 layers) and against 1F1B whose backward takes its
forward's residuals instead of recomputing it (``pipeline.recompute=False``), and ZB-H1
(recomputing and on residuals), interleaved rounds (``--run NAME`` picks some of them). Printed
per run: tokens/s, step seconds, the bubble of a steady profiled step (each process's idle
share of the step: 1 - the union of its chunks' task intervals over the step's span), the bubble
the simulator predicts from that profile's layer times and the first compile's seconds (a cold
compilation cache):

    PYTHONPATH=. python3 benchmarks/real_pipeline.py --schedules

``--case NAME --trace FILE`` records the case's trace for ``benchmarks/dynmo_cases.py``
(issue 33 §4) instead of measuring: one run of the static layout on the pinned pipeline with a
profile every `TRACE_PROFILE_EVERY` steps, copied into FILE by ``dynmo_cases.py record``; with
``--dense`` the same run with the case's scheme off (the "x dense" baseline,
``<case>.dense.jsonl``):

    PYTHONPATH=. python3 benchmarks/real_pipeline.py --case freezing \
        --trace benchmarks/traces/freezing.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from dynjax.balance import partition, simulate, stage_costs, uniform
from dynjax.launch.local import PIN_XLA_FLAG
from dynjax.writers import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
STAGES = 2

# Every case: 16 narrow layers on 2 stages, 4 microbatches, no checkpoints or evals in the way.
COMMON = {
    "model.num_layers": 16,
    "model.d_model": 128,
    "model.num_heads": 4,
    "model.mlp_dim": 512,
    "mesh.stage": STAGES,
    "train.microbatches": 4,
    "train.log_every": 1,
    "train.eval_every": 100_000,
    "train.checkpoint_every": 100_000,
    "pipeline.profile_on_change": True,
    "balance.enabled": False,
    # The end-of-run checkpoint saved in the foreground, as for the recorded results: a
    # background save of two processes sometimes never finished then (Orbax's directory
    # signals, shared by the processes; `dynjax.checkpoint.manager` no longer uses them).
    "checkpoint.async_save": False,
}
RUN_TIMEOUT = 1800  # seconds one training run may take before the benchmark gives up

# Per case: its config file and what makes its dynamism strong and early (DynMo's settings).
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # 8 experts, top-2, an MoE block in every other layer.
    "moe": ("configs/moe.py", {"moe.every": 2}),
    # Global magnitude pruning to 90% in one event at step 2, block-sparse path below 50% density.
    "pruning": ("configs/pruning.py", {
        "pruning.initial_sparsity": 0.9, "pruning.final_sparsity": 0.9,
        "pruning.start_step": 2, "pruning.every": 1, "pruning.steps": 1,  # steps 2 and 3
        "pruning.granularity": "block", "pruning.block_size": 16, "pruning.sparse_below": 0.5,
    }),
    # The front half of the layers frozen in one decision: Egeria's rule with a threshold every
    # layer meets (each counts as converged after one reference period), capped at half.
    "freezing": ("configs/freezing.py", {
        "freezing.metric": "plasticity", "freezing.threshold": 1e9, "freezing.patience": 1,
        "freezing.reference_every": 4, "freezing.every": 2, "freezing.start_step": 2,
        "freezing.max_fraction": 0.5,
    }),
    # Exit points after every other layer from layer 2; a low confidence threshold from step 2,
    # so most tokens leave in the first half and the later layers' buckets shrink.
    "early_exit": ("configs/early_exit.py", {
        "early_exit.first": 2, "early_exit.every": 2, "early_exit.threshold": 0.02,
        "early_exit.start_step": 2, "early_exit.window": 3, "data.seq_len": 128,
        "train.batch_size": 16,
    }),
    # Every other block computes 1/8 of the tokens.
    "mod": ("configs/mod.py", {"mod.every": 2, "mod.capacity": 0.125, "data.seq_len": 256}),
    # 1,024-token sequences (attention dominates a d_model 64 layer), LSH buckets, budgets per
    # layer shrunk by the policy from a short window.
    "sparse_attention": ("configs/sparse_attention.py", {
        "model.d_model": 64, "model.mlp_dim": 256, "train.batch_size": 4,
        "sparse_attention.window": 3,
    }),
}

DEFAULT_STEPS = 80
# Steps per run where the default does not fit: early exit settles after two background
# recompiles (the exits' start, then the later layers' token buckets); sparse attention's step
# (1,024-token sequences) takes about 6 s on a loaded 2-core machine; its budgets settled by
# step 17 on 2026-11-28, but on 2026-12-07 the policy still decided at step 31 (the run of 32
# steps stopped with an error; 48 measured).
CASE_STEPS = {"early_exit": 140, "sparse_attention": 48}

# The parallel check's model: dense, 8 + 8 identical layers (a balanced pipeline).
DENSE = ("configs/quickstart.py", {})


def overrides(
    case: str, steps: int, layers: int | None, layout: str, extra: dict | None = None
) -> tuple[str, dict]:
    """The case's config file and every override of its runs (``extra``: ``--set``'s, last)."""
    config, own = (DENSE if case == "dense" else CASES[case])
    values = {**COMMON, **own, **(extra or {}), "train.steps": steps,
              "pipeline.stage_layers": layout}
    if layers is not None:
        values["model.num_layers"] = layers
    return config, values


def train_command(config: str, values: dict, workdir: Path, pin: bool) -> list[str]:
    """The launcher's command for a 2-process run of ``config`` with ``values``."""
    launcher = [sys.executable, "-m", "dynjax.launch.local", "--processes", str(STAGES)]
    return [
        *launcher, *(["--pin-cores"] if pin else []), "--",
        "--config", config, "--workdir", str(workdir),
        *(f"--config.{k}={v}" for k, v in values.items()),
    ]


def run(command: list[str], one_core: int | None = None) -> None:
    """Run ``command`` from the repository root; with ``one_core``, every process it starts on
    that core alone (inherited affinity) with XLA:CPU single-threaded, as a pinned process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    preexec = None
    if one_core is not None:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {PIN_XLA_FLAG}".strip()
        preexec = lambda: os.sched_setaffinity(0, {one_core})  # noqa: E731 (no threads here)
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              preexec_fn=preexec, timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"{' '.join(command)} still running after {RUN_TIMEOUT} s") from err
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n"
                           f"{done.stdout[-3000:]}{done.stderr[-3000:]}")


# The dynamism decisions that change the Plan (a recompile swaps each in some steps later).
DECISIONS = ("freeze", "sparse_path", "attention_budget", "early_exit_buckets")


def settled_step(workdir: Path) -> int:
    """The last step a Plan swap or a profile slowed: steps after it are the steady state.
    Raises when a decision's Plan had not been swapped in by the end of the run."""
    events = read_jsonl(workdir / "events.jsonl")
    recompiles = [e for e in events if e.get("event") == "recompile"]
    proposed = max([-1, *(e["step"] for e in recompiles)])
    pending = [e for e in events if e.get("event") in DECISIONS and e["step"] > proposed]
    if pending:
        raise RuntimeError(
            f"{workdir}: the {pending[-1]['event']} decided at step {pending[-1]['step']} was "
            "not swapped in before the run ended: raise --steps"
        )
    swaps = [e["swap_step"] for e in recompiles]
    profiles = [e["step"] for e in events if e.get("event") == "profile"]
    return max([0, *swaps, *profiles])


def steady_tokens_per_sec(workdir: Path) -> float:
    """Median tokens/s of the logged steps after `settled_step` (each logged at its end)."""
    start = settled_step(workdir)
    rates = [
        r["tokens_per_sec"] for r in read_jsonl(workdir / "metrics.jsonl")
        if "tokens_per_sec" in r and r["step"] > start + 1
    ]
    if len(rates) < 3:
        raise RuntimeError(
            f"{workdir}: only {len(rates)} steady steps after step {start} (its last Plan swap "
            "or profile): raise --steps"
        )
    return statistics.median(rates)


def layer_times(workdir: Path) -> tuple[np.ndarray, np.ndarray]:
    """[L] forward and backward seconds per microbatch of the newest profile, the embedding
    in the first layer and the head in the last (`dynjax.recompile.rebalance.layer_times`)."""
    profiles = [e for e in read_jsonl(workdir / "events.jsonl") if e.get("event") == "profile"]
    if not profiles:
        raise RuntimeError(f"{workdir}: no profile event (pipeline.profile_on_change is on)")
    p = profiles[-1]
    fwd = np.array(p["layer_forward_seconds"], float)
    bwd = np.array(p["layer_backward_seconds"], float)
    fwd[0] += p["embed_seconds"][0]
    bwd[0] += p["embed_seconds"][1]
    fwd[-1] += p["head_seconds"][0]
    bwd[-1] += p["head_seconds"][1]
    return fwd, bwd


def simulated_seconds(
    fwd, bwd, layout, microbatches: int, schedule: str, overhead: float = 0.0
) -> float:
    """The simulated step of ``layout`` from per-layer seconds, every task ``overhead`` longer
    (`task_overhead`)."""
    f, b = stage_costs(fwd, layout) + overhead, stage_costs(bwd, layout) + overhead
    return simulate(f, b, microbatches, schedule=schedule).iteration_time


def task_overhead(fwd, bwd, layout, microbatches: int, schedule: str, measured: float) -> float:
    """The seconds ``o`` >= 0 that, added to every task of every stage, make the simulated
    step of ``layout`` take ``measured`` seconds: what a step costs beyond the layers' own
    compute (each task's host dispatch, its transfer to the neighbour process, the update),
    spread over its tasks. Calibrated on one layout, it predicts another (`measure_case`)."""
    step = lambda o: simulated_seconds(fwd, bwd, layout, microbatches, schedule, o)  # noqa: E731
    if step(0.0) >= measured:
        return 0.0
    low, high = 0.0, measured
    for _ in range(60):  # bisection: the simulated step grows with o
        mid = (low + high) / 2
        low, high = (mid, high) if step(mid) < measured else (low, mid)
    return (low + high) / 2


def repartition(workdir: Path, layout: tuple[int, ...]) -> tuple[int, ...]:
    """The layout `partition` picks from the newest profile of a run of ``layout``, the
    smallest move among the optimal ones: what the in-loop balancer decides at its next period
    (`balance.every`) from the run's own fresh layer times, as DynMo re-balances on each
    period's profile (seed 000 §3.3)."""
    fwd, bwd = layer_times(workdir)
    return tuple(int(n) for n in partition(fwd + bwd, STAGES, current=layout))


def measure_case(
    case: str, steps: int, rounds: int, layers: int | None, out: Path,
    extra: dict | None = None, refine: int = 0,
) -> dict:
    """Static against balanced in interleaved rounds. ``refine``: after round 0's balanced run,
    up to that many further runs, each of the layout `repartition` picks from the previous
    balanced run's profile (stopping when it keeps the layout); later rounds and the figures
    take the last layout, the others are listed under ``refinements``."""
    config, values = overrides(case, steps, layers, "", extra)
    num_layers = values["model.num_layers"]
    static = tuple(int(n) for n in uniform(num_layers, STAGES))
    balanced: tuple[int, ...] | None = None
    rows: list[dict[str, float]] = []
    refinements: list[dict[str, Any]] = []

    def timed_run(name: str, r: int, layout: tuple[int, ...]) -> tuple[Path, float]:
        workdir = out / f"{case}-{name}-{r}"
        _, values = overrides(case, steps, layers, ",".join(map(str, layout)), extra)
        run(train_command(config, values, workdir, pin=True))
        rate = steady_tokens_per_sec(workdir)
        print(f"  round {r} {name:<9} {str(layout):<10} {rate:>10,.0f} tokens/s", flush=True)
        return workdir, rate

    for r in range(rounds):
        row: dict[str, float] = {}
        workdir, row["static"] = timed_run("static", r, static)
        if balanced is None:  # the first static run's settled profile decides the layout
            balanced = repartition(workdir, static)
        workdir, row["balanced"] = timed_run("balanced", r, balanced)
        for k in range(refine if r == 0 else 0):
            refined = repartition(workdir, balanced)
            if refined == balanced:
                break
            refinements.append({"layout": list(balanced), "tokens_per_sec": row["balanced"]})
            balanced = refined
            workdir, row["balanced"] = timed_run(f"refined{k + 1}", r, balanced)
        rows.append(row)
    assert balanced is not None
    fwd, bwd = layer_times(out / f"{case}-static-0")
    micro, schedule = values["train.microbatches"], "1f1b"
    sim_static = simulated_seconds(fwd, bwd, static, micro, schedule)
    sim_balanced = simulated_seconds(fwd, bwd, balanced, micro, schedule)
    loads = stage_costs(fwd + bwd, static)
    tokens = tokens_per_step(config, values)
    static_rate = statistics.median(r["static"] for r in rows)
    balanced_rate = statistics.median(r["balanced"] for r in rows)
    # The simulator with each task's overhead calibrated on the static run predicts the
    # balanced run's step (a layout it never saw): the check of the simulator.
    o = task_overhead(fwd, bwd, static, micro, schedule, tokens / static_rate)
    measured = statistics.median(r["balanced"] / r["static"] for r in rows)
    bound = float(loads.max() / (loads.sum() / STAGES))
    calibrated_static = simulated_seconds(fwd, bwd, static, micro, schedule, o)
    calibrated_balanced = simulated_seconds(fwd, bwd, balanced, micro, schedule, o)
    return {
        "case": case,
        "layers": num_layers,
        "overrides": dict(extra or {}),
        "static_layout": list(static),
        "balanced_layout": list(balanced),
        "refinements": refinements,
        "rounds": rows,
        "static_tokens_per_sec": static_rate,
        "balanced_tokens_per_sec": balanced_rate,
        "measured_speedup": measured,
        "predicted_speedup": sim_static / sim_balanced,
        "bound_speedup": bound,
        "bound_gain_share": (measured - 1) / (bound - 1) if bound > 1 else None,  # no gain
        "predicted_static_step_seconds": sim_static,
        "predicted_balanced_step_seconds": sim_balanced,
        "measured_static_step_seconds": tokens / static_rate,
        "measured_balanced_step_seconds": tokens / balanced_rate,
        "task_overhead_seconds": o,
        "calibrated_balanced_step_seconds": calibrated_balanced,
        "calibrated_speedup": calibrated_static / calibrated_balanced,
        "load": os.getloadavg()[0],
    }


def parse_sets(items: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` items as overrides, numbers as numbers (the simulator reads
    ``train.microbatches``, the tokens per step ``train.batch_size`` and ``data.seq_len``)."""
    values: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. train.microbatches=8")
        for kind in (int, float):
            try:
                values[key] = kind(text)
                break
            except ValueError:
                continue
        else:
            values[key] = text
    return values


def tokens_per_step(config: str, values: dict) -> int:
    """Batch rows x sequence length of a run of ``config`` with the overrides ``values``."""
    keys = ("train.batch_size", "data.seq_len")
    rows, length = (values.get(k) or _config_value(config, k) for k in keys)
    return int(rows) * int(length)


def _config_value(config: str, dotted: str) -> int:
    """A key of a config file with its defaults (what the run's config.json holds)."""
    from dynjax.config import load_config

    node = load_config(str(ROOT / config), [])
    for part in dotted.split("."):
        node = node[part]
    return int(node)


def parallel_check(steps: int, rounds: int, out: Path) -> dict:
    """Step seconds of the balanced dense pipeline on two pinned cores and on one core."""
    config, values = overrides("dense", steps, None, "")
    batch = tokens_per_step(config, values)
    seconds: dict[str, list[float]] = {"two cores": [], "one core": []}
    for r in range(rounds):
        for name in seconds:
            workdir = out / f"dense-{name.replace(' ', '-')}-{r}"
            pin = name == "two cores"
            run(train_command(config, values, workdir, pin=pin),
                one_core=None if pin else min(os.sched_getaffinity(0)))
            seconds[name].append(batch / steady_tokens_per_sec(workdir))
            print(f"  round {r} {name:<9} {seconds[name][-1]:.4f} s/step", flush=True)
    ratios = [t / o for t, o in zip(seconds["two cores"], seconds["one core"], strict=True)]
    m = values["train.microbatches"]
    return {
        "two_core_step_seconds": statistics.median(seconds["two cores"]),
        "one_core_step_seconds": statistics.median(seconds["one core"]),
        "ratio": statistics.median(ratios),
        "ideal_ratio": (m + 1) / (2 * m),
        "load": os.getloadavg()[0],
    }


# The schedules `--schedules` compares: name -> (pipeline.schedule, pipeline.virtual_stages,
# pipeline.recompute).
SCHEDULE_RUNS = {
    "1f1b": ("1f1b", 1, True),
    "interleaved_1f1b": ("interleaved_1f1b", 2, True),
    "1f1b, no recompute": ("1f1b", 1, False),
    "zb_h1": ("zb_h1", 1, True),
    "zb_h1, no recompute": ("zb_h1", 1, False),
}
PROFILED_AT = 40  # the steady profile of a `--schedules` run (steps after it are timed)


def measured_bubble(workdir: Path) -> float:
    """Idle share of the processes over the newest profiled step: per stage sub-mesh, 1 - the
    union of its (logical) stages' task intervals over the step's span, averaged."""
    profile = [e for e in read_jsonl(workdir / "events.jsonl") if e.get("event") == "profile"][-1]
    timeline = profile["timeline"]
    begin = min(t[2] for stage in timeline for t in stage)
    end = max(t[3] for stage in timeline for t in stage)
    idle = []
    for device in range(STAGES):
        spans = sorted((t[2], t[3]) for s, stage in enumerate(timeline) for t in stage
                       if s % STAGES == device)
        busy, reach = 0.0, begin
        for start, stop in spans:
            busy += max(0.0, stop - max(start, reach))
            reach = max(reach, stop)
        idle.append(1 - busy / (end - begin))
    return float(np.mean(idle))


def first_compile_seconds(workdir: Path) -> float:
    """Lower + compile seconds of the run's first Plan (its first ``compile`` event)."""
    first = next(e for e in read_jsonl(workdir / "events.jsonl") if e.get("event") == "compile")
    return first["lower_seconds"] + first["compile_seconds"]


def schedule_comparison(
    steps: int, rounds: int, layers: int | None, out: Path, names: list[str]
) -> dict:
    """Tokens/s and bubbles of the dense pipeline under ``names`` of `SCHEDULE_RUNS` (1F1B, the
    baseline, first)."""
    chosen = {n: SCHEDULE_RUNS[n] for n in ["1f1b", *(n for n in names if n != "1f1b")]}
    config, values = overrides("dense", steps, layers, "")
    values["pipeline.profile_every"] = PROFILED_AT
    batch = tokens_per_step(config, values)
    m = values["train.microbatches"]
    runs: dict[str, dict[str, list[float]]] = {}
    for r in range(rounds):
        for name, (schedule, v, recompute) in chosen.items():
            workdir = out / f"dense-{name.replace(', ', '-').replace(' ', '-')}-{r}"
            these = {**values, "pipeline.schedule": schedule, "pipeline.virtual_stages": v,
                     "pipeline.recompute": recompute,  # a cold compile: a cache of its own
                     "recompile.cache_dir": workdir / "compilation_cache"}
            run(train_command(config, these, workdir, pin=True))
            fwd, bwd = layer_times(workdir)
            layout = uniform(len(fwd), STAGES * v)
            sim = simulate(stage_costs(fwd, layout), stage_costs(bwd, layout), m,
                           schedule=schedule, virtual_stages=v)
            row = runs.setdefault(name, {k: [] for k in ("tokens_per_sec", "bubble",
                                                         "simulated_bubble", "compile_seconds")})
            row["tokens_per_sec"].append(steady_tokens_per_sec(workdir))
            row["bubble"].append(measured_bubble(workdir))
            row["simulated_bubble"].append(sim.bubble_ratio)
            row["compile_seconds"].append(first_compile_seconds(workdir))
            print(f"  round {r} {name:<18} {row['tokens_per_sec'][-1]:,.0f} tokens/s, "
                  f"bubble {row['bubble'][-1]:.1%} (simulated {sim.bubble_ratio:.1%}), "
                  f"compile {row['compile_seconds'][-1]:.1f} s", flush=True)
    base = runs["1f1b"]["tokens_per_sec"]
    return {
        "microbatches": m,
        "schedules": {
            name: {
                "virtual_stages": v,
                "tokens_per_sec": statistics.median(runs[name]["tokens_per_sec"]),
                "step_seconds": batch / statistics.median(runs[name]["tokens_per_sec"]),
                "speedup_vs_1f1b": statistics.median(
                    t / b for t, b in zip(runs[name]["tokens_per_sec"], base, strict=True)
                ),
                "bubble": statistics.median(runs[name]["bubble"]),
                "simulated_bubble": statistics.median(runs[name]["simulated_bubble"]),
                "compile_seconds": statistics.median(runs[name]["compile_seconds"]),
                "recompute": recompute,
                "rounds": runs[name],
            }
            for name, (_, v, recompute) in chosen.items()
        },
        "load": os.getloadavg()[0],
    }


TRACE_PROFILE_EVERY = 5
# Each case's trace name in benchmarks/dynmo_cases.py (the row its trace replaces) and the
# config section its scheme turns off for a dense baseline.
TRACE_CASES = {
    "moe": ("MoE", "moe"), "pruning": ("pruning", "pruning"),
    "freezing": ("freezing", "freezing"), "early_exit": ("early exit", "early_exit"),
    "mod": ("MoD", "mod"), "sparse_attention": ("sparse attention", "sparse_attention"),
}


def record_trace(case: str, steps: int, trace: Path, dense: bool, out: Path) -> None:
    """One static run of ``case`` profiled every `TRACE_PROFILE_EVERY` steps, recorded."""
    config, values = overrides(case, steps, None, "")
    values["pipeline.profile_every"] = TRACE_PROFILE_EVERY
    name, section = TRACE_CASES[case]
    if dense:
        values[f"{section}.enabled"] = False
    workdir = out / f"{case}-trace"
    command = train_command(config, values, workdir, pin=True)
    run(command)
    shown = " ".join(["PYTHONPATH=$PWD python", *command[1:]]).replace(str(out), "/tmp")
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "dynmo_cases.py"), "record", str(workdir),
         str(trace), "--case", name, "--devices", f"{STAGES} processes pinned to a core each",
         "--run-command", shown, "--note", f"2-core VM, load {os.getloadavg()[0]:.1f} at the end"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--case", choices=sorted(CASES))
    mode.add_argument("--parallel-check", action="store_true")
    mode.add_argument("--schedules", action="store_true")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"steps of each run (default {DEFAULT_STEPS}; {CASE_STEPS})")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--layers", type=int, default=None, help="override the 16 layers")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--trace", type=Path, default=None,
                        help="with --case: record its trace here instead of measuring")
    parser.add_argument("--dense", action="store_true",
                        help="with --trace: the case's scheme off (the dense baseline)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="with --case: a config override for both layouts' runs "
                        "(repeatable), e.g. train.microbatches=8")
    parser.add_argument("--refine", type=int, default=0, metavar="N",
                        help="with --case: up to N more balanced runs, each re-partitioned "
                        "from the previous one's own profile (the in-loop balancer's next "
                        "decision)")
    parser.add_argument("--run", action="append", choices=list(SCHEDULE_RUNS), default=None,
                        help="with --schedules: one of them (repeatable; default all; 1f1b, "
                        "the baseline, always)")
    args = parser.parse_args(argv)
    runs = args.run or list(SCHEDULE_RUNS)
    try:
        extra = parse_sets(args.set)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if extra and args.case is None:
        print("error: --set goes with --case", file=sys.stderr)
        return 2
    if args.refine < 0 or (args.refine and args.case is None):
        print("error: --refine takes a count >= 0 and goes with --case", file=sys.stderr)
        return 2
    if len(os.sched_getaffinity(0)) < STAGES:
        print(f"error: the benchmark pins {STAGES} processes to a core each; this process may "
              f"use {len(os.sched_getaffinity(0))} core(s)", file=sys.stderr)
        return 2
    if args.steps is None:  # --schedules: every step after its steady profile is timed
        args.steps = 2 * PROFILED_AT - 1 if args.schedules else CASE_STEPS.get(
            args.case, DEFAULT_STEPS)
    if args.steps < 1 or args.rounds < 1:
        print("error: --steps and --rounds must be >= 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="real_pipeline-") as tmp:
        out = args.workdir or Path(tmp)
        start = time.perf_counter()
        print(f"load average at start: {os.getloadavg()[0]:.2f} "
              f"({os.cpu_count()} cores)", flush=True)
        if (args.trace is not None or args.dense) and args.case is None:
            print("error: --trace and --dense go with --case", file=sys.stderr)
            return 2
        try:
            if args.trace is not None:
                record_trace(args.case, args.steps, args.trace, args.dense, out)
                print(f"recorded {args.trace}")
                return 0
            if args.parallel_check:
                result = parallel_check(args.steps, args.rounds, out)
            elif args.schedules:
                result = schedule_comparison(args.steps, args.rounds, args.layers, out, runs)
            else:
                result = measure_case(args.case, args.steps, args.rounds, args.layers, out,
                                      extra, args.refine)
        except RuntimeError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        if args.schedules:
            print(f"{'schedule':<18} {'v':>2} {'tokens/s':>9} {'s/step':>7} {'vs 1f1b':>8} "
                  f"{'bubble':>7} {'simulated':>9} {'compile s':>9}")
            for name, row in result["schedules"].items():
                print(f"{name:<18} {row['virtual_stages']:>2} {row['tokens_per_sec']:>9,.0f} "
                      f"{row['step_seconds']:>7.4f} {row['speedup_vs_1f1b']:>7.3f}x "
                      f"{row['bubble']:>7.1%} {row['simulated_bubble']:>9.1%} "
                      f"{row['compile_seconds']:>9.1f}")
        elif args.parallel_check:
            print(f"two cores {result['two_core_step_seconds']:.4f} s/step, one core "
                  f"{result['one_core_step_seconds']:.4f} s/step: ratio {result['ratio']:.3f} "
                  f"(ideal {result['ideal_ratio']:.3f}, 1.0 = not parallel)")
        else:
            share = ("-" if result["bound_gain_share"] is None
                     else f"{result['bound_gain_share']:.0%}")
            error = (result["calibrated_balanced_step_seconds"]
                     / result["measured_balanced_step_seconds"] - 1)
            print(
                f"{result['case']}: static {result['static_layout']} "
                f"{result['static_tokens_per_sec']:,.0f} tokens/s, balanced "
                f"{result['balanced_layout']} {result['balanced_tokens_per_sec']:,.0f} tokens/s\n"
                f"  measured speedup {result['measured_speedup']:.3f}x, predicted "
                f"{result['predicted_speedup']:.3f}x, bound {result['bound_speedup']:.3f}x\n"
                f"  step seconds static: measured "
                f"{result['measured_static_step_seconds']:.4f}, simulated "
                f"{result['predicted_static_step_seconds']:.4f}; balanced: measured "
                f"{result['measured_balanced_step_seconds']:.4f}, simulated "
                f"{result['predicted_balanced_step_seconds']:.4f}\n"
                f"  with {result['task_overhead_seconds'] * 1e3:.2f} ms per task (calibrated on "
                f"static): balanced simulated {result['calibrated_balanced_step_seconds']:.4f} "
                f"s ({error:+.1%} of measured), speedup {result['calibrated_speedup']:.3f}x\n"
                f"  share of the bound's gain: {share}"
                + "".join(f"\n  before refining: {r['layout']} {r['tokens_per_sec']:,.0f} "
                          "tokens/s" for r in result["refinements"])
            )
        print(f"load average at end: {os.getloadavg()[0]:.2f}; "
              f"{time.perf_counter() - start:.0f} s")
        bad = [k for k, v in result.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            print(f"error: non-finite figures {bad}", file=sys.stderr)
            return 1
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
