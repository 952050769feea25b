"""The MPMD pipeline runtime: host dispatch cost, measured bubbles, one-stage overhead.

Table 1, per schedule (GPipe, 1F1B) and microbatch count M on S stages: host seconds to dispatch
one step per microbatch against device seconds per microbatch (the step's wall time once
dispatch overlaps the device; the host keeps up while dispatch < device), the compiled program
calls of one step and the host time per call (the step's dispatch time over its calls, transfers
and input placement included; issue target <= 0.3 ms at 4 stages, M = 8), the part of it spent
inside the compiled programs' calls (XLA:CPU runs a cheap program inline, in the calling thread,
so on a CPU this is the fake device's work, not dispatch) and the rest, the runtime's own host
time per call (scheduling, transfers, input placement), against the same runtime with
every copy between stages through ``jax.device_put`` (steps alternate), the bubble ratio
measured from `Pipeline.timed_step`'s timeline (seed 003 §A: idle / (stages x iteration)), the
bubble the pipeline simulator predicts from the measured mean task time of each stage, and the
analytic (S-1)/(M+S-1) of equal stages. On one CPU the fake devices share the cores, so the
measured timeline is not a parallel one there; on a GPU per stage it is.

Table 2: step throughput of a one-stage pipeline against the single-program step of the same
Plan (the target is >= 0.95 on a GPU, where the pipeline's extra dispatches are hidden; on a
CPU the fake device's own work dominates neither and the ratio only shows the runtime works).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. \\
        python3 benchmarks/pipeline.py [--config configs/quickstart.py] [--stages 4 --data 2]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time

import jax

import jax_private
from dynjax.balance import simulate
from dynjax.config import load_config
from dynjax.experiment import Experiment
from dynjax.parallel.profile import bubble_ratio


def experiment(path: str, stages: int, data: int, layers: str = "", micro: int = 0) -> Experiment:
    overrides = [
        f"mesh.stage={stages}",
        f"mesh.data={data}",
        f"pipeline.stage_layers={layers}",
        f"train.microbatches={micro}",
    ]
    return Experiment.from_config(load_config(path, overrides))


def bubble_table(exp: Experiment, micro: list[int], steps: int) -> None:
    stages, run = exp.ctx.pipeline_stages, exp.settings
    print(f"\n{stages} stages x {run.mesh.data} data devices, {run.model.num_layers} "
          f"layers, batch {run.train.batch_size} x {run.data.seq_len}; copies between "
          "stages by jax.device_put or by JAX's batched copy directly (`copy_to`), the two "
          "alternating step by step")
    print(f"{'schedule':<9}{'M':>3}{'copies':>12}{'dispatch/mb ms':>16}{'device/mb ms':>14}"
          f"{'calls':>7}{'ms/call':>9}{'in programs':>13}{'runtime':>9}{'/ device_put':>14}"
          f"{'bubble measured':>17}{'simulated':>11}{'analytic':>10}")
    for m in micro:
        plan = exp.initial_plan().replace(microbatches=m)
        runtime = exp.runtime(plan)
        for schedule in ("gpipe", "1f1b"):
            plan = plan.replace(schedule=schedule)
            exe = exp.lower_train_step(plan).compile()
            runtime.swap(plan, exe)
            pipeline, batch = runtime.pipeline, exp.order.batch(0)
            jax.block_until_ready(pipeline.step(exe, batch.inputs, batch.targets))  # warm up
            calls = program_calls(pipeline, exe, batch)
            rows = {mode: {"dispatch": [], "inside": [], "device": []} for mode in COPIES}
            measured, simulated = [], []
            for t in range(steps):
                batch = exp.order.batch(t)
                for mode, row in rows.items():
                    with copies(mode), timed_programs(exe) as in_programs:
                        t0 = time.perf_counter()
                        metrics = pipeline.step(exe, batch.inputs, batch.targets)
                        t1 = time.perf_counter()
                    jax.block_until_ready(metrics)
                    row["dispatch"].append((t1 - t0) / m)
                    row["inside"].append(in_programs.seconds / m)
                    row["device"].append((time.perf_counter() - t0) / m)
                _, timeline = pipeline.timed_step(exe, batch.inputs, batch.targets)
                measured.append(bubble_ratio(timeline))
                fwd = [_mean(row, "F") for row in timeline]
                bwd = [_mean(row, "B") for row in timeline]
                simulated.append(simulate(fwd, bwd, m, schedule=schedule).bubble_ratio)
            analytic = (stages - 1) / (m + stages - 1)
            own = {
                mode: statistics.median(
                    a - b for a, b in zip(row["dispatch"], row["inside"], strict=True)
                ) * m / calls
                for mode, row in rows.items()
            }
            for mode, row in rows.items():
                print(f"{schedule:<9}{m:>3}{mode:>12}"
                      f"{1e3 * statistics.median(row['dispatch']):>16.2f}"
                      f"{1e3 * statistics.median(row['device']):>14.2f}{calls:>7}"
                      f"{1e3 * statistics.median(row['dispatch']) * m / calls:>9.3f}"
                      f"{1e3 * statistics.median(row['inside']) * m / calls:>13.3f}"
                      f"{1e3 * own[mode]:>9.3f}{own[mode] / own[COPIES[0]]:>14.2f}"
                      f"{statistics.median(measured):>17.3f}"
                      f"{statistics.median(simulated):>11.3f}{analytic:>10.3f}")


COPIES = ("device_put", "direct")  # the baseline first


@contextlib.contextmanager
def copies(mode: str):
    """Within the block, copies between stages go through ``jax.device_put`` ("device_put",
    the runtime before issue 15 §7's direct copies) or as the runtime makes them ("direct")."""
    with jax_private.device_put_copies() if mode == "device_put" else contextlib.nullcontext():
        yield


def program_calls(pipeline, exe, batch) -> int:
    """Compiled program calls one step dispatches, counted on one step through wrappers."""
    with timed_programs(exe) as seen:
        jax.block_until_ready(pipeline.step(exe, batch.inputs, batch.targets))
    return seen.calls


@dataclasses.dataclass
class ProgramCalls:
    calls: int = 0
    seconds: float = 0.0  # spent inside the calls


@contextlib.contextmanager
def timed_programs(exe):
    """Within the block, ``exe``'s program calls are counted and timed (`ProgramCalls`)."""
    seen = ProgramCalls()
    original = dict(exe.programs)

    def timed(fn):
        def call(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                seen.calls += 1
                seen.seconds += time.perf_counter() - t0
        return call

    exe.programs.update({key: timed(fn) for key, fn in original.items()})
    try:
        yield seen
    finally:
        exe.programs.update(original)


def _mean(row, kind: str) -> float:
    return statistics.mean(t.end - t.start for t in row if t.kind == kind)


def one_stage_table(path: str, steps: int, rounds: int) -> None:
    plain = experiment(path, 1, 1, micro=1)  # the same Plan for both: one microbatch
    staged = experiment(path, 1, 1, layers=f"({plain.settings.model.num_layers},)", micro=1)
    loops = {}
    for name, exp in (("single program", plain), ("1-stage pipeline", staged)):
        plan = exp.initial_plan()
        exe = exp.lower_train_step(plan).compile()
        runtime = exp.runtime(plan)

        def run(count: int, start: int, exe=exe, runtime=runtime, exp=exp) -> float:
            t0 = time.perf_counter()
            for t in range(start, start + count):
                metrics = runtime.step(exe, exp.order.batch(t), None)
            jax.block_until_ready(metrics)
            return time.perf_counter() - t0

        run(3, 0)  # warm up
        loops[name] = run
    tokens = steps * plain.settings.train.batch_size * plain.settings.data.seq_len
    rates = {name: [] for name in loops}
    for r in range(rounds):  # alternate, the machine is shared
        for name, run in loops.items():
            rates[name].append(tokens / run(steps, 3 + r * steps))
    base, ours = (statistics.median(rates[n]) for n in loops)
    print(f"\n{'step':<18}{'tokens/s':>12}   (median of {rounds} rounds x {steps} steps, "
          f"{jax.devices()[0].device_kind})")
    for name in loops:
        print(f"{name:<18}{statistics.median(rates[name]):>12,.0f}")
    print(f"{'ratio':<18}{ours / base:>12.3f}   (target >= 0.95 on a GPU)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/quickstart.py")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--data", type=int, default=2)
    parser.add_argument("--microbatches", default="1,2,4,8", help="'' skips table 1")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of table 2")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}, jax {jax.__version__}")
    micro = [int(m) for m in args.microbatches.split(",") if m]
    if micro:
        bubble_table(experiment(args.config, args.stages, args.data), micro, args.steps)
    one_stage_table(args.config, 4 * args.steps, args.rounds)


if __name__ == "__main__":
    main()
