"""Helpers that more than one test module uses, in one place so that a change to what they read
or run is made once. The tiny model and run are `tiny.py` (also a config file for the CLI); the
scripts that tests start as subprocesses are in `scripts/`."""

import importlib.util
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

from dynjax.checkpoint import layout
from dynjax.model import ModelParts
from dynjax.model.hashed_attention import lsh_buckets, rotations
from dynjax.model.moe import static_options
from dynjax.parallel.stage import StageSetup, forward_loss
from dynjax.recompile import History, Plan, Proposal
from dynjax.recompile.rebalance import (
    ITERATION,
    LAYER_BACKWARD,
    LAYER_FORWARD,
    STAGE_BACKWARD,
    STAGE_FORWARD,
    STAGE_LAYERS,
)
from dynjax.train import train
from dynjax.writers import read_jsonl

from .tiny import dotted_config, tiny_config

ROOT = Path(__file__).resolve().parents[1]  # the repository: the subprocesses' working directory


def benchmark_script(name: str):
    """``benchmarks/<name>.py`` imported as the module ``name``, as the scripts import each other
    (``from real_pipeline import ...``): its own name in ``sys.modules``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
DATA = Path(__file__).parent / "data"  # see data/README.md
QKV_BEFORE_PER_HEAD = DATA / "qkv_before_per_head_checkpoint.tar.gz"


# -- a run's logs ------------------------------------------------------------------------------


def logged(workdir: Path, key: str) -> dict:
    """Each logged step's ``key``; a resumed run's later lines win, as a reader of the file would
    do."""
    return {r["step"]: r[key] for r in read_jsonl(workdir / "metrics.jsonl") if key in r}


def losses(workdir: Path) -> dict[int, float]:
    """Train loss per step; a resumed run's later lines win, as a reader of the file would do."""
    return logged(workdir, "loss")


def loss_curve(workdir: Path) -> list[float]:
    """`losses` in step order, for comparing two runs' curves."""
    by_step = losses(workdir)
    return [by_step[s] for s in sorted(by_step)]


def events_of(workdir: Path, kind: str | None = None) -> list[dict]:
    """The run's events of ``kind`` (all of them without one), in the order they were written."""
    return [e for e in read_jsonl(workdir / "events.jsonl") if kind in (None, e["event"])]


# -- training runs -----------------------------------------------------------------------------


def train_with_warm_cache(cfg, tmp_path):
    """Train twice from scratch; return the second run's workdir and summary.

    On two busy cores (and slower still with 8 fake devices) a background compile can outlast a
    short run. The compiler finishes its compile before the run exits, so the first run fills
    JAX's persistent cache; when the policy can propose only one Plan, the second run finds it
    compiled within a fraction of a second and must swap.
    """
    train(cfg, tmp_path / "warm", progress=False)
    summary = train(cfg, tmp_path / "run", progress=False)
    return tmp_path / "run", summary


def layer_moves(old, new):
    """[layer, old stage, new stage] of each layer whose stage differs between two layouts (layers
    per stage): what a `migrate` event lists."""
    stage_old, stage_new = np.repeat(range(len(old)), old), np.repeat(range(len(new)), new)
    pairs = enumerate(zip(stage_old.tolist(), stage_new.tolist(), strict=True))
    return [[i, a, b] for i, (a, b) in pairs if a != b]


def train_cli(script: str, workdir: Path, run: dict, *args: object) -> int:
    """A training subprocess (``script`` with ``args``) on tests/tiny.py with ``run``'s
    overrides; its return code (0, or -9 where the script killed itself)."""
    cmd = [
        sys.executable,
        script,
        *map(str, args),
        "--config=tests/tiny.py",
        f"--workdir={workdir}",
        *(f"--config.{k.replace('__', '.')}={v}" for k, v in run.items()),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=600)
    assert proc.returncode in (0, -9), proc.stdout.decode()[-2000:] + proc.stderr.decode()[-3000:]
    return proc.returncode


# The base of the 2-process runs: short, with no profiling step after a Plan change.
TWO_PROCESS_BASE = {"train.steps": 4, "train.eval_every": 4, "pipeline.profile_on_change": False}
# One program over both processes (its arrays global), or one stage per process (each holds its
# own stages' weights and exchanges what it computed from them: `Experiment.stage_rounds`).
TWO_PROCESS_LAYOUTS = {
    "one-program": {"mesh.data": 8},
    "stage-per-process": {"mesh.stage": 2, "mesh.data": 4, "train.microbatches": 2},
}


