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

Table 3 (``--maxtext A,B,C``, issue 33 §3): dynjax's pipeline beside MaxText's on the same
Llama-block models (`COMPARE_SHAPES`: 4 stages x 2 data on 8 fake CPU devices, 4 microbatches,
float32), each shape trained by ``python -m dynjax.train`` as a user runs it (tokens/s: the
median of the steps after the first four; compile: the first `compile` event's lower + compile
seconds). MaxText is not a dependency: its figures are read from `MAXTEXT_RESULTS`, measured
with MaxText's own trainer on the overrides this prints for each shape (docs/benchmarks.md
"The pipeline beside MaxText's").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
from real_pipeline import first_compile_seconds

import jax_private
from dynjax.balance import simulate
from dynjax.config import load_config
from dynjax.experiment import Experiment
from dynjax.parallel.profile import bubble_ratio
from dynjax.writers import read_jsonl

ROOT = Path(__file__).resolve().parent.parent


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


# Issue 33 §3's comparison: Llama blocks (RMSNorm, SwiGLU, RoPE, no biases), the byte vocabulary,
# batch 16, 4 stages x 2 data, 4 microbatches, float32; each stage holds a quarter of the layers.
COMPARE_SHAPES = {
    "A": {"num_layers": 8, "d_model": 128, "num_heads": 4, "mlp_dim": 512, "seq_len": 128},
    "B": {"num_layers": 8, "d_model": 256, "num_heads": 4, "mlp_dim": 1024, "seq_len": 256},
    "C": {"num_layers": 16, "d_model": 128, "num_heads": 4, "mlp_dim": 512, "seq_len": 128},
}
COMPARE_BATCH, COMPARE_STAGES, COMPARE_DATA, COMPARE_MICROBATCHES = 16, 4, 2, 4
MAXTEXT_RESULTS = ROOT / "benchmarks" / "results" / "maxtext_pipeline.json"


def maxtext_overrides(shape: dict[str, int]) -> list[str]:
    """MaxText's trainer overrides for ``shape`` (beside its ``configs/base.yml``; run with
    ``DECOUPLE_GCLOUD=TRUE`` and 8 fake CPU devices): the same model, mesh and batch."""
    devices = COMPARE_STAGES * COMPARE_DATA
    return [
        "hardware=cpu", "skip_jax_distributed_system=true", "dataset_type=synthetic",
        "enable_checkpointing=false", "dtype=float32", "attention=dot_product",
        "vocab_size=256", f"base_emb_dim={shape['d_model']}",
        f"base_num_query_heads={shape['num_heads']}", f"base_num_kv_heads={shape['num_heads']}",
        f"head_dim={shape['d_model'] // shape['num_heads']}", f"base_mlp_dim={shape['mlp_dim']}",
        f"base_num_decoder_layers={shape['num_layers']}", f"max_target_length={shape['seq_len']}",
        f"per_device_batch_size={COMPARE_BATCH // devices}",
        f"ici_pipeline_parallelism={COMPARE_STAGES}", f"ici_data_parallelism={COMPARE_DATA}",
        "ici_fsdp_parallelism=1", f"num_pipeline_microbatches={COMPARE_MICROBATCHES}",
        f"num_layers_per_pipeline_stage={shape['num_layers'] // COMPARE_STAGES}",
    ]


def train_overrides(shape: dict[str, int], steps: int) -> list[str]:
    """``python -m dynjax.train``'s overrides of ``configs/quickstart.py`` for ``shape``."""
    model = {k: v for k, v in shape.items() if k != "seq_len"}
    return [
        "--config.model.family=llama",
        *(f"--config.model.{k}={v}" for k, v in model.items()),
        f"--config.data.seq_len={shape['seq_len']}",
        f"--config.train.batch_size={COMPARE_BATCH}",
        f"--config.mesh.stage={COMPARE_STAGES}", f"--config.mesh.data={COMPARE_DATA}",
        f"--config.train.microbatches={COMPARE_MICROBATCHES}",
        f"--config.train.steps={steps}", "--config.train.log_every=1",
        "--config.train.eval_every=100000", "--config.train.checkpoint_every=100000",
    ]


