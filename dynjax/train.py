"""``python -m dynjax.train --config configs/<name>.py [--config.a.b=v ...] [--workdir DIR]``.

The loop dispatches steps without waiting for them: metrics reach the host through the Monitor
Δ steps late, feed the logs and the Controller's policies, and a recompiled Plan is swapped in at
the first step boundary where its executable is ready (docs/architecture.md "The loop").

`train` is that loop, each part a named step: restore (`restore`), then per step the Plan swap,
the plugins' hooks, the dispatch (or the recovery from a fault), the log and the checkpoint.
`_Loop` holds the state between them; what is saved when is the checkpoint strategy's
(`dynjax.checkpoint.strategy`), chosen from the config in `checkpoints_for`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import os
import statistics
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np
from tqdm import tqdm

from dynjax import config as config_lib
from dynjax.checkpoint.errors import CheckpointError, NoSpaceError
from dynjax.checkpoint.rows import PartialRows
from dynjax.checkpoint.settings import CheckpointSettings
from dynjax.checkpoint.snapshot import InjectedFault
from dynjax.checkpoint.strategy import (
    Checkpoints,
    PartialRowCheckpoints,
    TwoLevelCheckpoints,
    WholeCheckpoints,
    open_storage,
    restore_latest,
)
from dynjax.data import Batch, Prefetcher
from dynjax.dynamism import BUILTIN, Plugin, Schemes, layer_costs
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.flops import gpt_flops_per_token, mfu, peak_flops
from dynjax.launch.cluster import ClusterError
from dynjax.launch.distributed import Peers, fail, initialize_from_env, joined
from dynjax.launch.preemption import PREEMPTED_EXIT, StopRequest
from dynjax.launch.release import ReleaseHook, load_release_hook, release
from dynjax.parallel.layout import layer_device_bytes, layer_sizes
from dynjax.parallel.memory_needs import device_bytes_needed
from dynjax.parallel.peers import Rounds
from dynjax.parallel.profile import device_memory_limit
from dynjax.parallel.runtime import Runtime
from dynjax.recompile import (
    Budget,
    Compiler,
    Controller,
    EventLog,
    Monitor,
    Plan,
    Policy,
    Rebalance,
    Repack,
    enable_persistent_cache,
)
from dynjax.resume import check_resumable, config_changes, resume_event
from dynjax.settings import RunSettings
from dynjax.writers import LayerCostsWriter, MetricsWriter

log = logging.getLogger("dynjax")
SCALARS = ("loss", "grad_norm", "skipped")  # the step's own; hook sets and plugins add theirs


@dataclasses.dataclass
class RunSummary:
    workdir: Path
    start_step: int
    final_step: int
    final_loss: float | None
    eval_loss: float | None
    tokens_per_sec: float | None  # median over logging intervals
    mfu: float | None  # median over logging intervals; None without a known peak
    flops_per_token: float  # model FLOPs of one trained token (forward and backward)
    recompiles: int
    checkpoints: list[int]
    seconds: float
    # The rows of each batch this process read, the host seconds per step it spent reading them
    # (on the prefetch thread, or the loop's with data.prefetch=0) and the loop spent waiting.
    batch_rows: int | None = None
    batch_build_seconds: float | None = None
    batch_wait_seconds: float | None = None
    # Of the `recompiles` Plan swaps, those that needed a new program: a swap that only moves
    # runtime values (step inputs within the buffers compiled in) reuses the one it has.
    compiled: int = 0
    # The signal the run stopped at, having saved ``final_step`` (`StopRequest`); None: it ran
    # to ``train.steps``.
    preempted_by: str | None = None
    skipped_steps: int = 0  # updates skipped for a non-finite gradient (train.nonfinite="skip")


def policies_for(settings: RunSettings, exp: Experiment) -> list:
    """The Controller's policies this config asks for."""
    out = [policy for plugin in exp.plugins for policy in plugin.policies()]
    b = settings.balance
    if not (b.enabled or b.repack):
        return out
    state_bytes = layer_device_bytes(exp.abstract_state, settings.model.num_layers)
    memory = memory_budget(settings, exp)
    if b.enabled:
        out.append(
            Rebalance(
                total_steps=settings.train.steps,
                layer_bytes=layer_sizes(exp.abstract_state, settings.model.num_layers, nbytes=True),
                every=b.every,
                threshold=b.threshold,
                by=b.by,
                method=b.method,
                amortize_steps=b.amortize_steps,
                bandwidth_bytes_per_sec=b.bandwidth_bytes_per_sec,
                recompile_seconds=b.recompile_seconds,
                comm_seconds=b.comm_seconds,
                layer_params=layer_sizes(exp.abstract_state["params"], settings.model.num_layers),
                memory_bytes=memory,
                layer_state_bytes=None if memory is None else state_bytes,
            )
        )
    if b.repack:  # after Rebalance: it packs the layout Rebalance settled on, once profiled
        if memory is None:
            raise ConfigError(
                f"balance.repack: the {jax.default_backend()} backend reports no device memory "
                "limit; set balance.memory_bytes to the bytes one device may use"
            )
        out.append(
            Repack(
                memory_bytes=memory,
                layer_state_bytes=state_bytes,
                every=b.repack_every,
                target=b.repack_target,
                max_slowdown=b.repack_max_slowdown,
                comm_seconds=b.comm_seconds,
            )
        )
    return out