def two_processes(
    workdir: Path, overrides: dict, devices: int = 4, pythonpath: Path | None = None
) -> str:
    """Train ``overrides`` over 2 local processes of ``devices`` CPU devices each; their output.
    ``pythonpath``: a directory searched before the repository (e.g. a ``sitecustomize``)."""
    args = [f"--config.{k}={v}" for k, v in overrides.items()]
    command = [
        sys.executable, "-m", "dynjax.launch.local", "--processes", "2",
        "--devices-per-process", str(devices), "--", "--config", "tests/tiny.py",
        "--workdir", str(workdir), *args,
    ]
    path = [str(pythonpath)] if pythonpath is not None else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(ROOT)])}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:]
    return done.stdout


def one_and_two(tmp_path: Path, run: dict, devices: int = 4) -> tuple[Path, Path]:
    """Train ``run`` in this process and over 2 processes of ``devices`` CPU devices each;
    the two workdirs (process 1's is ``process_1`` inside the second)."""
    single, multi = tmp_path / "single", tmp_path / "multi"
    train(dotted_config(run), single, progress=False)
    two_processes(multi, run, devices)
    return single, multi


def stage_setup(cfg, optimizer=None, *, grad_clip=0.0):
    """The `StageSetup` of a model config, as a test's single-program step takes it."""
    return StageSetup(parts=ModelParts.of(cfg), optimizer=optimizer, grad_clip=grad_clip)


def moe_options(cfg, capacities, *, aux_loss_weight=0.01, z_loss_weight=0.0, base=()):
    """Each layer's options of ``cfg`` with the MoE layers' static-path records of
    ``capacities`` (one tuple per MoE layer) and loss weights, as the MoE plugin gives them."""
    return static_options(
        cfg.num_layers, cfg.moe_layers, capacities, base=base,
        aux_loss_weight=aux_loss_weight, z_loss_weight=z_loss_weight,
    )


def loss_terms(setup, spec, parallel, params, inputs, targets, batch_in=None):
    """(the loss to minimise, the metrics) of the one-stage ``spec`` on one batch."""
    _, _, total, metrics, _ = forward_loss(
        setup, spec, parallel, params, inputs, {"targets": targets}, batch_in
    )
    return total, metrics


def mod_config(**overrides):
    return tiny_config(mod__enabled=True, model__num_layers=4, **overrides)


# -- checkpoints -------------------------------------------------------------------------------


def one_step(exp):
    """``exp``'s state one optimizer step in (so Adam moments are non-zero), on its mesh."""
    plan = exp.initial_plan()
    step = exp.lower_train_step(plan).compile()
    state = exp.init_state()
    state["params"], state["opt_state"], _ = step(
        state["params"], state["opt_state"], exp.device_batch(exp.order.batch(0))
    )
    return state


def corrupt(step_dir):
    """Truncate every data file of the dense item to half its size: a half-written checkpoint.
    (Truncating only the largest one let a restore succeed once in a loaded suite run: which
    arrays share a file, and so what a single file's second half holds, varies from save to
    save.)"""
    files = [p for p in (step_dir / "dense").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files
    for data in files:
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def overwrite_expert(step_dir, key, expert):
    """Rewrite one expert row of a stored array with other values through tensorstore: a file
    that reads back fine, with wrong data (what only the checksums can tell)."""
    rows = layout.read_rows(step_dir / "experts", key, [expert])
    context = ocp.type_handlers.get_ts_context(use_ocdbt=True)
    info = ocp.type_handlers.ParamInfo(
        name=key.replace("/", "."), parent_dir=step_dir / "experts", ts_context=context
    )
    spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=True)
    array = ts.open(spec, open=True, context=context).result()
    array[expert].write(rows[0] + 1).result()