def train_run(shape: dict[str, int], steps: int) -> dict[str, float]:
    """One CLI run of ``shape`` in a fresh workdir with a cold compilation cache: its median
    tokens/s after the first four steps (the first is profiled) and its first compile."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable, "-m", "dynjax.train", "--config", "configs/quickstart.py",
            "--workdir", f"{tmp}/run", f"--config.recompile.cache_dir={tmp}/cache",
            *train_overrides(shape, steps),
        ]
        devices = f"--xla_force_host_platform_device_count={COMPARE_STAGES * COMPARE_DATA}"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {devices}"
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
        run = Path(tmp) / "run"
        rates = [
            m["tokens_per_sec"] for m in read_jsonl(run / "metrics.jsonl")
            if m["step"] > 4 and "tokens_per_sec" in m
        ]
        return {
            "tokens_per_sec": statistics.median(rates),
            "compile_seconds": first_compile_seconds(run),
        }


def check_compare_args(names: list[str], steps: int) -> None:
    """Exit 2 with ``error: ...`` on a shape `COMPARE_SHAPES` lacks or too few steps."""
    unknown = sorted(set(names) - set(COMPARE_SHAPES))
    if unknown:
        problem = f"--maxtext: no shape {unknown}; the shapes are {', '.join(COMPARE_SHAPES)}"
    elif steps < 5:
        problem = ("--maxtext-steps must be at least 5: the first four steps (compile, the "
                   "profiled first step) are left out of tokens/s")
    else:
        return
    print(f"error: {problem}", file=sys.stderr)
    raise SystemExit(2)


def maxtext_table(names: list[str], steps: int, rounds: int) -> None:
    quoted = json.loads(MAXTEXT_RESULTS.read_text()) if MAXTEXT_RESULTS.exists() else {}
    print(f"\nTable 3: the pipeline beside MaxText's ({COMPARE_STAGES} stages x {COMPARE_DATA} "
          f"data, M = {COMPARE_MICROBATCHES}, batch {COMPARE_BATCH}, float32; dynjax: median of "
          f"{rounds} runs of {steps} steps; MaxText: {MAXTEXT_RESULTS.name}, "
          f"{quoted.get('measured', 'not measured')})")
    print(f"{'shape':<6}{'L x d_model, seq':>18}{'dynjax tok/s':>14}{'MaxText tok/s':>15}"
          f"{'ratio':>8}{'dynjax compile s':>18}{'MaxText compile s':>19}{'ratio':>8}")
    for name in names:
        shape = COMPARE_SHAPES[name]
        runs = [train_run(shape, steps) for _ in range(rounds)]
        ours = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        theirs = quoted.get("shapes", {}).get(name)
        size = f"{shape['num_layers']} x {shape['d_model']}, {shape['seq_len']}"
        cells = ["-"] * 4
        if theirs:
            cells = [f"{theirs['tokens_per_sec']:,.0f}",
                     f"{ours['tokens_per_sec'] / theirs['tokens_per_sec']:.2f}x",
                     f"{theirs['compile_seconds']:.1f}",
                     f"{ours['compile_seconds'] / theirs['compile_seconds']:.2f}x"]
        print(f"{name:<6}{size:>18}{ours['tokens_per_sec']:>14,.0f}{cells[0]:>15}{cells[1]:>8}"
              f"{ours['compile_seconds']:>18.1f}{cells[2]:>19}{cells[3]:>8}")
    for name in names:
        overrides = " ".join(maxtext_overrides(COMPARE_SHAPES[name]))
        print(f"MaxText overrides, shape {name}: {overrides}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/quickstart.py")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--data", type=int, default=2)
    parser.add_argument("--microbatches", default="1,2,4,8", help="'' skips table 1")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of tables 2 and 3")
    parser.add_argument("--maxtext", default="", metavar="A,B,C",
                        help="table 3 for these shapes (COMPARE_SHAPES); '' skips it")
    parser.add_argument("--maxtext-steps", type=int, default=16, help="steps of each table 3 run")
    parser.add_argument("--skip-one-stage", action="store_true", help="skip table 2")
    args = parser.parse_args()
    shapes = args.maxtext.split(",") if args.maxtext else []
    if shapes:
        check_compare_args(shapes, args.maxtext_steps)
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}, jax {jax.__version__}")
    micro = [int(m) for m in args.microbatches.split(",") if m]
    if micro:
        bubble_table(experiment(args.config, args.stages, args.data), micro, args.steps)
    if not args.skip_one_stage:
        one_stage_table(args.config, 4 * args.steps, args.rounds)
    if args.maxtext:
        maxtext_table(shapes, args.maxtext_steps, args.rounds)


if __name__ == "__main__":
    main()