SHRINK = ("train.batch_size, train.microbatches (more, smaller), parallel.fsdp=True, mesh.* "
          "(more devices per stage or more stages), model.scan_layers=True, "
          "train.dtype=bfloat16")


def fits(needed: dict[int, int], limit: float | None) -> None:
    """Refuse, before training, a step whose programs need more of a device than it has
    (`device_bytes_needed` against `device_limit`; nothing to check where either is unknown)."""
    if limit is None:
        return
    for stage, need in sorted(needed.items()):
        if need > limit:
            where = f"pipeline stage {stage}" if len(needed) > 1 else "the train step"
            raise ConfigError(
                f"{where} needs {_size(need)} of each device's memory (XLA's memory "
                f"analysis: arguments, outputs, temporaries) but a device has {_size(limit)} "
                f"(balance.memory_bytes, else what its allocator reports); shrink it with "
                f"{SHRINK}"
            )


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def device_limit(settings: RunSettings, exp: Experiment) -> float | None:
    """Bytes one device has: ``balance.memory_bytes``, else the devices' own limit (this
    process's: only those report it); None where neither is known (CPU)."""
    if settings.balance.memory_bytes:
        return float(settings.balance.memory_bytes)
    mine = [d for d in exp.mesh.devices.flat if d.process_index == jax.process_index()]
    return device_memory_limit(mine)


def memory_budget(settings: RunSettings, exp: Experiment) -> float | None:
    """Bytes one device of a stage may use: `device_limit`, the devices' own less
    ``balance.memory_headroom``."""
    limit = device_limit(settings, exp)
    if limit is None or settings.balance.memory_bytes:
        return limit
    return limit * (1 - settings.balance.memory_headroom)


def train(
    cfg: ml_collections.ConfigDict,
    workdir: str | Path,
    *,
    policies: Sequence[Policy] = (),
    progress: bool = True,
    release_hook: ReleaseHook | None = None,
    schemes: Schemes = BUILTIN,
) -> RunSummary:
    """Train (or resume) the run in ``workdir``; returns what the summary prints.

    ``schemes`` are the dynamism schemes the config's sections are for (`dynjax.dynamism`:
    the built-in ones, or those with a user's added, docs/plugins.md).

    ``policies`` are user policies run by the Controller after the ones the config asks for
    (docs/architecture.md "Writing a policy"). ``release_hook`` is called with the devices a
    re-pack frees (default: ``balance.release_hook``; either way a ``release`` event is logged).

    In a multi-process run (`dynjax.launch`) every process runs this loop over its own devices
    (the single program's share of the mesh, or its pipeline stages) and reads only the batch
    rows they consume; process i > 0 writes its files to ``workdir/process_<i>``. Process 0's
    policies decide for every process (a pipeline's profiles gathered from every process's
    stages), and all swap at the same step (`Controller` with `Peers`), moving layers between
    processes' stages if the Plan says so. A
    single program over every process's devices checkpoints into ``workdir/checkpoints``, each
    process writing its own shards (`Checkpointer`); in a pipeline over processes each process
    writes its own stages' part (`PartedCheckpointer`), and a run resumes from either kind on
    any process count.
    """
    with StopRequest() as stop:  # SIGTERM, SIGINT, SIGUSR1: stop at a boundary, saved
        return _train(cfg, workdir, policies, progress, release_hook, schemes, stop)