def recomputed_from_logs(workdir: Path) -> list[dict]:
    """Each ``checkpoint_recovery`` of the workdir recomputed from metrics.jsonl alone (the
    routing counts of every step, ``tokens_per_expert``, as logged before that recovery) and
    the event's expert sources, independently of the ledger:

    an expert restored at step s from its copy of step src lost the tokens routed to it in the
    steps after max(src, r) up to s, r the previous recovery on the trajectory that led to s
    (the one of the run that wrote checkpoint s: at r, an expert whose copy is older than r
    was restored from that same copy, so its state at r equals it); PLT is those tokens over
    all tokens routed through s, summed over the recoveries of the trajectory (eq. 7)."""
    events, metrics = events_of(workdir), read_jsonl(workdir / "metrics.jsonl")
    recoveries = [e for e in events if e["event"] == "checkpoint_recovery"]
    out: dict[float, dict] = {}

    def account(rec: dict) -> dict:
        if rec["time"] in out:
            return out[rec["time"]]
        s, when = rec["step"], rec["time"]
        tokens = {}
        for m in metrics:  # the newest record of each step logged before this recovery
            if m["time"] < when and m["step"] <= s and "tokens_per_expert" in m:
                tokens[m["step"]] = np.array(m["tokens_per_expert"], np.int64)
        assert sorted(tokens) == list(range(1, s + 1))
        writer = max(
            (e["time"] for e in events if e["event"] == "checkpoint" and e["step"] == s
             and e["time"] < when),
        )
        earlier = [r for r in recoveries if r["time"] < writer]
        prior = account(earlier[-1]) if earlier else None
        since = prior["step"] if prior else 0
        lost = {}
        for i, (layer, info) in enumerate(sorted(rec["layers"].items(), key=lambda x: int(x[0]))):
            lost[int(layer)] = [
                int(sum(tokens[t][i][e] for t in range(max(src, since) + 1, s + 1)))
                for e, src in enumerate(info["sources"])
            ]
        fault = sum(map(sum, lost.values()))
        total = int(sum(t.sum() for t in tokens.values()))
        accumulated = fault + (prior["accumulated"] if prior else 0)
        out[when] = {
            "step": s,
            "lost_tokens": lost,
            "plt": fault / total,
            "total_plt": accumulated / total,
            "accumulated": accumulated,
        }
        return out[when]

    return [account(r) for r in recoveries]


def check_recoveries(workdir: Path) -> list[dict]:
    """The run's ``checkpoint_recovery`` events, each checked against `recomputed_from_logs`
    and against the saves before it."""
    recoveries = events_of(workdir, "checkpoint_recovery")
    for rec, want in zip(recoveries, recomputed_from_logs(workdir), strict=True):
        assert rec["step"] == want["step"]
        got = {int(k): v["lost_tokens"] for k, v in rec["layers"].items()}
        assert got == want["lost_tokens"]
        assert rec["plt"] == pytest.approx(want["plt"], rel=1e-12)
        assert rec["total_plt"] == pytest.approx(want["total_plt"], rel=1e-12)
        saves = {e["step"] for e in events_of(workdir, "checkpoint") if e["time"] < rec["time"]}
        assert {s for v in rec["layers"].values() for s in v["sources"]} <= saves
    return recoveries


# -- comparing arrays --------------------------------------------------------------------------


def assert_bitwise_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_placed_like(state, target):
    """Every leaf of ``state`` is a jax.Array with the sharding ``target`` asks for."""
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(target), strict=True):
        assert isinstance(got, jax.Array) and got.sharding == want.sharding


def assert_close(ref, got, rtol, what=""):
    """Every leaf of ``got`` within ``rtol`` of ``ref``'s, relative to that leaf's largest entry."""
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(ref), jax.tree.leaves(got), strict=True
    ):
        x, y = np.asarray(x), np.asarray(y)
        err = np.max(np.abs(x - y)) / (np.max(np.abs(x)) + 1e-30)
        assert err < rtol, f"{what}{jax.tree_util.keystr(path)}: relative error {err:.2e}"


def assert_kernel_close(actual, expected, tol, name):
    """A Pallas kernel's output against its float64 reference, relative to the largest entry."""
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(expected, np.float64)
    # The interpreter fills outputs with NaN before the kernel runs: finite means fully written.
    assert np.isfinite(actual).all(), f"{name}: unwritten (NaN) or non-finite entries"
    scale = np.max(np.abs(expected), initial=0.0)
    if scale == 0:
        assert np.max(np.abs(actual), initial=0.0) == 0, f"{name}: expected exact zeros"
    else:
        err = np.max(np.abs(actual - expected)) / scale
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"


def gelu(x):
    """jax.nn.gelu's default tanh approximation, in float64."""
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def qkv(b, s, h, d, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(k, (b, s, h, d), jnp.float32) for k in keys)


