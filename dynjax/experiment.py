"""Everything a run builds once from its config: data, model, mesh, optimizer, initial Plan.

The config is unpacked here, at the edge (STYLE.md trap 1); below this point functions take the
few numbers they need. A run executes either the single-program step (`dynjax.parallel.step`) or,
when its Plan has a stage assignment, the MPMD pipeline (`dynjax.parallel.pipeline`); `runtime`
wraps both behind one small interface for the training loop.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dynjax import config as config_lib
from dynjax import resume
from dynjax.balance import schedule_tasks
from dynjax.data import Batch, TokenWindows, TrainOrder, load_tokens, validation_batches
from dynjax.dynamism import BUILTIN, Plugin, RunLink, Schemes, plan_context, plan_layer_options
from dynjax.errors import ConfigError
from dynjax.launch.distributed import Peers as ProcessPeers
from dynjax.model import GPT, GPTConfig, ModelParts, fresh_params
from dynjax.model.facts import ModelFacts
from dynjax.model.hooks import LayerOptions
from dynjax.optim import learning_rate_schedule, make_optimizer
from dynjax.parallel import (
    TOKEN_AXES,
    StepOptions,
    batch_sharding,
    expert_parallel,
    make_eval_step,
    make_mesh,
    make_train_step,
    param_shardings,
)
from dynjax.parallel.feed import local_devices, place_rows, process_rows
from dynjax.parallel.layout import join, layer_sizes
from dynjax.parallel.peers import Rounds
from dynjax.parallel.pipeline import (
    Migration,
    PendingProfile,
    Pipeline,
    PipelinePrograms,
    host_metrics,
)
from dynjax.parallel.stage_programs import StageSetup
from dynjax.parallel.stages import PipelineSpec, stage_specs
from dynjax.parallel.transport import Transport
from dynjax.recompile import Plan, PlanContext, PlanError, ragged_totals
from dynjax.recompile.speeds import measure_speeds


def optimizer(
    cfg: ml_collections.ConfigDict, plugins: Sequence[Plugin]
) -> optax.GradientTransformation:
    """`make_optimizer`, wrapped by every enabled plugin in `Schemes` order (e.g. pruning keeps
    its masks in the optimizer state, so they are train state like the moments)."""
    opt = make_optimizer(cfg.train)
    for plugin in plugins:
        opt = plugin.wrap_optimizer(opt)
    return opt


def _named_rounds(rounds: dict[str, Rounds], split: bool, name: str) -> Rounds:
    """``rounds[name]``, made on first use: over the processes when ``split``, else alone."""
    if name not in rounds:
        rounds[name] = Rounds(ProcessPeers() if split else None, name)
    return rounds[name]


@dataclasses.dataclass
class Experiment:
    cfg: ml_collections.ConfigDict
    model_cfg: GPTConfig
    ctx: PlanContext
    mesh: Any
    graphdef: Any
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    windows: TokenWindows
    order: TrainOrder
    val_batches: list[Batch]
    schemes: Schemes  # the schemes the run was given, enabled or not (its config's sections)
    facts: ModelFacts
    plugins: tuple[Plugin, ...]  # this run's instances of the enabled schemes
    _eval_steps: OrderedDict = dataclasses.field(default_factory=OrderedDict, repr=False)
    _layer_options: dict = dataclasses.field(default_factory=dict, repr=False)
    _rounds: dict = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def from_config(
        cls, cfg: ml_collections.ConfigDict, schemes: Schemes = BUILTIN
    ) -> Experiment:
        config_lib.validate_config(cfg, jax.device_count(), schemes)
        facts = config_lib.model_facts(cfg, schemes)
        model_cfg = facts.model
        windows = TokenWindows(
            load_tokens(cfg.data.path, cfg.data.max_tokens),
            cfg.data.seq_len,
            cfg.data.val_fraction,
            cfg.model.vocab_size,
            cfg.data.path,
        )
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: GPT(model_cfg, rngs=nnx.Rngs(0))))
        t = cfg.train
        ctx = plan_context(facts)
        order = TrainOrder(windows, t.batch_size, cfg.seed)
        rounds: dict[str, Rounds] = {}
        split = jax.process_count() > 1 and bool(ctx.pipeline_stages)
        probe = schemes.speed_probe(cfg, facts)  # timed here: no plugin hook times the device
        link = RunLink(
            rounds=functools.partial(_named_rounds, rounds, split),
            first_inputs=lambda: order.batch(0).inputs,
            speeds=None if probe is None else measure_speeds(*probe),
        )
        plugins = schemes.build(cfg, facts, link)
        return cls(
            cfg=cfg,
            model_cfg=model_cfg,
            ctx=ctx,
            # Devices in process order: each process of a multi-process run owns whole stages.
            mesh=make_mesh(
                cfg.mesh.stage,
                cfg.mesh.data,
                cfg.mesh.expert,
                sorted(jax.devices(), key=lambda d: (d.process_index, d.id)),
                tensor=cfg.mesh.tensor,
            ),
            graphdef=graphdef,
            optimizer=optimizer(cfg, plugins),
            schedule=learning_rate_schedule(
                t.learning_rate, t.warmup_steps, t.steps, t.min_lr_ratio
            ),
            windows=windows,
            order=order,
            val_batches=validation_batches(windows, t.batch_size, t.eval_batches, ctx.batch_shards),
            schemes=schemes,
            facts=facts,
            plugins=plugins,
            _rounds=rounds,
        )

    # -- state -------------------------------------------------------------------------------

    def init_state(self) -> dict[str, Any]:
        """Fresh parameters (from ``seed``) and optimizer state, placed on the mesh."""
        params = jax.device_put(fresh_params(self.model_cfg, self.cfg.seed), self.param_shardings)
        return {"params": params, "opt_state": jax.jit(self.optimizer.init)(params)}

    def init_host_state(self) -> dict[str, Any]:
        """Fresh parameters and optimizer state as host arrays (what a pipeline splits)."""
        params = fresh_params(self.model_cfg, self.cfg.seed)
        return jax.device_get({"params": params, "opt_state": jax.jit(self.optimizer.init)(params)})

    @functools.cached_property
    def abstract_params(self) -> dict[str, Any]:
        """Shapes and dtypes of the parameters, without shardings."""
        return jax.eval_shape(lambda: fresh_params(self.model_cfg, 0))

    @functools.cached_property
    def abstract_state(self) -> dict[str, Any]:
        """Shapes, dtypes and shardings of the training state (what lowering and restore need)."""
        params = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            self.abstract_params,
            param_shardings(self.abstract_params, self.mesh, fsdp=self.cfg.parallel.fsdp),
        )
        # Moments mirror the parameters' shardings (their paths end like the parameters');
        # scalars such as Adam's count are replicated over the whole mesh.
        opt_state = jax.eval_shape(self.optimizer.init, params)
        opt_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            opt_state,
            param_shardings(opt_state, self.mesh, fsdp=self.cfg.parallel.fsdp),
        )
        return {"params": params, "opt_state": opt_state}

    @property
    def param_shardings(self):
        return jax.tree.map(lambda a: a.sharding, self.abstract_state["params"])

    def place_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Host arrays, or arrays placed otherwise, onto this run's mesh."""
        shardings = jax.tree.map(lambda a: a.sharding, self.abstract_state)
        return jax.device_put(state, shardings)

    def restore_target(self, plan: Plan) -> dict[str, Any]:
        """The abstract state a checkpoint restores into to run ``plan``: each leaf with the
        sharding it takes in ``plan``'s runtime (in a pipeline, that of the first stage
        holding it), so Orbax reads every shard straight onto its device. In a pipeline over
        processes, the leaves of this process's stages only (None elsewhere)."""
        if not plan.stage_layers:
            return self.abstract_state
        transport = self.pipeline_programs.transport
        stages = [
            self.pipeline_programs.shapes(s)
            for s in self.pipeline_spec(plan).stages
            if transport.is_local(s.index)
        ]
        return join(
            self.abstract_state,
            [{"params": s.params, "opt_state": s.opt_state} for s in stages],
            partial=not transport.all_local,
        )

    # -- plans and steps ---------------------------------------------------------------------

    def initial_plan(self) -> Plan:
        plan = Plan(
            microbatches=config_lib.microbatches(self.cfg),
            dtype=self.cfg.train.dtype,
            stage_layers=config_lib.stage_layers(
                self.cfg, layer_sizes(self.abstract_state["params"], self.cfg.model.num_layers)
            ),
            schedule=self.cfg.pipeline.schedule,
        )
        for plugin in self.plugins:
            plan = plugin.initial_plan(plan)
        plan.validate(self.ctx)
        return plan

    def resumed_plan(self, saved: Plan, changes: dict[str, tuple[Any, Any]]) -> Plan:
        """A checkpoint's Plan under this run's config: fields whose config keys changed
        (``changes``, `dynjax.resume.config_changes`) come from the new config, the rest (what
        the policies made of them) stay. A re-packed assignment (fewer stages than the mesh)
        stays only on the same mesh; on another its unused sub-meshes may not exist."""
        initial = self.initial_plan()
        plan = resume.resumed_plan(saved, initial, changes, self.schemes)
        mesh_changed = any(k.startswith("mesh.") for k in changes)
        if len(plan.stage_layers) != self.ctx.pipeline_stages and mesh_changed:
            plan = plan.replace(stage_layers=initial.stage_layers)
        try:
            plan.validate(self.ctx)
        except PlanError as err:
            raise ConfigError(
                f"the checkpoint's Plan cannot run with this config ({err}); resume with the "
                "saved config or pass a new --workdir"
            ) from None
        return plan

    @property
    def ragged(self) -> bool:
        """Whether the MoE layers take the ragged path (capacities as a step input)."""
        return self.ctx.num_moe_layers > 0 and self.cfg.moe.dispatch == "ragged"

    def ragged_totals(self, plan: Plan) -> tuple[int, ...]:
        """The ragged path's static buffers of ``plan``; () on the static path."""
        if not self.ragged:
            return ()
        moe = self.cfg.moe
        return ragged_totals(
            self.ctx,
            plan.capacities,
            self.cfg.mesh.expert,
            moe.capacity.bucket,
            expert_choice=moe.routing == "expert_choice",
        )

    def compile_key(self, plan: Plan) -> Hashable:
        """What the train step's program depends on: on the ragged path the capacities only
        through their bucketed totals, so Plans that differ in per-expert capacities within the
        same totals share one executable (issue 12 §1)."""
        if not self.ragged:
            return plan
        return plan.replace(capacities=()), self.ragged_totals(plan)

    def step_options(self, plan: Plan) -> StepOptions:
        return StepOptions(
            capacities=() if self.ragged else plan.capacities,
            ragged_totals=self.ragged_totals(plan),
            cached_routing=plan.cached_routing,
            microbatches=plan.microbatches,
            dtype=plan.dtype,
            aux_loss_weight=self.cfg.moe.aux_loss_weight,
            z_loss_weight=self.cfg.moe.z_loss_weight,
            return_assignments=self.ctx.num_moe_layers > 0 and self.cfg.moe.caching.enabled,
            frozen_layers=plan.frozen_layers,
            layer_options=self.layer_options(plan),
        )

    def layer_options(self, plan: Plan) -> tuple[LayerOptions, ...]:
        """Each layer's plugin records under ``plan`` (computed once per Plan)."""
        if plan not in self._layer_options:
            self._layer_options = {plan: plan_layer_options(self.plugins, plan)}
        return self._layer_options[plan]

    def lower_train_step(self, plan: Plan, *, profiling: bool = False):
        """Trace and lower the train step of ``plan`` from abstract values (no buffers touched).

        A pipeline Plan lowers only the stage programs that are not compiled yet; ``compile()``
        of the result builds them (`dynjax.parallel.pipeline.LoweredPipeline`). ``profiling``
        (a run that profiles its pipeline steps) adds the programs that profile a step.
        """
        if plan.stage_layers:
            spec = self.pipeline_spec(plan)
            return self.pipeline_programs.lower(spec, profiling=profiling)
        step = make_train_step(
            self.graphdef, self.optimizer, self.step_options(plan), expert_parallel(self.mesh)
        )
        state = self.abstract_state
        shardings = jax.tree.map(lambda a: a.sharding, state)
        jitted = jax.jit(
            step,
            in_shardings=(shardings["params"], shardings["opt_state"], None),
            out_shardings=(shardings["params"], shardings["opt_state"], None),
            donate_argnums=(0, 1),
        )
        return jitted.lower(state["params"], state["opt_state"], self.abstract_batch(plan))

    def abstract_batch(self, plan: Plan) -> dict[str, jax.ShapeDtypeStruct]:
        b, s = self.cfg.train.batch_size, self.cfg.data.seq_len
        tokens = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=batch_sharding(self.mesh))
        batch = {"inputs": tokens, "targets": tokens}
        if plan.cached_routing:
            shape = (self.ctx.num_moe_layers, b, s, self.ctx.top_k)
            batch["cached"] = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.cached_sharding)
        if self.ragged:
            shape = (self.ctx.num_moe_layers, self.ctx.num_experts)
            batch["capacities"] = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.replicated)
        return batch

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @property
    def cached_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(None, TOKEN_AXES))

    def device_batch(
        self, batch: Batch, cached: np.ndarray | None = None, plan: Plan | None = None
    ) -> dict[str, jax.Array]:
        """A host batch (or this process's rows of it, `batch_rows`) on the mesh; on the ragged
        MoE path with ``plan``'s capacities."""
        sharding, rows = batch_sharding(self.mesh), np.arange(len(batch.sample_ids))
        out = {
            "inputs": place_rows(batch.inputs, batch.rows, rows, sharding),
            "targets": place_rows(batch.targets, batch.rows, rows, sharding),
        }
        if cached is not None:
            out["cached"] = jax.device_put(cached, self.cached_sharding)
        if self.ragged:
            if plan is None:
                raise ValueError("moe.dispatch='ragged' takes the Plan's capacities: pass plan")
            caps = np.asarray(plan.capacities, np.int32)
            out["capacities"] = jax.device_put(caps, self.replicated)
        return out

    # -- the pipeline ---------------------------------------------------------------------------

    def pipeline_spec(self, plan: Plan) -> PipelineSpec:
        stages = stage_specs(
            plan.stage_layers,
            moe_layers=self.model_cfg.moe_layers,
            capacities=plan.capacities,
            frozen_layers=plan.frozen_layers,
            microbatches=plan.microbatches,
            batch_size=self.cfg.train.batch_size,
            cached_routing=plan.cached_routing,
            dtype=plan.dtype,
            options=self.layer_options(plan),
            ragged_totals=self.ragged_totals(plan),
        )
        tasks = schedule_tasks(plan.schedule, len(stages), plan.microbatches)
        return PipelineSpec(stages, plan.schedule, tasks)

    @functools.cached_property
    def pipeline_programs(self) -> PipelinePrograms:
        t, moe = self.cfg.train, self.cfg.moe
        setup = StageSetup(
            parts=ModelParts.of(self.model_cfg),
            optimizer=self.optimizer,
            grad_clip=t.grad_clip,
            aux_loss_weight=moe.aux_loss_weight,
            z_loss_weight=moe.z_loss_weight,
            return_assignments=self.ctx.num_moe_layers > 0 and moe.caching.enabled,
            fsdp=self.cfg.parallel.fsdp,
        )
        # Up to `cache_size` Plans' worth of stage programs: about four kinds per stage, and
        # a forward and a backward per layer for profiling.
        per_plan = 4 * self.ctx.pipeline_stages + 2 * self.ctx.num_layers
        entries = self.cfg.recompile.cache_size * per_plan
        return PipelinePrograms(
            setup,
            Transport(self.mesh),
            self.abstract_params,
            self.cfg.data.seq_len,
            max_entries=entries,
        )

    def runtime(self, plan: Plan, state: dict[str, Any] | None = None):
        """The runtime of ``plan``'s kind, holding the initial state or ``state`` (host arrays,
        or arrays restored into `restore_target`, which stay where they are); a pipeline over
        several processes gathers its profiles through `stage_rounds`."""
        if plan.stage_layers:
            profiles = self.stage_rounds("profile")
            pipeline = Pipeline(self.pipeline_programs, self.abstract_state, profiles)
            pipeline.place(
                state if state is not None else self.init_host_state(),
                self.pipeline_spec(plan),
            )
            if self.ragged:
                pipeline.set_capacities(plan.capacities)
            return PipelineRuntime(self, pipeline)
        state = self.init_state() if state is None else self.place_state(state)
        return SingleProgramRuntime(self, state, plan)

    def stage_rounds(self, name: str) -> Rounds:
        """The numbered exchange by which each process combines what it computed from its own
        stages with the others': a plugin's (`Plugin.before_step`'s ``states`` are this
        process's), and the pipeline runtime's metrics, evaluations and profiles. Over the
        processes of a pipeline over several, whose stages they hold in process order; this
        process alone otherwise (one process, or one program whose arrays are global). One per
        ``name``, kept for the run (a runtime rebuilt by a recovery numbers on): every process
        makes the same calls."""
        split = jax.process_count() > 1 and bool(self.ctx.pipeline_stages)
        return _named_rounds(self._rounds, split, name)

    def eval_step(self, plan: Plan):
        """Jitted mean validation loss of one batch under ``plan``'s capacities. The last
        ``recompile.cache_size`` are kept, like the Compiler's train steps: a dynamic-capacity
        run makes a new one at every capacity change."""
        opts = dataclasses.replace(self.step_options(plan), frozen_layers=())  # no backward
        fn = self._eval_steps.pop(opts, None) or jax.jit(
            make_eval_step(self.graphdef, opts, expert_parallel(self.mesh))
        )
        self._eval_steps[opts] = fn
        while len(self._eval_steps) > self.cfg.recompile.cache_size:
            self._eval_steps.popitem(last=False)
        return fn

    def evaluate(self, params, plan: Plan) -> float | None:
        if not self.val_batches:
            return None
        fn = self.eval_step(plan)
        losses = [fn(params, self.device_batch(b, plan=plan)) for b in self.val_batches]
        return float(np.mean(jax.device_get(losses)))