def _train(
    cfg: ml_collections.ConfigDict,
    workdir: str | Path,
    policies: Sequence[Policy],
    progress: bool,
    release_hook: ReleaseHook | None,
    schemes: Schemes,
    stop: StopRequest,
) -> RunSummary:
    began = time.perf_counter()
    run = _open_run(cfg, workdir, release_hook, schemes)
    checkpoints = checkpoints_for(run)
    plan, start, runtime = restore(run, checkpoints)
    # Written once the config is known to fit the workdir: it always describes the newest run.
    (run.workdir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    steps = run.settings.train.steps
    if start >= steps:
        return _already_trained(run, checkpoints, start, began)
    try:
        loop = _Loop(run, checkpoints, plan, start, runtime, [*run.policies, *policies], progress)
    except BaseException:  # e.g. a step too big for the device (`fits`)
        checkpoints.close()
        raise
    try:
        step = start
        while step < steps:
            loop.swap(step, stop)
            if loop.controller.preempted_by is not None:
                loop.preempt(step, stop)
                break
            measured = loop.before_step(step)
            batch = loop.batches.get(step)
            try:
                metrics = loop.dispatch(step, batch)
            except InjectedFault as fault:
                resumed = loop.recover(fault, step)
                if resumed is None:  # nothing in memory: the process ends, a restart reads storage
                    raise
                step = resumed
                continue
            loop.log(step, batch, measured, metrics)
            loop.after_step(step + 1)
            step += 1
        else:
            loop.finish()
    finally:
        loop.close()
    return loop.summary(began, step)


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm is not finite: the model diverged (issue 32 §5)."""


@dataclasses.dataclass
class _Run:
    """What a run builds once from its config, before it restores: directories, experiment,
    event log, peers and the config's policies."""

    cfg: ml_collections.ConfigDict
    exp: Experiment
    root: Path  # the workdir given: checkpoints live here
    workdir: Path  # this process's files: ``root``, or ``root/process_<i>``
    events: EventLog
    peers: Peers | None
    policies: list[Policy]
    release_hook: ReleaseHook | None

    @property
    def settings(self) -> RunSettings:
        """The config read and checked once (`Experiment.settings`): what the run reads."""
        return self.exp.settings


def _open_run(
    cfg: ml_collections.ConfigDict,
    workdir: str | Path,
    release_hook: ReleaseHook | None,
    schemes: Schemes,
) -> _Run:
    single = jax.process_count() == 1
    workdir = root = Path(workdir)
    if jax.process_index() > 0:
        workdir = workdir / f"process_{jax.process_index()}"
    for directory in (workdir, root / "checkpoints"):
        writable_directory(directory)
    settings = config_lib.check_run(cfg, jax.device_count(), schemes)
    enable_persistent_cache(os.path.expanduser(settings.recompile.cache_dir) or None)
    exp = Experiment.from_settings(cfg, settings, schemes)
    config_policies = policies_for(settings, exp)  # their config errors come before any work
    release_hook = release_hook or load_release_hook(settings.balance.release_hook)
    events = EventLog(workdir / "events.jsonl")
    if not single:
        _check_multi_process(settings, pipeline=bool(exp.ctx.pipeline_stages))
    peers = None if single else Peers()
    return _Run(cfg, exp, root, workdir, events, peers, config_policies, release_hook)


def writable_directory(path: Path) -> None:
    """Create ``path`` if missing and check that files can be written there, before any work:
    a ``ConfigError`` naming it and the fix, not an ``OSError`` from deep inside a save."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--workdir: {path} is a file, not a directory; pass a directory "
                          "(it is created if missing)")
    probe = path / f".dynjax-write-test-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"--workdir: cannot write to {path} ({err.strerror}); pass a "
                          "directory this user can write to, on a writable filesystem") from err


def checkpoints_for(run: _Run) -> Checkpoints:
    """The run's checkpoint strategy, chosen from its config and the row-stacked leaves a
    plugin declares (`partial_rows`): two-level with ``checkpoint.snapshot_every``, else
    partial checkpoints when the declaring plugin's K is positive, else whole."""
    settings, exp, c = run.settings, run.exp, run.settings.checkpoint
    partial = partial_rows(exp.plugins, c, settings.train.keep_checkpoints)
    storage = open_storage(
        run.root,
        run.peers,
        parted=run.peers is not None and bool(exp.ctx.pipeline_stages),
        keep=settings.train.keep_checkpoints,
        partial=partial,
        async_save=c.async_save,
        emit=run.events,
    )
    common = dict(
        steps=settings.train.steps,
        content=c.pec_content,
        config=run.cfg.to_dict(),
        target=exp.restore_target,
        emit=run.events,
    )
    if c.snapshot_every:
        return TwoLevelCheckpoints(
            storage,
            partial,
            snapshot_every=c.snapshot_every,
            persist_every=c.persist_every,
            rounds=Rounds(run.peers, "snapshot"),
            **common,
        )
    kind = PartialRowCheckpoints if partial is not None and partial.k else WholeCheckpoints
    return kind(storage, partial, every=settings.train.checkpoint_every, **common)


def partial_rows(
    plugins: Sequence[Plugin], checkpoint: CheckpointSettings, history: int
) -> PartialRows | None:
    """The row-stacked leaves the run's plugins declare (`Plugin.checkpoint_rows`), from one
    plugin at most: one checkpoint layout holds one scheme's rows."""
    declared = {p.name: p.checkpoint_rows(checkpoint, history) for p in plugins}
    declared = {name: rows for name, rows in declared.items() if rows is not None}
    if len(declared) > 1:
        raise ConfigError(
            f"the enabled schemes {sorted(declared)} each declare row-stacked leaves for "
            "partial checkpoints; a run checkpoints the rows of one: turn the others off"
        )
    return next(iter(declared.values()), None)


def restore(run: _Run, checkpoints: Checkpoints) -> tuple[Plan, int, Runtime]:
    """The Plan, first step and runtime of the newest checkpoint, or of a fresh start."""
    cfg, exp = run.cfg, run.exp

    def restore_target(meta: dict[str, Any]) -> dict[str, Any]:
        """Where a checkpoint's arrays go: the resumed Plan's shardings (refused first if the
        saved state cannot follow the config)."""
        changes = config_changes(meta["config"], cfg, exp.schemes)
        check_resumable(changes, run.workdir, exp.schemes)
        return exp.restore_target(exp.resumed_plan(Plan.from_dict(meta["plan"]), changes))

    restored = restore_latest(
        checkpoints.storage, run.root / "checkpoints", restore_target, run.peers, run.events
    )
    if restored is None:
        plan = exp.initial_plan()
        runtime = exp.runtime(plan)
        checkpoints.on_resume(None, k_changed=False)
        return plan, 0, runtime
    state, meta = restored
    changes = config_changes(meta["config"], cfg, exp.schemes)
    saved = Plan.from_dict(meta["plan"])
    plan, start = exp.resumed_plan(saved, changes), meta["step"]
    runtime = exp.runtime(plan, state)
    run.events(resume_event(start, changes, saved, plan))
    if jax.process_index() == 0:
        print(f"resumed from step {start} of {run.root / 'checkpoints'}", flush=True)
    checkpoints.on_resume(meta, k_changed="checkpoint.experts_per_save" in changes)
    return plan, start, runtime


@contextlib.contextmanager
def _opened(
    cfg: ml_collections.ConfigDict, workdir: str | Path, schemes: Schemes
) -> Iterator[tuple[_Run, Checkpoints]]:
    """The run of ``cfg`` in ``workdir`` and its checkpoints, as the loop opens them, for the
    commands that save or read its state without training; the checkpoints closed after."""
    run = _open_run(cfg, workdir, None, schemes)
    checkpoints = checkpoints_for(run)
    try:
        yield run, checkpoints
    finally:
        checkpoints.close()


def write_initial_checkpoint(
    cfg: ml_collections.ConfigDict, workdir: str | Path, schemes: Schemes = BUILTIN
) -> None:
    """Save a fresh start of ``cfg`` (``train.init_from``'s weights where set) as step 0 of
    ``workdir``, so a training run resumes from it (`dynjax.hf.convert.import_model`)."""
    with _opened(cfg, workdir, schemes) as (run, checkpoints):
        plan, start, runtime = restore(run, checkpoints)
        if start:
            raise ConfigError(f"{workdir} already holds step {start}: use a new --workdir")
        (run.workdir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        checkpoints.save_now(0, runtime, plan, lambda: None)
        checkpoints.finish()


def newest_checkpoint(
    cfg: ml_collections.ConfigDict, workdir: str | Path, schemes: Schemes = BUILTIN
) -> tuple[dict[str, Any], Plan, Experiment]:
    """The parameters of ``workdir``'s newest checkpoint as its runtime holds them (on the
    run's mesh), its Plan and the run's experiment: what a command that reads a trained model
    without training needs (its layer options are the experiment's of that Plan)."""
    with _opened(cfg, workdir, schemes) as (run, checkpoints):
        if not checkpoints.storage.all_steps():
            raise ConfigError(f"{workdir} holds no checkpoint: train it first")
        plan, _, runtime = restore(run, checkpoints)
        return runtime.checkpoint_state()["params"], plan, run.exp


def newest_params(
    cfg: ml_collections.ConfigDict, workdir: str | Path, schemes: Schemes = BUILTIN
) -> dict[str, Any]:
    """The parameters of ``workdir``'s newest checkpoint as host arrays (an export's)."""
    return jax.device_get(newest_checkpoint(cfg, workdir, schemes)[0])


def _already_trained(
    run: _Run, checkpoints: Checkpoints, start: int, began: float
) -> RunSummary:
    checkpoints.close()
    steps = run.settings.train.steps
    print(
        f"{run.workdir} is already trained to step {start} (train.steps={steps}); raise "
        "--config.train.steps or pass a new --workdir to train more."
    )
    return RunSummary(
        run.workdir,
        start,
        start,
        final_loss=None,
        eval_loss=None,
        tokens_per_sec=None,
        mfu=None,
        flops_per_token=gpt_flops_per_token(run.exp.model_cfg),
        recompiles=0,
        checkpoints=checkpoints.storage.all_steps(),
        seconds=time.perf_counter() - began,
    )


class _Loop:
    """The training loop's state between its named steps: the current Plan, executable and
    runtime, and what consumes each step's metrics (Monitor, logger, Controller, checkpoints).
    """

    def __init__(
        self,
        run: _Run,
        checkpoints: Checkpoints,
        plan: Plan,
        start: int,
        runtime: Runtime,
        policies: list[Policy],
        progress: bool,
    ) -> None:
        cfg, exp, settings = run.cfg, run.exp, run.settings
        self.run, self.cfg, self.exp, self.events = run, cfg, exp, run.events
        self.settings = settings
        self.checkpoints, self.plan, self.start, self.runtime = checkpoints, plan, start, runtime
        self.steps = settings.train.steps
        # A pipeline profiles the first step of every Plan (seed 000 §3.1) and every n-th step;
        # each Plan's profiling programs compile with it, in the background. Over several
        # processes each times its own stages and the profiles are gathered (`Pipeline`).
        profiling = bool(plan.stage_layers)
        self.profile_on_change = settings.pipeline.profile_on_change and profiling
        self.profile_every = settings.pipeline.profile_every if profiling else 0
        self.profile_next = self.profile_on_change
        self.profiles = {}  # step -> its pending profile, until the Monitor hands the step over
        self.compiler, self.executable = self._compile_first()
        self.controller = self._controller(policies)
        self.monitor = Monitor(settings.recompile.delta_launch)
        self.writer = MetricsWriter(run.workdir, resumed_from=start or None)
        self.plugins = plugins = exp.plugins
        costs = (
            LayerCostsWriter(run.workdir, lambda p, m: layer_costs(plugins, p, m))
            if plugins
            else None
        )
        self.logger = _Logger(self.writer, costs, exp, settings.train.log_every, self.steps)
        self.bar = tqdm(
            total=self.steps,
            initial=start,
            desc="train",
            unit="step",
            disable=not progress,
            dynamic_ncols=True,
        )
        self.recompiles, self.compiled, self.eval_loss = 0, 0, None
        self.preempted_by: str | None = None  # the signal the loop stopped at (`preempt`)
        # train.nonfinite="skip": updates skipped in all, and in a row up to the newest step.
        self.skipped, self.in_a_row = 0, 0
        self.fault_at = settings.checkpoint.inject_fault_at
        self.release_unused(start, "resumed re-packed")
        # Only the rows of each batch this process's devices consume (issue 15 §5), read ahead.
        # In one process every Plan's devices are this one's; over several, a re-pack may move
        # the last stage (which reads the targets) to another process: read again from the swap.
        self.rows = runtime.batch_rows()
        self.controller.start()
        self.batches = Prefetcher(
            functools.partial(exp.order.batch, rows=self.rows), start, self.steps,
            settings.data.prefetch,
        )
        # Over several processes each compiled only its own stages, some for longer: they
        # meet before the first step, whose first transfer between them would otherwise wait
        # for the slower one inside gloo's context set-up, which gives up after 30 s.
        exp.stage_rounds("started").all(None)

    def _compile_first(self) -> tuple[Compiler, Any]:
        """The Compiler, and the executable of the first Plan (a ``compile`` event)."""
        exp, plan = self.exp, self.plan
        lower = functools.partial(
            exp.lower_train_step, profiling=self.profile_on_change or bool(self.profile_every)
        )
        compiler = Compiler(
            lower, key_fn=exp.compile_key, max_entries=self.settings.recompile.cache_size
        )
        first = compiler.get(plan)
        try:
            fits(device_bytes_needed(first.executable), device_limit(self.settings, exp))
        except ConfigError:
            compiler.shutdown()
            raise
        self.events(
            {
                "event": "compile",
                "step": self.start,
                "plan": plan.to_dict(),
                "lower_seconds": first.lower_seconds,
                "compile_seconds": first.compile_seconds,
            }
        )
        return compiler, first.executable

    def _controller(self, policies: list[Policy]) -> Controller:
        budget = self.settings.recompile.budget

        def validate(proposed: Plan) -> None:
            used = len(self.controller.plan.stage_layers)
            stages = self.runtime.stages_available(used)
            proposed.validate(dataclasses.replace(self.exp.ctx, pipeline_stages=stages))

        return Controller(
            self.plan,
            self.compiler,
            policies,
            emit=self.events,
            validate=validate,
            budget=Budget(budget.max_recompiles, budget.window_steps),
            peers=self.run.peers,
            # Processes run up to Δ + 1 steps apart: a survivor logs every step a dead peer
            # finished.
            lag=self.settings.recompile.delta_launch + 1,
            blocking=self.settings.recompile.blocking,
        )

    def release_unused(self, step: int, reason: str) -> None:
        """Give back the stage sub-meshes a re-packed Plan leaves unused (seed 000 §3.4.2)."""
        runtime = self.runtime
        stages, devices = runtime.release_unused()
        if stages:
            self.compiler.forget(lambda p: len(p.stage_layers) > runtime.available_stages)
            self.events(release(devices, stages, self.run.release_hook, step=step, reason=reason))

    def swap(self, step: int, stop: StopRequest) -> None:
        """Swap in the Controller's new Plan if its executable is ready (and pass on a request
        to stop: every process stops at the same boundary, `Controller.preempted_by`)."""
        swap = self.controller.poll(step, stop.signal)
        if swap is None:
            return
        migration = self.runtime.swap(swap.plan, swap.executable)
        if migration is not None:
            self.events(migration.event(step))
        self.executable, self.plan = swap.executable, swap.plan
        self.recompiles += 1
        self.compiled += not swap.compile.cache_hit
        self.controller.swap_done(swap)
        self.release_unused(step, swap.reason)
        self.profile_next = self.profile_next or self.profile_on_change
        now = self.runtime.batch_rows()
        if not np.array_equal(now, self.rows):
            self.rows = now
            self.batches.restart(step, functools.partial(self.exp.order.batch, rows=now))

    def before_step(self, step: int) -> dict[str, Any]:
        """The plugins' changes to the state this step will use, and what they measured on it
        (e.g. layer outputs on a probe batch: they join this step's metrics)."""
        plugins, runtime, plan = self.plugins, self.runtime, self.plan
        events = self.events
        profile_next, profile_on_change = self.profile_next, self.profile_on_change
        states = runtime.stage_states() if plugins else []  # live dicts, changed in place
        for plugin in plugins:  # e.g. a pruning event, on the state this step will use
            for event in plugin.before_step(step, states, plan):
                events(event)
                profile_next = profile_next or profile_on_change  # the model changed
        self.profile_next = profile_next
        measured = {}  # e.g. layer outputs on a probe batch: they join this step's metrics
        for plugin in plugins:
            measured.update(plugin.measure(step, states, plan))
        return measured

    def dispatch(self, step: int, batch: Batch) -> dict[str, Any]:
        """Dispatch ``step`` (profiled where due); its metrics as device arrays."""
        runtime, executable = self.runtime, self.executable
        batch_in = self.exp.batch_inputs(step, batch, self.plan)  # e.g. cached routes
        if self.fault_at == step + 1:
            self.fault_at = 0  # once: the re-run of this step goes through
            raise InjectedFault(f"step {step + 1} (checkpoint.inject_fault_at)")
        if self.profile_next or (self.profile_every and step % self.profile_every == 0):
            # Units run alone only where a change made them new; the others' times are
            # rescaled from the step's timeline, taken while the loop goes on (`observe` waits).
            metrics, self.profiles[step] = runtime.start_profile_step(executable, batch, batch_in)
            self.profile_next = False
            return metrics
        return runtime.step(executable, batch, batch_in)

    def recover(self, fault: InjectedFault, step: int) -> int | None:
        """Go on from the checkpoint strategy's state in memory (its step), if it has one."""
        recovered = self.checkpoints.recover(fault, step, self.plan, self.catch_up)
        if recovered is None:
            return None
        step, state = recovered
        self.runtime = self.exp.runtime(self.plan, state)
        self.batches.restart(step)  # it read ahead from the failed step
        self.bar.n = step
        self.bar.refresh()
        return step

    def log(self, step: int, batch: Batch, measured: dict[str, Any], metrics: Any) -> None:
        """Queue ``step``'s metrics; those of the steps now Δ behind reach the host."""
        self.monitor.push(step, metrics)
        self.logger.dispatched(step, batch.sample_ids, self.plan, measured)
        self.observe(self.monitor.pop_ready(step))
        self.bar.update(1)

    def catch_up(self) -> None:
        """Every dispatched step's metrics to the host now."""
        self.observe(self.monitor.drain())

    def observe(self, ready: list[tuple[int, dict[str, Any]]]) -> None:
        """Steps' host metrics (with their profiles') to the checkpoints, logger and Controller.
        A non-finite loss or gradient norm stops the run (`NonFiniteError`): a save logs every
        step up to it first, so no state after a diverged step is saved."""
        for s, m in ready:
            self.require_finite(s, m)
            pending = self.profiles.pop(s, None)
            if pending is not None:
                profile = pending.result()
                self.events(profile.event(s))
                m = {**m, **profile.metrics()}
            m = self.runtime.host_metrics(s, m)
            self.checkpoints.counted(s + 1, m)
            self.logger.observe(s, m, self.controller, self.bar, self.monitor.completed_at(s))

    def require_finite(self, step: int, metrics: dict[str, Any]) -> None:
        """Raise `NonFiniteError` naming the step, what diverged and the newest checkpoint: at
        a non-finite loss or gradient norm, or with ``train.nonfinite="skip"`` once more than
        ``train.max_skipped`` updates in a row were skipped."""
        bad = {k: float(metrics[k]) for k in ("loss", "grad_norm")
               if k in metrics and not np.isfinite(metrics[k])}
        if metrics.get("skipped"):
            self.skipped, self.in_a_row = self.skipped + 1, self.in_a_row + 1
            if self.in_a_row <= self.settings.train.max_skipped:
                return
            bad = {"skipped": self.in_a_row}
        else:
            self.in_a_row = 0
        if not bad:
            return
        saved = [s for s in self.checkpoints.storage.all_steps() if s <= step]
        names = {"loss": "loss {}", "grad_norm": "gradient norm {}",
                 "skipped": "{} updates skipped in a row (more than train.max_skipped)"}
        what = ", ".join(names[k].format(v) for k, v in bad.items())
        where = (f"the newest checkpoint before it is step {saved[-1]} in "
                 f"{self.run.root / 'checkpoints'}, where a rerun resumes" if saved
                 else "no checkpoint was saved before it")
        raise NonFiniteError(
            f"step {step + 1}: {what}: the model diverged and training stopped; {where}. "
            "Lower train.learning_rate or raise train.warmup_steps, then rerun"
        )

    def after_step(self, done: int) -> None:
        """Snapshot, evaluate and save after step ``done`` where due."""
        self.checkpoints.after_step(done, self.runtime, self.plan, self.catch_up)
        if done % self.settings.train.eval_every == 0 or done == self.steps:
            # Every dispatched step observed first, each as it completes: after the evaluation,
            # which waits for the device, they would all look done at once (a resumed run's
            # first interval measured a rate 1e5 times too high).
            self.catch_up()
            self.eval_loss = self.runtime.evaluate(self.plan)
            if self.eval_loss is not None:
                self.writer.write(done, {"eval_loss": self.eval_loss})
        self.checkpoints.save(done, self.runtime, self.plan, self.catch_up)

    def finish(self) -> None:
        self.catch_up()
        self.checkpoints.finish()

    def preempt(self, step: int, stop: StopRequest) -> None:
        """Stop at boundary ``step`` on a signal: every dispatched step's metrics logged, then
        its checkpoint saved whole and waited for, and a ``preempted`` event (issue 32 §1)."""
        self.catch_up()
        signal = self.controller.preempted_by
        saved = self.checkpoints.save_now(step, self.runtime, self.plan, self.catch_up)
        self.checkpoints.finish()
        waited = None if stop.at is None else round(time.perf_counter() - stop.at, 3)
        self.events({"event": "preempted", "step": step, "signal": signal, "saved": saved,
                     "seconds_since_signal": waited})
        self.preempted_by = signal

    def close(self) -> None:
        self.monitor.close()
        self.batches.close()
        self.bar.close()
        self.controller.stop()
        self.compiler.shutdown()
        self.checkpoints.close()
        self.writer.close()

    def summary(self, began: float, final_step: int) -> RunSummary:
        logger, batches, done = self.logger, self.batches, max(final_step - self.start, 1)
        return RunSummary(
            self.run.workdir,
            self.start,
            final_step,
            logger.last_loss,
            self.eval_loss,
            logger.median_rate(),
            logger.median_mfu(),
            logger.flops_per_token,
            self.recompiles,
            self.checkpoints.storage.all_steps(),
            time.perf_counter() - began,
            len(self.rows),
            batches.build_seconds / done,
            batches.wait_seconds / done,
            self.compiled,
            self.preempted_by,
            self.skipped,
        )


def _check_multi_process(settings: RunSettings, pipeline: bool) -> None:
    """What a multi-process run needs, refused before any work."""
    if pipeline and settings.train.keep_checkpoints < 2:
        raise ConfigError(
            f"train.keep_checkpoints={settings.train.keep_checkpoints}: a pipeline over processes "
            "saves one part per process, and a process that dies while saving leaves the "
            "newest step incomplete; keep at least 2 so that the step before it is complete"
        )


class _Logger:
    """Turns host metrics (Δ steps late) into log lines, the plugins' observations (e.g. a
    routing cache's updates) and policy input."""

    def __init__(
        self,
        writer: MetricsWriter,
        costs: LayerCostsWriter | None,
        exp: Experiment,
        every: int,
        steps: int,
    ):
        self.writer, self.costs, self.exp, self.every, self.steps = writer, costs, exp, every, steps
        self.tokens_per_step = exp.settings.train.batch_size * exp.settings.data.seq_len
        self.plugin_metrics = [
            name for plugin in exp.plugins for name in plugin.logged_metrics
        ]
        # Scalars: the step's own, the hook sets' step metrics (e.g. auxiliary losses) and the
        # plugins' own.
        self.scalars = tuple(
            dict.fromkeys(
                (*SCALARS, *exp.model_cfg.hooks.step_metrics)
                + tuple(name for plugin in exp.plugins for name in plugin.logged_scalars)
            )
        )
        # Model FLOPs utilisation (PaLM app. B): the config's FLOPs per token against the peak.
        self.flops_per_token = gpt_flops_per_token(exp.model_cfg)
        self.devices = exp.mesh.devices.size
        kind = jax.devices()[0].device_kind
        self.peak = exp.settings.train.peak_flops or peak_flops(kind, exp.settings.train.dtype)
        self.mfus: list[float] = []
        # Per step in flight: its samples, the Plan it ran with (its metrics arrive Δ steps
        # later, possibly after a swap, and are labelled with the Plan that produced them) and
        # what plugins measured before it ran (`Plugin.measure`).
        self.in_flight: dict[int, tuple[np.ndarray, Plan, dict[str, Any]]] = {}
        self.last_loss: float | None = None
        self.rates: list[float] = []
        self._mark: tuple[int, float] | None = None

    def dispatched(
        self, step: int, sample_ids: np.ndarray, plan: Plan, measured: dict[str, Any]
    ) -> None:
        self.in_flight[step] = (sample_ids, plan, measured)

    def observe(self, step, metrics, controller, bar, completed: float) -> None:
        """One step's host metrics; ``completed``: when the step finished (`Monitor.completed_at`),
        which times its tokens/s."""
        ids, plan, measured = self.in_flight.pop(step)
        metrics.update(measured)
        for plugin in self.exp.plugins:  # e.g. a routing cache's update, before the policies
            plugin.observe(step, metrics, ids, plan)
        controller.observe(step, metrics)
        self.last_loss = float(metrics["loss"])
        done = step + 1
        if self._mark is None:  # the first step also paid for dispatch warm-up: start timing here
            self._mark = (done, completed)
        # A plugin's measurement between steps is logged with the step it preceded.
        logged = not done % self.every or done == self.steps or bool(measured)
        if self.costs is not None and (logged or "profile/layer_forward_seconds" in metrics):
            self.costs.write(done, plan, metrics)
        if not logged:
            return
        record = {k: float(metrics[k]) for k in self.scalars if k in metrics}
        record["learning_rate"] = float(self.exp.schedule(step))
        for name in self.plugin_metrics:  # e.g. each layer's pruned density
            if name in metrics:
                value = np.asarray(metrics[name], np.float64)  # NaN (not measured): null
                record[name] = np.where(np.isfinite(value), value, None).tolist()
        if done > self._mark[0]:
            rate = (done - self._mark[0]) * self.tokens_per_step / (completed - self._mark[1])
            record["tokens_per_sec"] = rate
            self.rates.append(rate)
            per_device = rate / self.devices
            record["tflops_per_device"] = per_device * self.flops_per_token / 1e12
            if self.peak:
                record["mfu"] = mfu(per_device, self.flops_per_token, self.peak)
                self.mfus.append(record["mfu"])
            self._mark = (done, completed)
        for plugin in self.exp.plugins:  # fields of their own
            record.update(plugin.record_fields(metrics, plan))
        self.writer.write(done, record)
        bar.set_postfix(
            loss=f"{record['loss']:.3f}",
            tok_s=f"{record.get('tokens_per_sec', 0):.0f}",
            refresh=False,
        )

    def median_rate(self) -> float | None:
        return statistics.median(self.rates) if self.rates else None

    def median_mfu(self) -> float | None:
        return statistics.median(self.mfus) if self.mfus else None


def format_summary(s: RunSummary) -> str:
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)
    rows = [
        ("steps", f"{s.start_step} -> {s.final_step}"),
        ("final train loss", fmt(s.final_loss, ".4f")),
        ("eval loss", fmt(s.eval_loss, ".4f")),
        ("tokens/s (median)", fmt(s.tokens_per_sec, ",.0f")),
        ("model FLOPs/token", f"{s.flops_per_token / 1e6:,.1f} M (forward + backward)"),
        ("MFU (median)", "n/a (no known peak: set train.peak_flops)" if s.mfu is None
         else f"{100 * s.mfu:.1f} %"),
        ("recompiles", f"{s.recompiles} Plan swaps, {s.compiled} of them compiled"),
        *([("skipped updates", f"{s.skipped_steps} (non-finite gradients)")]
          if s.skipped_steps else []),
        ("checkpoints", ", ".join(map(str, s.checkpoints)) or "none"),
        ("batches (host)", "n/a" if s.batch_build_seconds is None else
         f"{s.batch_rows} rows of each read here, {1e3 * s.batch_build_seconds:.2f} ms/step "
         f"reading, {1e3 * s.batch_wait_seconds:.2f} ms/step waited for"),
        ("wall time", f"{s.seconds:.1f} s"),
        ("workdir", f"{s.workdir} (metrics.jsonl, events.jsonl, tensorboard/, checkpoints/)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["dynjax run summary"] + [f"  {k:<{width}}  {v}" for k, v in rows])


def parse_args(argv: list[str]) -> tuple[str, list[str], str | None]:
    """Split ``--config FILE``, ``--config.a.b=v`` (or ``--config.a.b v``) and ``--workdir``."""
    parser = argparse.ArgumentParser(
        prog="python -m dynjax.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        help="config file, e.g. configs/quickstart.py (default: the --workdir's config.py, as "
        "python -m dynjax.hf import writes)",
    )
    parser.add_argument(
        "--workdir",
        default=None,
        help="run directory (default workdirs/<config name>); reusing it resumes",
    )
    known, rest = parser.parse_known_args(argv)
    overrides, i = [], 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--config."):
            parser.error(f"unrecognised argument {arg!r}: overrides look like --config.a.b=VALUE")
        body = arg[len("--config.") :]
        if "=" not in body:
            if i + 1 >= len(rest):
                parser.error(f"{arg} needs a value")
            body, i = f"{body}={rest[i + 1]}", i + 1
        overrides.append(body)
        i += 1
    config = known.config
    if config is None:
        kept = Path(known.workdir or "") / "config.py"
        if known.workdir is None or not kept.is_file():
            parser.error("--config is required (or a --workdir holding the config.py that "
                         "python -m dynjax.hf import writes)")
        config = str(kept)
    return config, overrides, known.workdir


def _without_closed_loop_noise(previous):
    """``sys.unraisablehook`` less the callbacks Orbax's background writer leaves, after a
    failed save, for an event loop it has closed: Python prints each as an ignored exception
    with its traceback (hundreds when a disk fills), while the save's failure is reported once
    already (``checkpoint_failed``)."""

    if getattr(previous, "without_closed_loop_noise", False):  # main() ran before
        return previous

    def hook(unraisable) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        previous(unraisable)

    hook.without_closed_loop_noise = True
    return hook


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.unraisablehook = _without_closed_loop_noise(sys.unraisablehook)
    try:  # a process of a multi-process launch (local, SLURM or Kubernetes)
        initialize_from_env()
    except ClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    config_path, overrides, workdir = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg, schemes = config_lib.load_run(config_path, overrides)
        config_lib.validate_config(cfg, jax.device_count(), schemes)
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    workdir = workdir or str(Path("workdirs") / Path(config_path).stem)
    progress = sys.stderr.isatty() or "DYNJAX_PROGRESS" in os.environ
    try:
        summary = train(cfg, workdir, progress=progress, schemes=schemes)
    except (ConfigError, NonFiniteError, NoSpaceError) as err:  # bad input, diverged, disk full
        print(f"error: {err}", file=sys.stderr)
        return 2
    except CheckpointError as err:  # e.g. no checkpoint of the workdir could be restored
        print(f"error: {err}", file=sys.stderr)
        if joined():
            fail()  # a peer may wait for this process in a collective: do not wait for it
        return 2
    except Exception as err:
        if "RESOURCE_EXHAUSTED" in str(err):  # where the backend could not tell beforehand
            print(f"error: out of device memory ({str(err).splitlines()[0][:300]}); shrink the "
                  f"step with {SHRINK}", file=sys.stderr)
            return 2
        if not joined():
            raise
        traceback.print_exc()  # a peer may wait for this process in a collective: do not wait
        fail()  # for it in JAX's shutdown barrier
    print(format_summary(summary))
    if summary.preempted_by is not None:
        saved = summary.final_step in summary.checkpoints
        print(
            f"preempted by {summary.preempted_by}: "
            + (f"saved step {summary.final_step} in {Path(workdir) / 'checkpoints'}; "
               if saved else f"step {summary.final_step} could not be saved (events.jsonl); ")
            + "run the same command again to resume"
            + f" (exit status {PREEMPTED_EXIT})"
        )
        return PREEMPTED_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