def sorted_blocks(q, k, rec):
    """NumPy: per (batch, head) the sorted order's bucket and position of every token."""
    rot = rotations(rec, q.shape[2], q.shape[3])
    out = []
    for x in (q, k):
        b = np.moveaxis(np.asarray(lsh_buckets(x, rot)), 1, 2)  # [B, H, S]
        perm = np.argsort(b * x.shape[1] + np.arange(x.shape[1]), axis=-1, kind="stable")
        out += [np.take_along_axis(b, perm, -1), perm]
    return out


# -- policies' inputs and the controller's fakes -----------------------------------------------


def profile(fwd, counts, *, iteration=1.0):
    """Profile metrics of a step that ran ``counts``; backward = 2 x forward."""
    fwd = np.asarray(fwd, dtype=float)
    bounds = np.concatenate(([0], np.cumsum(counts)))[:-1]
    return {
        "loss": 1.0,
        LAYER_FORWARD: fwd,
        LAYER_BACKWARD: 2 * fwd,
        STAGE_FORWARD: np.add.reduceat(fwd, bounds),
        STAGE_BACKWARD: np.add.reduceat(2 * fwd, bounds),
        STAGE_LAYERS: np.array(counts),
        ITERATION: np.float64(iteration),
    }


def histogram(counts, bins=8):
    """How many tokens (or rows) need each count 0..bins: a needed-count histogram's row."""
    return np.bincount(counts, minlength=bins + 1).astype(float)


def histories(key, per_layer_counts, steps=4, start=0):
    """``steps`` steps from ``start`` whose metric ``key`` holds each layer's `histogram`."""
    hist = np.stack([histogram(np.asarray(c)) for c in per_layer_counts])
    return History.of([(start + t, {key: hist}) for t in range(steps)])


class Store:
    """A key-value store shared by thread 'processes': `exchange` blocks until all published."""

    def __init__(self, count: int):
        self.count = count
        self.values: dict[str, dict[int, object]] = {}
        self.cond = threading.Condition()

    def peers(self, index: int) -> "ThreadPeers":
        return ThreadPeers(self, index)


class ThreadPeers:
    def __init__(self, store: Store, index: int):
        self.store, self.index, self.count = store, index, store.count

    def publish(self, key, value):
        with self.store.cond:
            self.store.values.setdefault(key, {})[self.index] = value
            self.store.cond.notify_all()

    def collect(self, key):
        with self.store.cond:
            assert self.store.cond.wait_for(
                lambda: len(self.store.values.get(key, {})) == self.count, timeout=30
            ), f"process {self.index} waited for the others at {key}"
            return [self.store.values[key][p] for p in range(self.count)]

    def forget(self, key):
        with self.store.cond:
            self.store.values.get(key, {}).pop(self.index, None)


_TOY_INPUT = jax.ShapeDtypeStruct((4,), jnp.float32)


class ToyLowerer:
    """lower_fn for the toy step `x * microbatches`; `compile()` sleeps to mimic a slow compile.

    With `fail`, lowering any Plan but the initial `Plan()` raises.
    """

    def __init__(self, compile_delay: float = 0.0, fail: bool = False):
        self.compile_delay = compile_delay
        self.fail = fail
        self.lower_threads: list[str] = []
        self.compile_spans: list[tuple[float, float]] = []

    def __call__(self, plan: Plan):
        self.lower_threads.append(threading.current_thread().name)
        if self.fail and plan != Plan():
            raise TypeError("cannot trace")
        lowered = jax.jit(lambda x: x * plan.microbatches).lower(_TOY_INPUT)
        outer = self

        class Slow:
            def compile(self):
                start = time.perf_counter()
                time.sleep(outer.compile_delay)
                executable = lowered.compile()
                outer.compile_spans.append((start, time.perf_counter()))
                return executable

        return Slow()


@dataclass
class SetMicrobatches:
    """Proposes `microbatches` once metrics of step `after` were seen."""

    microbatches: int
    after: int = 0
    name: str = "set_microbatches"

    def propose(self, history: History, plan: Plan):
        if history.latest_step >= self.after and plan.microbatches != self.microbatches:
            return Proposal(plan.replace(microbatches=self.microbatches), "test wants it")
        return None


class Toggle:
    """Always proposes the other microbatch count: a thrashing policy."""

    name = "toggle"

    def propose(self, history, plan):
        return plan.replace(microbatches=3 - plan.microbatches)
