"""``python -m dynjax.train --config configs/<name>.py [--config.a.b=v ...] [--workdir DIR]``.

The loop dispatches steps without waiting for them: metrics reach the host through the Monitor
Δ steps late, feed the logs and the Controller's policies, and a recompiled Plan is swapped in at
the first step boundary where its executable is ready (DESIGN.md "The loop").
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np
from tqdm import tqdm

from dynjax import config as config_lib
from dynjax.checkpoint import Checkpointer, layout
from dynjax.checkpoint.parts import PartedCheckpointer, parts_are_newer, restore_parts
from dynjax.checkpoint.pec import ExpertLedger
from dynjax.checkpoint.snapshot import InjectedFault, TwoLevel
from dynjax.data import Prefetcher
from dynjax.dynamism import BUILTIN, Schemes, layer_costs
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.flops import config_flops_per_token, mfu, peak_flops
from dynjax.launch.cluster import ClusterError
from dynjax.launch.distributed import Peers, fail, initialize_from_env, joined
from dynjax.launch.release import ReleaseHook, load_release_hook, release
from dynjax.model.facts import moe_layer_indices
from dynjax.parallel.layout import layer_device_bytes, layer_sizes
from dynjax.parallel.peers import Rounds
from dynjax.parallel.profile import device_memory_limit
from dynjax.recompile import (
    STABILITY,
    AssignmentCache,
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
from dynjax.writers import LayerCostsWriter, MetricsWriter

log = logging.getLogger("dynjax")
PLT = "checkpoint/plt"  # eq. 7 of seed 004 so far: lost over processed routed tokens
SCALARS = ("loss", "aux_loss", "z_loss", "grad_norm", "dropped_fraction", PLT)


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
    # runtime values (ragged MoE capacities within their buckets) reuses the one it has.
    compiled: int = 0


def policies_for(cfg: ml_collections.ConfigDict, exp: Experiment) -> list:
    """The Controller's policies this config asks for."""
    out = [policy for plugin in exp.plugins for policy in plugin.policies()]
    b = cfg.balance
    if not (b.enabled or b.repack):
        return out
    state_bytes = layer_device_bytes(exp.abstract_state, cfg.model.num_layers)
    memory = memory_budget(cfg, exp)
    if b.enabled:
        out.append(
            Rebalance(
                total_steps=cfg.train.steps,
                layer_bytes=layer_sizes(exp.abstract_state, cfg.model.num_layers, nbytes=True),
                every=b.every,
                threshold=b.threshold,
                by=b.by,
                method=b.method,
                amortize_steps=b.amortize_steps,
                bandwidth_bytes_per_sec=b.bandwidth_bytes_per_sec,
                recompile_seconds=b.recompile_seconds,
                comm_seconds=b.comm_seconds,
                layer_params=layer_sizes(exp.abstract_state["params"], cfg.model.num_layers),
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


def memory_budget(cfg: ml_collections.ConfigDict, exp: Experiment) -> float | None:
    """Bytes one device of a stage may use: ``balance.memory_bytes``, else the devices' own
    limit (this process's: only those report it) less ``balance.memory_headroom``; None where
    neither is known (CPU)."""
    b = cfg.balance
    if b.memory_bytes:
        return float(b.memory_bytes)
    mine = [d for d in exp.mesh.devices.flat if d.process_index == jax.process_index()]
    limit = device_memory_limit(mine)
    return None if limit is None else limit * (1 - b.memory_headroom)


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
    (README "Writing a policy"). ``release_hook`` is called with the devices a re-pack frees
    (default: ``balance.release_hook``; either way a ``release`` event is logged).

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
    began = time.perf_counter()
    single = jax.process_count() == 1
    workdir = root = Path(workdir)
    if jax.process_index() > 0:
        workdir = workdir / f"process_{jax.process_index()}"
    workdir.mkdir(parents=True, exist_ok=True)
    enable_persistent_cache(os.path.expanduser(cfg.recompile.cache_dir) or None)
    exp = Experiment.from_config(cfg, schemes)
    config_policies = policies_for(cfg, exp)  # their config errors come before any work
    release_hook = release_hook or load_release_hook(cfg.balance.release_hook)
    events = EventLog(workdir / "events.jsonl")
    if not single:
        _check_multi_process(cfg, pipeline=bool(exp.ctx.pipeline_stages))
    peers = None if single else Peers()
    # A pipeline over processes: each process saves its own stages' part (`checkpoint.parts`);
    # otherwise one directory that every process writes its shards into.
    parted = not single and bool(exp.ctx.pipeline_stages)
    saving = dict(
        keep=cfg.train.keep_checkpoints, async_save=cfg.checkpoint.async_save, emit=events
    )
    if parted:
        checkpointer = PartedCheckpointer(root / "checkpoints", peers, **saving)
    else:
        checkpointer = Checkpointer(root / "checkpoints", **saving)

    def restore_target(meta: dict[str, Any]) -> dict[str, Any]:
        """Where a checkpoint's arrays go: the resumed Plan's shardings (refused first if the
        saved state cannot follow the config)."""
        changes = config_changes(meta["config"], cfg, schemes)
        check_resumable(changes, workdir, schemes)
        return exp.restore_target(exp.resumed_plan(Plan.from_dict(meta["plan"]), changes))

    if parted:
        restored = checkpointer.restore_latest(restore_target)
    else:
        restored = _restore_whole_or_parts(
            checkpointer, root / "checkpoints", restore_target, peers, events
        )
    if restored is None:
        plan, start = exp.initial_plan(), 0
        runtime = exp.runtime(plan)
        ledger = expert_ledger(cfg, exp, None, {}, events)
    else:
        state, meta = restored
        changes = config_changes(meta["config"], cfg, schemes)
        saved = Plan.from_dict(meta["plan"])
        plan, start = exp.resumed_plan(saved, changes), meta["step"]
        runtime = exp.runtime(plan, state)
        events(resume_event(start, changes, saved, plan))
        log.info("resumed from step %d of %s", start, workdir)
        ledger = expert_ledger(cfg, exp, meta, changes, events)
    twolevel = None
    if cfg.checkpoint.snapshot_every:
        twolevel = TwoLevel(
            exp.model_cfg.moe_layers if ledger is not None else (),
            cfg.moe.num_experts,
            persist_experts=cfg.checkpoint.persist_experts,
            emit=events,
            rounds=Rounds(peers, "snapshot"),
        )
        if restored is not None:  # what storage holds of each expert: the restore's sources
            twolevel.persisted_step = start
            if ledger is not None:
                twolevel.stored = expert_sources(restored[1], ledger)
    if ledger is not None:
        ledger.pinned = set(checkpointer.all_steps())
    # Written once the config is known to fit the workdir: it always describes the newest run.
    (workdir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    steps = cfg.train.steps
    if start >= steps:
        checkpointer.close()
        print(
            f"{workdir} is already trained to step {start} (train.steps={steps}); raise "
            "--config.train.steps or pass a new --workdir to train more."
        )
        return RunSummary(
            workdir,
            start,
            start,
            final_loss=None,
            eval_loss=None,
            tokens_per_sec=None,
            mfu=None,
            flops_per_token=config_flops_per_token(cfg),
            recompiles=0,
            checkpoints=checkpointer.all_steps(),
            seconds=time.perf_counter() - began,
        )

    # A pipeline profiles the first step of every Plan (seed 000 §3.1) and every n-th step;
    # each Plan's profiling programs compile with it, in the background. Over several
    # processes each times its own stages and the profiles are gathered (`Pipeline`).
    profiling = bool(plan.stage_layers)
    profile_on_change = cfg.pipeline.profile_on_change and profiling
    profile_every = cfg.pipeline.profile_every if profiling else 0
    lower = functools.partial(
        exp.lower_train_step, profiling=profile_on_change or bool(profile_every)
    )
    compiler = Compiler(lower, key_fn=exp.compile_key, max_entries=cfg.recompile.cache_size)
    first = compiler.get(plan)
    events(
        {
            "event": "compile",
            "step": start,
            "plan": plan.to_dict(),
            "lower_seconds": first.lower_seconds,
            "compile_seconds": first.compile_seconds,
        }
    )
    executable = first.executable
    budget = cfg.recompile.budget

    def validate(proposed: Plan) -> None:
        proposed.validate(runtime.plan_context(controller.plan))

    controller = Controller(
        plan,
        compiler,
        [*config_policies, *policies],
        emit=events,
        validate=validate,
        budget=Budget(budget.max_recompiles, budget.window_steps),
        peers=peers,
        # Processes run up to Δ + 1 steps apart: a survivor logs every step a dead peer finished.
        lag=cfg.recompile.delta_launch + 1,
    )
    cache = (
        AssignmentCache(
            exp.ctx.num_moe_layers,
            cfg.data.seq_len,
            exp.ctx.top_k,
            exp.ctx.num_experts,
            max_entries=cfg.moe.caching.max_entries,
        )
        if exp.step_options(plan).return_assignments
        else None
    )
    monitor = Monitor(cfg.recompile.delta_launch)
    writer = MetricsWriter(workdir)
    plugins = exp.plugins
    costs = (
        LayerCostsWriter(workdir, lambda p, m: layer_costs(plugins, p, m)) if plugins else None
    )
    logger = _Logger(writer, costs, exp, cfg.train.log_every, steps)
    bar = tqdm(
        total=steps,
        initial=start,
        desc="train",
        unit="step",
        disable=not progress,
        dynamic_ncols=True,
    )
    recompiles, compiled, eval_loss = 0, 0, None
    profile_next = profile_on_change

    def release_unused(step: int, reason: str) -> None:
        """Give back the stage sub-meshes a re-packed Plan leaves unused (seed 000 §3.4.2)."""
        stages, devices = runtime.release_unused()
        if stages:
            compiler.forget(lambda p: len(p.stage_layers) > runtime.available_stages)
            events(release(devices, stages, release_hook, step=step, reason=reason))

    profiles = {}  # step -> its pending profile, until the Monitor hands the step over

    def observe(ready: list[tuple[int, dict[str, Any]]]) -> None:
        """Steps' host metrics (with their profiles') to the ledger, logger and Controller."""
        for s, m in ready:
            pending = profiles.pop(s, None)
            if pending is not None:
                profile = pending.result()
                events(profile.event(s))
                m = {**m, **profile.metrics()}
            m = runtime.host_metrics(s, m)
            if ledger is not None:  # every step's routed tokens, for PLT and load-aware saves
                ledger.count(s + 1, m["moe/tokens_per_expert"])
                if twolevel is not None:
                    twolevel.counted(s + 1, ledger)
                m[PLT] = ledger.plt
            logger.observe(s, m, cache, controller, bar)

    release_unused(start, "resumed re-packed")

    # Only the rows of each batch this process's devices consume (issue 15 §5), read ahead. In
    # one process every Plan's devices are this one's; over several, a re-pack may move the
    # last stage (which reads the targets) to another process: read again from the swap on.
    rows = runtime.batch_rows()
    controller.start()
    batches = Prefetcher(
        functools.partial(exp.order.batch, rows=rows), start, steps, cfg.data.prefetch
    )
    c = cfg.checkpoint
    fault_at = c.inject_fault_at
    try:
        step = start
        while step < steps:
            swap = controller.poll(step)
            if swap is not None:
                migration = runtime.swap(swap.plan, swap.executable)
                if migration is not None:
                    events(migration.event(step))
                executable, plan, recompiles = swap.executable, swap.plan, recompiles + 1
                compiled += not swap.compile.cache_hit
                controller.swap_done(swap)
                release_unused(step, swap.reason)
                profile_next = profile_next or profile_on_change
                now = runtime.batch_rows()
                if not np.array_equal(now, rows):
                    rows = now
                    batches.restart(step, functools.partial(exp.order.batch, rows=rows))
            states = runtime.stage_states() if plugins else []  # live dicts, changed in place
            for plugin in plugins:  # e.g. a pruning event, on the state this step will use
                for event in plugin.before_step(step, states, plan):
                    events(event)
                    profile_next = profile_next or profile_on_change  # the model changed
            measured = {}  # e.g. layer outputs on a probe batch: they join this step's metrics
            for plugin in plugins:
                measured.update(plugin.measure(step, states, plan))
            batch = batches.get(step)
            cached = cache.lookup(batch.sample_ids) if plan.cached_routing else None
            try:
                if fault_at == step + 1:
                    fault_at = 0  # once: the re-run of this step goes through
                    raise InjectedFault(f"step {step + 1} (checkpoint.inject_fault_at)")
                if profile_next or (profile_every and step % profile_every == 0):
                    # Units run alone only where a change made them new; the others' times
                    # are rescaled from the step's timeline, taken while the loop goes on
                    # (`observe` waits).
                    metrics, profiles[step] = runtime.start_profile_step(executable, batch, cached)
                    profile_next = False
                else:
                    metrics = runtime.step(executable, batch, cached)
            except InjectedFault as fault:
                if twolevel is None:  # nothing in memory: the process ends, a restart reads storage
                    raise
                target = exp.restore_target(plan)
                flat_target = layout.flatten(target)
                snap = twolevel.recovery(flat_target)
                if snap is None:  # no usable snapshot (in some process): the same
                    raise
                log.warning("%s: %s; restoring the snapshot of step %d from host memory",
                            type(fault).__name__, fault, snap.step)
                observe(monitor.drain())  # the steps that ran: the ledger reaches the snapshot
                state = layout.unflatten_like(target, snap.placed(flat_target))
                runtime = exp.runtime(plan, state)
                recovery = {"event": "checkpoint_recovery", "step": snap.step, "plt": 0.0}
                if ledger is not None:
                    ledger = expert_ledger_from(cfg, twolevel.ledger_of(snap))
                    ledger.pinned = set(checkpointer.all_steps())
                    recovery = ledger.recover(snap.sources).event()
                events({**recovery, "source": "memory", "fault_step": step + 1})
                twolevel.rolled_back(snap.step)
                step = snap.step
                batches.restart(step)  # it read ahead from the failed step
                bar.n = step
                bar.refresh()
                continue
            monitor.push(step, metrics)
            logger.dispatched(step, batch.sample_ids, plan, measured)
            observe(monitor.pop_ready(step))
            bar.update(1)
            done = step + 1
            if twolevel is not None:
                twolevel.poll()
                if done % c.snapshot_every == 0:
                    experts = None
                    if ledger is not None and twolevel.partial_ok:
                        experts = ledger.select(ahead=twolevel.ahead())
                    twolevel.snapshot(done, runtime.checkpoint_state(), experts)
                if done % c.persist_every == 0 and done != steps:
                    twolevel.persist(
                        checkpointer,
                        exp.restore_target(plan),
                        {"plan": plan.to_dict(), "config": cfg.to_dict()},
                        catch_up=lambda: observe(monitor.drain()),
                    )
                    if ledger is not None:  # a restart reads these steps' rows
                        ledger.pinned = {*checkpointer.all_steps(), twolevel.persisted_step}
            if done % cfg.train.eval_every == 0 or done == steps:
                eval_loss = runtime.evaluate(plan)
                if eval_loss is not None:
                    writer.write(done, {"eval_loss": eval_loss})
            every = twolevel is None and done % cfg.train.checkpoint_every == 0
            if every or done == steps:
                meta, experts = {"plan": plan.to_dict(), "config": cfg.to_dict()}, None
                if ledger is not None:  # its metadata counts every step up to this one
                    observe(monitor.drain())
                    experts = ledger.select()
                    meta["pec"] = ledger.meta_after(done, experts)
                started = checkpointer.save(
                    done,
                    runtime.checkpoint_state(),
                    meta,
                    experts=experts,
                    content=cfg.checkpoint.pec_content,
                )
                if started and ledger is not None:
                    ledger.saved(done, experts)
            step += 1
        observe(monitor.drain())
        if twolevel is not None:
            twolevel.poll(wait=True)
    finally:
        batches.close()
        if twolevel is not None:
            twolevel.close()
        bar.close()
        controller.stop()
        compiler.shutdown()
        checkpointer.close()
        writer.close()
    return RunSummary(
        workdir,
        start,
        steps,
        logger.last_loss,
        eval_loss,
        logger.median_rate(),
        logger.median_mfu(),
        logger.flops_per_token,
        recompiles,
        checkpointer.all_steps(),
        time.perf_counter() - began,
        len(rows),
        batches.build_seconds / (steps - start),
        batches.wait_seconds / (steps - start),
        compiled,
    )


def expert_ledger(
    cfg: ml_collections.ConfigDict,
    exp: Experiment,
    meta: dict[str, Any] | None,
    changes: dict[str, tuple[Any, Any]],
    emit: EventLog,
) -> ExpertLedger | None:
    """The partial expert checkpoints' ledger (`dynjax.checkpoint.pec`); None without them.

    Resuming from a checkpoint that carries one accounts the fault first: the
    ``checkpoint_recovery`` event with each expert's lost steps and tokens and the PLT (even if
    this run saves full checkpoints: the restored experts lost their updates all the same). A
    changed ``checkpoint.experts_per_save`` replaces the K the ledger carried (dynamic K's).
    """
    k = ledger_k(cfg)
    if meta is not None and "pec" in meta:
        ledger = expert_ledger_from(cfg, meta["pec"])
        recovery = ledger.recover(expert_sources(meta, ledger))
        emit({**recovery.event(), "source": "storage"})
        log.info(
            "partial expert checkpoint: step %d lost %d of %d routed tokens (PLT %.4f, total "
            "%.4f)", recovery.step, recovery.event()["lost_tokens"], recovery.tokens,
            recovery.plt, recovery.total_plt,
        )
        if "checkpoint.experts_per_save" in changes and k:
            ledger.set_k(k)
        return ledger if k else None
    if not k:
        return None
    ledger = ExpertLedger(
        exp.model_cfg.moe_layers, cfg.moe.num_experts, cfg.mesh.expert, k, **_settings(cfg)
    )
    ledger.step = 0 if meta is None else meta["step"]  # a full checkpoint's run: counts from it
    return ledger


def ledger_k(cfg: ml_collections.ConfigDict) -> int:
    """K of the ledger: ``checkpoint.experts_per_save``, or with two-level checkpoints of an MoE
    model K_snapshot (all: E); 0 = no ledger."""
    c = cfg.checkpoint
    if c.snapshot_every and moe_layer_indices(cfg.model.num_layers, cfg.moe.every):
        return c.snapshot_experts or cfg.moe.num_experts
    return c.experts_per_save


def _settings(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    c = cfg.checkpoint
    return {
        "selection": c.pec_selection,
        "plt_limit": c.plt_limit,
        "dynamic_k": c.dynamic_k,
        "history": cfg.train.keep_checkpoints,
    }


def expert_ledger_from(cfg: ml_collections.ConfigDict, meta: dict[str, Any]) -> ExpertLedger:
    """The ledger of `ExpertLedger.to_meta` ``meta``, with the current config's settings."""
    return ExpertLedger.from_meta(meta, ranks=cfg.mesh.expert, **_settings(cfg))


def expert_sources(meta: dict[str, Any], ledger: ExpertLedger) -> dict[int, list[int]]:
    """Per MoE layer, the step each expert's restored state comes from: the older of its
    weights' and its optimizer state's (the storage's ``expert_sources``), so that with
    ``checkpoint.pec_content="O"`` the tokens whose moment updates were lost count."""
    sources = meta.get("expert_sources") or {}
    out = {layer: [meta["step"]] * ledger.num_experts for layer in ledger.layers}
    for layer, parts in sources.items():
        out[int(layer)] = np.min([list(p) for p in parts.values()], axis=0).tolist()
    return out


def _check_multi_process(cfg: ml_collections.ConfigDict, pipeline: bool) -> None:
    """What a multi-process run needs, refused before any work."""
    if pipeline and cfg.train.keep_checkpoints < 2:
        raise ConfigError(
            f"train.keep_checkpoints={cfg.train.keep_checkpoints}: a pipeline over processes "
            "saves one part per process, and a process that dies while saving leaves the "
            "newest step incomplete; keep at least 2 so that the step before it is complete"
        )


def _restore_whole_or_parts(
    checkpointer: Checkpointer,
    directory: Path,
    target: Any,
    peers: Peers | None,
    events: EventLog,
) -> tuple[Any, dict[str, Any]] | None:
    """The newest checkpoint a run of one program restores: its own kind, unless a pipeline
    over processes saved a newer step in parts (then those, on this process count:
    `checkpoint.parts`)."""
    if parts_are_newer(directory, checkpointer.all_steps(), peers):
        return restore_parts(
            directory, target, peers, emit=events, reload=checkpointer.reload
        )
    return checkpointer.restore_latest(target)


class _Logger:
    """Turns host metrics (Δ steps late) into log lines, cache updates and policy input."""

    def __init__(
        self,
        writer: MetricsWriter,
        costs: LayerCostsWriter | None,
        exp: Experiment,
        every: int,
        steps: int,
    ):
        self.writer, self.costs, self.exp, self.every, self.steps = writer, costs, exp, every, steps
        self.tokens_per_step = exp.cfg.train.batch_size * exp.cfg.data.seq_len
        self.plugin_metrics = [
            name for plugin in exp.plugins for name in plugin.logged_metrics
        ]
        # Model FLOPs utilisation (PaLM app. B): the config's FLOPs per token against the peak.
        self.flops_per_token = config_flops_per_token(exp.cfg)
        self.devices = exp.mesh.devices.size
        kind = jax.devices()[0].device_kind
        self.peak = exp.cfg.train.peak_flops or peak_flops(kind, exp.cfg.train.dtype)
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

    def observe(self, step, metrics, cache, controller, bar) -> None:
        ids, plan, measured = self.in_flight.pop(step)
        metrics.update(measured)
        if cache is not None:
            stability = cache.update(ids, metrics.pop("moe/assignments"))
            metrics[STABILITY] = np.nan if stability is None else stability
        controller.observe(step, metrics)
        self.last_loss = float(metrics["loss"])
        done = step + 1
        now = time.perf_counter()
        if self._mark is None:  # the first step also paid for dispatch warm-up: start timing here
            self._mark = (done, now)
        # A plugin's measurement between steps is logged with the step it preceded.
        logged = not done % self.every or done == self.steps or bool(measured)
        if self.costs is not None and (logged or "profile/layer_forward_seconds" in metrics):
            self.costs.write(done, plan, metrics)
        if not logged:
            return
        record = {k: float(metrics[k]) for k in SCALARS if k in metrics}
        record["learning_rate"] = float(self.exp.schedule(step))
        for name in self.plugin_metrics:  # e.g. each layer's pruned density
            if name in metrics:
                value = np.asarray(metrics[name], np.float64)  # NaN (not measured): null
                record[name] = np.where(np.isfinite(value), value, None).tolist()
        if done > self._mark[0]:
            rate = (done - self._mark[0]) * self.tokens_per_step / (now - self._mark[1])
            record["tokens_per_sec"] = rate
            self.rates.append(rate)
            per_device = rate / self.devices
            record["tflops_per_device"] = per_device * self.flops_per_token / 1e12
            if self.peak:
                record["mfu"] = mfu(per_device, self.flops_per_token, self.peak)
                self.mfus.append(record["mfu"])
            self._mark = (done, now)
        if "moe/tokens_per_expert" in metrics:
            record["tokens_per_expert"] = metrics["moe/tokens_per_expert"].tolist()
            record["capacity_factor"] = float(
                np.mean(plan.capacities)
                / (self.exp.ctx.group_tokens * self.exp.ctx.top_k / self.exp.ctx.num_experts)
            )
        if STABILITY in metrics and np.isfinite(metrics[STABILITY]):
            record["routing_stability"] = float(metrics[STABILITY])
            record["cached_routing"] = plan.cached_routing
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
    parser.add_argument("--config", required=True, help="config file, e.g. configs/quickstart.py")
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
    return known.config, overrides, known.workdir


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
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
    except ConfigError as err:  # found once devices are known, before training
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception:
        if not joined():
            raise
        traceback.print_exc()  # a peer may wait for this process in a collective: do not wait
        fail()  # for it in JAX's shutdown barrier
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