class SingleProgramRuntime:
    """The training state of the single-program step, and the calls the training loop makes."""

    def __init__(self, exp: Experiment, state: dict[str, Any], plan: Plan) -> None:
        self.exp, self.state, self.plan = exp, state, plan

    def step(self, executable, batch: Batch, cached: np.ndarray | None):
        """Dispatch one step; returns its metrics as device arrays."""
        state = self.state
        state["params"], state["opt_state"], metrics = executable(
            state["params"], state["opt_state"], self.exp.device_batch(batch, cached, self.plan)
        )
        return metrics

    def batch_rows(self, devices: frozenset[jax.Device] | None = None) -> np.ndarray:
        """The rows of each batch that ``devices`` (default: this process's) consume."""
        exp = self.exp
        placement = (batch_sharding(exp.mesh), np.arange(exp.cfg.train.batch_size))
        return process_rows([placement], exp.cfg.data.seq_len, devices or local_devices())

    def host_metrics(self, step: int, metrics: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return metrics

    def swap(self, plan: Plan, executable) -> Migration | None:
        """Every Plan of this runtime shares one state layout: nothing to migrate (the ragged
        MoE path's next batches carry the new Plan's capacities)."""
        self.plan = plan
        return None

    def plan_context(self, current: Plan) -> PlanContext:
        return self.exp.ctx

    def release_unused(self) -> tuple[tuple[int, ...], list[jax.Device]]:
        """One program over the whole mesh: nothing to give back."""
        return (), []

    def checkpoint_state(self) -> dict[str, Any]:
        return self.state

    def stage_states(self) -> list[dict[str, Any]]:
        """The live ``{"params", "opt_state"}`` dict of each stage (one here), for plugins
        that change the state between steps (`Plugin.before_step`)."""
        return [self.state]

    def evaluate(self, plan: Plan) -> float | None:
        return self.exp.evaluate(self.state["params"], plan)


class PipelineRuntime:
    """The MPMD pipeline behind the same calls as `SingleProgramRuntime`.

    A Plan with fewer stages than the mesh (a re-pack, seed 000 §3.4) runs stage s on sub-mesh
    s; `release_unused` then gives the trailing sub-meshes back for good: later Plans may not
    use them (`plan_context`), since a cluster scheduler may have handed them to another job.
    A Plan with fewer stages is always released down to when swapped in, so no Plan ever uses
    more stage sub-meshes than the one before it.
    """

    def __init__(self, exp: Experiment, pipeline: Pipeline) -> None:
        self.exp, self.pipeline = exp, pipeline
        self.available_stages = exp.ctx.pipeline_stages

    def plan_context(self, current: Plan) -> PlanContext:
        """What a new Plan is validated against while ``current`` is the Controller's Plan: the
        stage sub-meshes ``current`` uses. Those beyond it are released when it is swapped in
        (the Controller publishes a Plan before the training loop swaps and releases)."""
        stages = min(self.available_stages, len(current.stage_layers))
        return dataclasses.replace(self.exp.ctx, pipeline_stages=stages)

    def release_unused(self) -> tuple[tuple[int, ...], list[jax.Device]]:
        """Give back the stage sub-meshes the current Plan does not use: returns their indices
        and devices (empty when there are none). Their state already moved away (`swap`)."""
        used = self.pipeline.spec.num_stages
        stages = tuple(range(used, self.available_stages))
        if not stages:
            return (), []
        self.available_stages = used
        self.pipeline.programs.release(stages)
        meshes = self.pipeline.transport.stage_meshes
        return stages, [d for s in stages for d in meshes[s].devices.flat]

    def batch_rows(self, devices: frozenset[jax.Device] | None = None) -> np.ndarray:
        """The rows of each batch that ``devices`` (default: this process's) consume: every row
        of every microbatch their first stage's inputs or their targets-reading stages hold (a
        process with only middle stages reads none)."""
        placements = self.pipeline.batch_placements(self.exp.cfg.train.batch_size)
        return process_rows(placements, self.exp.cfg.data.seq_len, devices or local_devices())

    def step(self, executable, batch: Batch, cached: np.ndarray | None):
        return self.pipeline.step(executable, batch.inputs, batch.targets, cached, batch.rows)

    def profile_step(self, executable, batch: Batch, cached: np.ndarray | None):
        """`step`, profiled (blocks): returns (metrics with the profile's added, Profile). On a
        new layout the units a Plan change made new run alone and the others keep their times;
        later profiles rescale them by their step's timeline (`Pipeline.start_profile_step`).

        The metrics also name the layout that ran (`profile/stage_layers`, layers per stage),
        so a policy can tell a profile of the current Plan from an older one."""
        metrics, pending = self.start_profile_step(executable, batch, cached)
        profile = pending.result()
        return {**metrics, **profile.metrics()}, profile

    def start_profile_step(
        self, executable, batch: Batch, cached: np.ndarray | None
    ) -> tuple[dict[str, Any], PendingProfile]:
        """`profile_step` without waiting for a periodic profile (`Pipeline.start_profile_step`):
        returns the step's metrics and the pending `Profile`, whose metrics the training loop
        adds to the step's when the Monitor hands them over (Δ steps later: the step is done)."""
        return self.pipeline.start_profile_step(
            executable, batch.inputs, batch.targets, cached, batch.rows
        )

    def host_metrics(self, step: int, metrics: dict[str, Any]) -> dict[str, np.ndarray]:
        """The host metrics of ``step``: every process contributes its stages' (in order)."""
        stages = {}
        # Numbered by exchange, not by step: a step repeats after an in-memory recovery.
        for part in self.exp.stage_rounds("metrics").all(metrics["stages"]):
            stages.update(part)
        return host_metrics({**metrics, "stages": stages})

    def swap(self, plan: Plan, executable) -> Migration | None:
        """Migrate layers to their new stages when the state layout changed (`Pipeline.swap`);
        a change of capacities, cached routing or schedule swaps without waiting (on the
        ragged MoE path the next steps take the new capacities as an input)."""
        migration = self.pipeline.swap(executable)
        if self.exp.ragged:
            self.pipeline.set_capacities(plan.capacities)
        return migration if migration is not None and migration.layers else None

    def checkpoint_state(self) -> dict[str, Any]:
        """This process's stages' leaves (`Pipeline.full_state`): all of them in one process."""
        return self.pipeline.full_state()

    def stage_states(self) -> list[dict[str, Any]]:
        """The live ``{"params", "opt_state"}`` dict of each stage of this process, in stage
        order, keyed as in the full state (`Plugin.before_step`)."""
        return [self.pipeline.state[s] for s in sorted(self.pipeline.state)]

    def evaluate(self, plan: Plan) -> float | None:
        local = self.pipeline.evaluate((b.inputs, b.targets) for b in self.exp.val_batches)
        losses = self.exp.stage_rounds("eval").all(local)  # the last stage's process has it
        return next((loss for loss in losses if loss is not None), None)
