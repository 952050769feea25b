"""What dynamic balancing costs the training loop: profiling, deciding, migrating.

DynMo rebalances MoE and MoD every iteration because the overhead is single-digit percent (seed
000 §3.3.1, §5.2); the target here is <= 2% of training time at each case's cadence. On a
pipeline of ``--stages`` x ``--data`` fake CPU devices, in one process and interleaved rounds
(the machine is shared), it times:

* a plain step: the training loop's steady state, steps dispatched back to back, their metrics
  read ``recompile.delta_launch`` steps late as the Monitor reads them;
* the same steps each with a periodic profile (`start_profile_step(measure_units=False)`: unit
  times rescaled from the step's own timeline, taken by watcher threads while the loop goes on,
  the Profile built when the Monitor hands the step over, as `dynjax.train` does): the extra
  seconds per step are those of one periodic profile. Each round runs both windows back to
  back (alternating which first) and the overhead is the median of the rounds' differences, in
  wall time, in process CPU time (all threads: the watchers' work shows, idle waits do not) and
  in the training thread's CPU time (dispatching, reading metrics, building the Profile); the
  watcher threads' CPU (they do nothing else) plus the training thread's extra is the profile's
  own CPU ("own CPU"), free of the noise of the rest of the process (XLA's threads);
* a profiled step that runs every unit alone (`measure_units=True`: what a step after a change
  of the model does, waiting for the step and the units): its extra seconds over a plain step;
* one decision: `RebalancePolicy.propose` on a history holding the profile (on the Controller's
  thread in a run, so it delays no step; shown for completeness);
* one migration of a layer to the neighbouring stage and back (per move).

Overhead at a cadence of k steps = extra seconds of one periodic profile / (k plain steps); the
table prints it for each case's cadence (`dynmo_cases.cadence`: every step for MoE, MoD and sparse
attention, 500 for freezing and early exit, 1,000 for pruning; seed 000 §3.3.1, Fig. 3), and,
with ``--case``, the units-alone profile after each Plan swap of the recorded run over its steps
(`dynmo_cases.swaps`). Migration is paid only when a decision moves layers; its cost per move is
printed beside.

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

import jax
import numpy as np
from dynmo_cases import cadence, swaps, synthetic_cases

from dynjax.config import load_config, microbatches
from dynjax.experiment import Experiment
from dynjax.parallel.pipeline import WATCHER
from dynjax.parallel.profile import stage_busy_seconds
from dynjax.recompile import Rebalance
from dynjax.recompile.monitor import Monitor
from dynjax.recompile.policy import History
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
    cfg = load_config(config, [*overrides, "balance.enabled=True", "balance.every=1",
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
                raw, pending[step] = runtime.start_profile_step(
                    exe, host, None, measure_units=False
                )
            else:
                raw = runtime.step(exe, host, None)
            monitor.push(step, raw)
            observe(monitor.pop_ready(step))
        observe(monitor.drain())
        seconds = time.perf_counter() - t0, time.process_time() - c0, time.thread_time() - h0
        watched.append((watchers_cpu() - w0) / count)
        return *(t / count for t in seconds), metrics

    def units_alone() -> float:
        t0 = time.perf_counter()
        metrics, profile = runtime.profile_step(exe, batch(), None, measure_units=True)
        jax.block_until_ready(metrics)
        seconds = time.perf_counter() - t0
        waited.append(stage_busy_seconds(profile.timeline))
        return seconds

    busy, waited = [], []  # stage busy seconds of the periodic and the waited-for timelines
    watched = []  # the watcher threads' CPU seconds per step of each window
    steps(3, False)
    units_alone()  # warm up every program, and measure the layout's units once
    steps(3, True)
    busy.clear()
    waited.clear()
    step_s, step_cpu, step_thread, full_s, light_s, light_cpu, light_thread, decide_s = (
        [], [], [], [], [], [], [], [])
    (policy,) = [p for p in policies_for(cfg, exp) if isinstance(p, Rebalance)]
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
        full_s.append(units_alone())
        history = History.of([(step, metrics)])
        t0 = time.perf_counter()
        policy.propose(history, plan)
        decide_s.append(time.perf_counter() - t0)
    counts = [len(s.layers) for s in runtime.pipeline.spec.stages]
    moved = list(counts)
    moved[0], moved[1] = moved[0] - 1, moved[1] + 1
    migrate_s = []
    for layout in (moved, counts):
        other = plan.replace(stage_layers=tuple(layout))
        migration = runtime.swap(other, exp.lower_train_step(other, profiling=True).compile())
        migrate_s.append(migration.seconds)
    base = statistics.median(step_s)
    full = statistics.median(full_s) - base
    # Medians of the rounds' paired differences.
    light = statistics.median(a - b for a, b in zip(light_s, step_s, strict=True))
    cpu_base = statistics.median(step_cpu)
    cpu = statistics.median(a - b for a, b in zip(light_cpu, step_cpu, strict=True))
    thread = statistics.median(a - b for a, b in zip(light_thread, step_thread, strict=True))
    # The profile's own CPU, free of the rest of the process's noise: the watcher threads' CPU
    # per profiled step (they do nothing else) plus the training thread's extra.
    watchers = statistics.median(watcher_cpu)
    direct = thread + watchers
    setting = (f"{cfg.mesh.stage} stages x {cfg.mesh.data} data ({jax.device_count()} "
               f"{jax.devices()[0].platform} devices), {cfg.model.num_layers} layers, "
               f"M={microbatches(cfg)}, batch {cfg.train.batch_size} x {cfg.data.seq_len}; "
               f"medians of {args.rounds} rounds of {args.steps} steps, the periodic "
               "profile's paired with the round's plain steps")
    print(f"\n{args.case or config}: {setting}")
    print(f"plain step {1e3 * base:.1f} ms; extra per profile: units run alone "
          f"{1e3 * full:.1f} ms, rescaled from the timeline {1e3 * light:.1f} ms; "
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
    print(f"{'case (cadence)':<28}{'every k':>8}{'units alone':>13}{'rescaled':>10}"
          f"{'CPU':>7}{'own CPU':>9}")
    for name in [args.case] if args.case else [c.name for c in synthetic_cases()]:
        k = cadence(name)
        print(f"{name:<28}{k:>8}{full / (k * base):>13.1%}{light / (k * base):>10.1%}"
              f"{cpu / (k * cpu_base):>7.1%}{direct / (k * cpu_base):>9.1%}")
    if args.case:
        count, total = swaps(args.case)
        print(f"{args.case}: units run alone after each of the recorded run's {count} Plan swaps "
              f"in {total} steps: {full * count / (total * base):.1%} of its plain steps' time")
    if args.record:
        line = {"case": args.case, "recorded": date.today().isoformat(), "setting": setting,
                "config": config, "overrides": overrides, "plain_step_seconds": base,
                "profile_seconds": light, "units_alone_seconds": full,
                "decision_seconds": statistics.median(decide_s),
                "migration_seconds": statistics.median(migrate_s),
                "plain_step_cpu_seconds": cpu_base, "profile_cpu_seconds": cpu,
                "profile_thread_seconds": thread, "watcher_cpu_seconds": watchers,
                "busy_ratio": ratio.tolist()}
        with args.record.open("a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
