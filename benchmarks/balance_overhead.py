"""What dynamic balancing costs the training loop: profiling, deciding, migrating.

DynMo rebalances MoE and MoD every iteration because the overhead is single-digit percent (seed
000 §3.3.1, §5.2); the target here is <= 2% of training time at each case's cadence. On a
pipeline of ``--stages`` x ``--data`` fake CPU devices, in one process and interleaved rounds
(the machine is shared), it times:

* a plain step: the training loop's steady state, steps dispatched back to back, their metrics
  read ``recompile.delta_launch`` steps late as the Monitor reads them;
* the same steps each with a periodic profile (`start_profile_step` of a measured layout: unit
  times rescaled from the step's own timeline, taken by watcher threads while the loop goes on,
  the Profile built when the Monitor hands the step over, as `dynjax.train` does): the extra
  seconds per step are those of one periodic profile. Each round runs both windows back to
  back (alternating which first) and the overhead is the median of the rounds' differences, in
  wall time, in process CPU time (all threads: the watchers' work shows, idle waits do not) and
  in the training thread's CPU time (dispatching, reading metrics, building the Profile); the
  watcher threads' CPU (they do nothing else) plus the training thread's extra is the profile's
  own CPU ("own CPU"), free of the noise of the rest of the process (XLA's threads);
* the profiled step after a Plan swap, which runs alone the units the swap made new (their
  timing signature, `dynjax.parallel.profile.unit_seconds`) and waits for them: its extra
  seconds over the round's plain step, after a layer moves to the neighbouring stage and back
  ("move"), and, with ``--case`` MoE, sparse attention or early exit, after each resize of the
  recorded run's swaps (the sizes of the layers whose cost a swap changed, halved, and back:
  `resized`, `dynmo_cases.swaps`);
* one decision: `RebalancePolicy.propose` on a history holding the profile (on the Controller's
  thread in a run, so it delays no step; shown for completeness);
* the migrations of those moves (per move).

Overhead at a cadence of k steps = extra seconds of one periodic profile / (k plain steps); the
table prints it for each case's cadence (`dynmo_cases.cadence`: every step for MoE, MoD and sparse
attention, 500 for freezing and early exit, 1,000 for pruning; seed 000 §3.3.1, Fig. 3), and,
with ``--case``, the profiles after the recorded run's Plan swaps, each move and each other swap
at the measured seconds of its kind, over its steps (`dynmo_cases.swaps`, `swap_seconds`).
Migration is paid only when a decision moves layers; its cost per move is printed beside.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. \\
        python3 benchmarks/balance_overhead.py [--config configs/quickstart.py] [--layers 8]

Per DynMo case, ``--case NAME`` measures the model of ``benchmarks/traces/<case>.jsonl``: the
config and ``--config.*`` overrides of the run that recorded it (its layers, mesh, microbatches,
capacities, ...), less its step count and profile/balance periods. ``--record PATH`` appends the
measured seconds as one JSON line; ``benchmarks/dynmo_cases.py`` reads
``benchmarks/traces/overhead.jsonl`` and prints each case's overhead at its own cadence:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. \\
        python3 benchmarks/balance_overhead.py --case MoE --record benchmarks/traces/overhead.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import threading
import time
from datetime import date
from pathlib import Path
from typing import Any

import jax
import numpy as np
from dynmo_cases import cadence, resizes, swap_seconds, swaps, synthetic_cases

from dynjax.config import load_config
from dynjax.dynamism.moe.part import capacities_of
from dynjax.experiment import Experiment
from dynjax.model import ModelParts
from dynjax.model.facts import moe_layer_indices
from dynjax.parallel.profile import stage_busy_seconds, timed_units
from dynjax.parallel.timeline import WATCHER
from dynjax.recompile import Plan, Rebalance
from dynjax.recompile.monitor import Monitor
from dynjax.recompile.policy import History
from dynjax.settings import microbatches
from dynjax.train import policies_for

TRACES = Path(__file__).resolve().parent / "traces"
# Keys of a recorded run's command that are its length and periods, not its model.
RUN_ONLY = ("train.steps", "pipeline.profile_every", "balance.every", "balance.enabled")


def recorded_run(case: str) -> tuple[str, list[str]]:
    """The config file and ``--config.key=value`` overrides of the run that recorded ``case``."""
    path = TRACES / f"{case.replace(' ', '_')}.jsonl"
    if not path.is_file():
        raise SystemExit(f"--case {case!r}: no trace {path}; record one first (dynmo_cases.py)")
    command = shlex.split(json.loads(path.read_text().splitlines()[0])["command"])
    config = command[command.index("--config") + 1]
    overrides = [m.group(1) for arg in command if (m := re.fullmatch(r"--config\.(.+)", arg))]
    return config, [o for o in overrides if o.split("=", 1)[0] not in RUN_ONLY]


def watchers_cpu() -> float:
    """CPU seconds the pipeline's watcher threads have used (`Pipeline.start_timed_step`)."""
    return sum(
        time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        for t in threading.enumerate()
        if t.name.startswith(WATCHER) and t.ident is not None
    )


def keyed(swap: dict[str, float]) -> dict[str, Any]:
    """A record's fields of the extra seconds of the profile after each change
    (`dynmo_cases.swap_seconds` reads them)."""
    resize = {key: t for key, t in swap.items() if key != "move"}
    return {"move_units_seconds": swap["move"], "resize_units_seconds": resize}


def resized(case: str | None, plan: Plan, layers: str, moe_layers: tuple[int, ...]) -> Plan | None:
    """``plan`` with the sizes of ``layers`` (a `resize_key`: "all", or indices) halved as the
    case's policy changes them: each MoE layer's capacities (a smaller ragged buffer; one the
    bucketed buffer absorbs, e.g. x 1.5 from the start, changes no program and runs nothing
    alone), attention budget or early-exit bucket ("all" stands for the swap that turns early
    exits on, which changes every exit layer's program but no layer's cost). None for a case
    whose other swaps are changes of the model (pruning, freezing: their records hold every
    unit alone) or that has none."""
    if case not in ("MoE", "sparse attention", "early exit"):
        return None
    chosen = None if layers == "all" else set(map(int, layers.split(",")))

    def half(sizes: tuple, indices) -> tuple:
        """``sizes`` (one per layer of ``indices``) with the chosen layers' halved."""
        out = []
        for i, size in zip(indices, sizes, strict=True):
            if chosen is None or i in chosen:
                size = tuple(max(1, c // 2) for c in size) if isinstance(size, tuple) \
                    else max(1, size // 2)
            out.append(size)
        return tuple(out)

    if case == "MoE":
        return plan.with_part("moe", capacities=half(capacities_of(plan), moe_layers))
    name, field = {"sparse attention": ("sparse_attention", "budgets"),
                   "early exit": ("early_exit", "tokens")}[case]
    sizes = plan.part(name)[field]
    return plan.with_part(name, **{field: half(sizes, range(len(sizes)))})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/quickstart.py")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--data", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="plain steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--case", help="a recorded DynMo case (its run's model and pipeline, "
                        "instead of --config, --layers, --stages, --data, --microbatches)")
    parser.add_argument("--record", type=Path, help="append the measurement to this JSON lines "
                        "file (with --case)")
    args = parser.parse_args()
    if args.record and not args.case:
        parser.error("--record needs --case (the row of benchmarks/dynmo_cases.py it measures)")
    if args.case:
        config, overrides = recorded_run(args.case)
    else:
        config, overrides = args.config, [
            f"model.num_layers={args.layers}", f"mesh.stage={args.stages}",
            f"mesh.data={args.data}", f"train.microbatches={args.microbatches}"]
    # Early exit: tokens exit from the first step, as in the recorded run's swaps (they come
    # after its start_step) and most of its steps.
    exits = ["early_exit.start_step=0"] if args.case == "early exit" else []
    cfg = load_config(config, [*overrides, *exits, "balance.enabled=True", "balance.every=1",
                               "pipeline.profile_every=1"])
    exp = Experiment.from_config(cfg)
    plan = exp.initial_plan()
    runtime = exp.runtime(plan)
    exe = exp.lower_train_step(plan, profiling=True).compile()
    runtime.swap(plan, exe)
    step = 0

    def batch():
        nonlocal step
        step += 1
        return exp.order.batch(step)

    def steps(count: int, profiled: bool) -> tuple[float, float, float, dict]:
        """Wall, process CPU and training-thread CPU seconds per step of ``count`` steps as the
        training loop runs them: dispatched back to back, their metrics read
        ``recompile.delta_launch`` steps late (the Monitor); with ``profiled``, every step a
        periodic profile whose Profile joins its metrics then."""
        monitor, pending, metrics = Monitor(cfg.recompile.delta_launch), {}, {}

        def observe(ready: list[tuple[int, dict]]) -> None:
            nonlocal metrics
            for s, m in ready:
                if s in pending:
                    profile = pending.pop(s).result()
                    m = {**m, **profile.metrics()}
                    busy.append(stage_busy_seconds(profile.timeline))
                metrics = runtime.host_metrics(s, m)

        t0, c0, h0, w0 = (time.perf_counter(), time.process_time(), time.thread_time(),
                          watchers_cpu())
        for _ in range(count):
            host = batch()
            if profiled:
                raw, pending[step] = runtime.start_profile_step(exe, host, None)
            else:
                raw = runtime.step(exe, host, None)
            monitor.push(step, raw)
            observe(monitor.pop_ready(step))
        observe(monitor.drain())
        seconds = time.perf_counter() - t0, time.process_time() - c0, time.thread_time() - h0
        watched.append((watchers_cpu() - w0) / count)
        return *(t / count for t in seconds), metrics

    def swap_and_profile(target: Plan, executable) -> tuple[float, float]:
        """Seconds of the first profiled step after swapping to ``target`` (it waits for the
        units the swap made new, run alone), and the swap's migration seconds."""
        migration = runtime.swap(target, executable)
        t0 = time.perf_counter()
        metrics, profile = runtime.profile_step(executable, batch(), None)
        jax.block_until_ready(metrics)
        seconds = time.perf_counter() - t0
        if target == plan:  # a timeline of the measured layout that the loop waited for
            waited.append(stage_busy_seconds(profile.timeline))
        return seconds, migration.seconds if migration is not None else 0.0

    counts = [len(s.layers) for s in runtime.pipeline.spec.stages]
    moved = list(counts)
    moved[0], moved[1] = moved[0] - 1, moved[1] + 1
    # The changes timed after a swap: a move, and each resize of the recorded run's swaps.
    plan_swaps = swaps(args.case)[0] if args.case else []
    changes = {"move": plan.replace(stage_layers=tuple(moved))}
    parts = ModelParts.of(exp.model_cfg)
    signatures = lambda p: {sig for *_, sig in timed_units(exp.pipeline_spec(p), parts)}  # noqa: E731
    moe_layers = moe_layer_indices(cfg.model.num_layers, cfg.moe.every)
    for key in sorted(set(resizes(plan_swaps))):
        other = resized(args.case, plan, key, moe_layers)
        if other is None:
            continue
        if not signatures(other) - signatures(plan):
            raise SystemExit(f"resizing layers {key} changes no unit's program: it times nothing")
        changes[key] = other
    changes = {
        kind: (p, exp.lower_train_step(p, profiling=True).compile()) for kind, p in changes.items()
    }

    def swaps_there_and_back(kind: str) -> tuple[list[float], list[float]]:
        """Profile seconds after a swap to the ``kind`` change and after the swap back, and the
        two swaps' migration seconds: each profile runs alone the units its swap made new."""
        there = swap_and_profile(*changes[kind])
        back = swap_and_profile(plan, exe)
        return [there[0], back[0]], [there[1], back[1]]

    busy, waited = [], []  # stage busy seconds of the periodic and the waited-for timelines
    watched = []  # the watcher threads' CPU seconds per step of each window
    steps(3, False)
    runtime.profile_step(exe, batch(), None)  # warm up every program, measure every unit once
    for kind in changes:
        swaps_there_and_back(kind)
    steps(3, True)
    busy.clear()
    waited.clear()
    step_s, step_cpu, step_thread, light_s, light_cpu, light_thread, decide_s = (
        [], [], [], [], [], [], [])
    after = {kind: [] for kind in changes}  # profiled step seconds after a swap, by change
    migrate_s = []
    (policy,) = [p for p in policies_for(exp.settings, exp) if isinstance(p, Rebalance)]
    watched.clear()
    watcher_cpu = []  # per profiled window
    for r in range(args.rounds):
        # Plain and profiled windows back to back, in alternating order: the machine's load
        # drifts, so each round's difference is taken within the round.
        for profiled in (r % 2 == 1, r % 2 == 0):
            wall, cpu, thread, metrics = steps(args.steps, profiled)
            if profiled:
                watcher_cpu.append(watched[-1])
            (light_s if profiled else step_s).append(wall)
            (light_cpu if profiled else step_cpu).append(cpu)
            (light_thread if profiled else step_thread).append(thread)
        for kind in changes:
            seconds, migrations = swaps_there_and_back(kind)
            after[kind] += seconds
            if kind == "move":
                migrate_s += migrations
        history = History.of([(step, metrics)])
        t0 = time.perf_counter()
        policy.propose(history, plan)
        decide_s.append(time.perf_counter() - t0)
    base = statistics.median(step_s)
    # Medians of the rounds' paired differences (two swaps of each change a round).
    swap = {kind: statistics.median(a - b for a, b in zip(seconds, np.repeat(step_s, 2),
                                                            strict=True))
            for kind, seconds in after.items()}
    light = statistics.median(a - b for a, b in zip(light_s, step_s, strict=True))
    cpu_base = statistics.median(step_cpu)
    cpu = statistics.median(a - b for a, b in zip(light_cpu, step_cpu, strict=True))
    thread = statistics.median(a - b for a, b in zip(light_thread, step_thread, strict=True))
    # The profile's own CPU, free of the rest of the process's noise: the watcher threads' CPU
    # per profiled step (they do nothing else) plus the training thread's extra.
    watchers = statistics.median(watcher_cpu)
    direct = thread + watchers
    run = exp.settings
    setting = (f"{run.mesh.stage} stages x {run.mesh.data} data ({jax.device_count()} "
               f"{jax.devices()[0].platform} devices), {run.model.num_layers} layers, "
               f"M={microbatches(run)}, batch {run.train.batch_size} x {run.data.seq_len}; "
               f"medians of {args.rounds} rounds of {args.steps} steps, the periodic "
               "profile's paired with the round's plain steps")
    print(f"\n{args.case or config}: {setting}")
    print(f"plain step {1e3 * base:.1f} ms; extra per profile: after a swap, running alone "
          "the units it made new, " + ", ".join(
              f"{1e3 * t:.1f} ms ({'a layer to the next stage' if k == 'move' else k + ' resized'})"
              for k, t in swap.items())
          + f"; rescaled from the timeline {1e3 * light:.1f} ms; "
          f"decision {1e3 * statistics.median(decide_s):.2f} ms (controller thread); "
          f"process CPU per plain step {1e3 * cpu_base:.1f} ms, extra per periodic profile "
          f"{1e3 * cpu:.1f} ms; training thread CPU per plain step "
          f"{1e3 * statistics.median(step_thread):.1f} ms, extra per periodic profile "
          f"{1e3 * thread:.2f} ms; watcher threads' CPU per periodic profile "
          f"{1e3 * watchers:.2f} ms; migration {1e3 * statistics.median(migrate_s):.1f} ms "
          "per move")
    # The periodic profiles' timelines are taken while the loop dispatches the next steps; the
    # balancer's costs come from them, so they must agree with a timeline the loop waited for.
    ratio = np.median(busy, axis=0) / np.median(waited, axis=0)
    print(f"stage busy seconds, periodic profiles / waited-for ones (medians of {len(busy)} and "
          f"{len(waited)}): " + " ".join(f"{r:.3f}" for r in ratio))
    print(f"{'case (cadence)':<28}{'every k':>8}{'rescaled':>10}{'CPU':>7}{'own CPU':>9}")
    for name in [args.case] if args.case else [c.name for c in synthetic_cases()]:
        k = cadence(name)
        print(f"{name:<28}{k:>8}{light / (k * base):>10.1%}"
              f"{cpu / (k * cpu_base):>7.1%}{direct / (k * cpu_base):>9.1%}")
    if args.case:
        total = swaps(args.case)[1]
        share = swap_seconds(keyed(swap), plan_swaps)
        print(f"{args.case}: the profiles after the recorded run's {len(plan_swaps)} Plan swaps "
              f"({sum(m for m, _ in plan_swaps)} moves) in {total} steps: "
              + (f"{share / (total * base):.1%}" if share is not None else "unmeasured")
              + " of its plain steps' time")
    if args.record:
        line = {"case": args.case, "recorded": date.today().isoformat(), "setting": setting,
                "config": config, "overrides": overrides, "plain_step_seconds": base,
                "profile_seconds": light, **keyed(swap),
                "decision_seconds": statistics.median(decide_s),
                "migration_seconds": statistics.median(migrate_s),
                "plain_step_cpu_seconds": cpu_base, "profile_cpu_seconds": cpu,
                "profile_thread_seconds": thread, "watcher_cpu_seconds": watchers,
                "busy_ratio": ratio.tolist()}
        with args.record.open("a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
