"""Everything a run builds once from its config: data, model, mesh, optimizer, initial Plan.

The config is read and checked once, into records (`Experiment.settings`, `dynjax.settings`),
and unpacked here, at the edge (STYLE.md trap 1), from those records; below this point
functions take the records or the few numbers they need. A run executes either the
single-program step (`dynjax.parallel.step`) or, when its Plan has a stage assignment, the MPMD
pipeline (`dynjax.parallel.pipeline`); `runtime` builds the one its Plan needs
(`dynjax.parallel.runtime`, one protocol for the training loop).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
import optax
from flax import nnx

from dynjax import config as config_lib
from dynjax import resume
from dynjax.checkpoint.huggingface import initial_params
from dynjax.data import (
    Batch,
    TokenizerSpec,
    TokenWindows,
    TrainOrder,
    load_tokens,
    validation_batches,
)
from dynjax.dynamism import BUILTIN, Plugin, RunLink, Schemes, plan_context
from dynjax.dynamism.specs import ProgramSpecs
from dynjax.errors import ConfigError
from dynjax.launch.distributed import Peers as ProcessPeers
from dynjax.model import GPTConfig, ModelParts, abstract_gpt, abstract_params, fresh_params
from dynjax.model.facts import ModelFacts
from dynjax.model.hooks import LayerOptions
from dynjax.optim import learning_rate_schedule, make_optimizer
from dynjax.parallel import (
    expert_parallel,
    make_eval_step,
    make_mesh,
    make_train_step,
    param_shardings,
)
from dynjax.parallel.executable import PipelinePrograms
from dynjax.parallel.layout import layer_sizes
from dynjax.parallel.peers import Rounds
from dynjax.parallel.pipeline import Pipeline
from dynjax.parallel.runtime import (
    PipelineRuntime,
    Runtime,
    SingleProgramRuntime,
    pipeline_target,
)
from dynjax.parallel.single import EvalSteps, abstract_batch, lower_step, place_batch
from dynjax.parallel.stage import StageSetup
from dynjax.parallel.stages import PipelineSpec, StageSpec
from dynjax.parallel.step_inputs import BatchInputs
from dynjax.parallel.transport import Transport
from dynjax.recompile import Plan, PlanContext, PlanError
from dynjax.settings import (
    RunSettings,
    TrainSettings,
    microbatches,
    optimizer_settings,
    stage_layers,
)


def optimizer(
    train: TrainSettings, plugins: Sequence[Plugin]
) -> optax.GradientTransformation:
    """`make_optimizer`, wrapped by every enabled plugin in `Schemes` order (e.g. pruning keeps
    its masks in the optimizer state, so they are train state like the moments)."""
    opt = make_optimizer(optimizer_settings(train))
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
    cfg: ml_collections.ConfigDict  # what is written (config.json, checkpoints) and diffed
    settings: RunSettings  # the config read and checked once: what the run reads
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
    link: RunLink  # what the plugins were built with: the named exchanges between processes

    @property
    def model_cfg(self) -> GPTConfig:
        return self.facts.model

    def __post_init__(self) -> None:
        self._eval_steps = EvalSteps(
            lambda spec: make_eval_step(self.stage_setup, spec, expert_parallel(self.mesh)),
            self.settings.recompile.cache_size,
        )

    @classmethod
    def from_config(
        cls, cfg: ml_collections.ConfigDict, schemes: Schemes = BUILTIN
    ) -> Experiment:
        """The run of ``cfg``, read and checked here (`dynjax.config.check_run`)."""
        return cls.from_settings(cfg, config_lib.check_run(cfg, jax.device_count(), schemes),
                                 schemes)

    @classmethod
    def from_settings(
        cls, cfg: ml_collections.ConfigDict, run: RunSettings, schemes: Schemes = BUILTIN
    ) -> Experiment:
        """The run of ``cfg`` as read and checked into ``run`` (`check_run`'s, for ``cfg`` and
        ``schemes``): for a caller that needs the records before the run is built."""
        settings = run.scheme_settings
        facts = config_lib.model_facts(cfg, run, schemes)
        model_cfg = facts.model
        windows = TokenWindows(
            load_tokens(
                run.data.path,
                run.data.max_tokens,
                TokenizerSpec(run.data.tokenizer, run.data.eos_token, run.data.token_cache),
            ),
            run.data.seq_len,
            run.data.val_fraction,
            run.model.vocab_size,
            run.data.path,
        )
        graphdef = nnx.graphdef(abstract_gpt(model_cfg))
        t = run.train
        ctx = plan_context(facts)
        order = TrainOrder(windows, t.batch_size, run.seed)
        rounds: dict[str, Rounds] = {}
        split = jax.process_count() > 1 and bool(ctx.pipeline_stages)
        link = RunLink(
            rounds=functools.partial(_named_rounds, rounds, split),
            first_inputs=lambda: order.batch(0).inputs,
            speeds=schemes.speeds(settings, facts),
        )
        plugins = schemes.build(settings, facts, link)
        ctx = dataclasses.replace(ctx, checks=tuple(p.plan_problems for p in plugins))
        return cls(
            cfg=cfg,
            settings=run,
            ctx=ctx,
            # Devices in process order: each process of a multi-process run owns whole stages.
            mesh=make_mesh(
                run.mesh.stage,
                run.mesh.data,
                run.mesh.expert,
                sorted(jax.devices(), key=lambda d: (d.process_index, d.id)),
                tensor=run.mesh.tensor,
            ),
            graphdef=graphdef,
            optimizer=optimizer(t, plugins),
            schedule=learning_rate_schedule(
                t.learning_rate, t.warmup_steps, t.steps, t.min_lr_ratio
            ),
            windows=windows,
            order=order,
            val_batches=validation_batches(windows, t.batch_size, t.eval_batches, ctx.batch_shards),
            schemes=schemes,
            facts=facts,
            plugins=plugins,
            link=link,
        )

    # -- state -------------------------------------------------------------------------------

    def init_state(self) -> dict[str, Any]:
        """Fresh parameters (from ``seed``, or ``train.init_from``'s weights, each device
        reading its own slice) and optimizer state, placed on the mesh."""
        shardings = jax.tree.map(lambda a: a.sharding, self.abstract_state["params"])
        if self.settings.train.init_from:
            params = initial_params(
                self.model_cfg, self.settings.train.init_from, self.abstract_state["params"]
            )
        else:
            params = jax.device_put(fresh_params(self.model_cfg, self.settings.seed), shardings)
        return {"params": params, "opt_state": jax.jit(self.optimizer.init)(params)}

    def init_host_state(self) -> dict[str, Any]:
        """Fresh parameters and optimizer state as host arrays (what a pipeline splits)."""
        if self.settings.train.init_from:
            return jax.device_get(self.init_state())
        params = fresh_params(self.model_cfg, self.settings.seed)
        return jax.device_get({"params": params, "opt_state": jax.jit(self.optimizer.init)(params)})

    @functools.cached_property
    def abstract_params(self) -> dict[str, Any]:
        """Shapes and dtypes of the parameters, without shardings."""
        return abstract_params(self.model_cfg)

    @functools.cached_property
    def abstract_state(self) -> dict[str, Any]:
        """Shapes, dtypes and shardings of the training state (what lowering and restore need)."""
        placed = lambda tree: jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            tree,
            param_shardings(tree, self.mesh, fsdp=self.settings.parallel.fsdp),
        )
        params = placed(self.abstract_params)
        # Moments mirror the parameters' shardings (their paths end like the parameters');
        # scalars such as Adam's count are replicated over the whole mesh.
        return {"params": params, "opt_state": placed(jax.eval_shape(self.optimizer.init, params))}

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
        return pipeline_target(
            self.pipeline_programs, self.pipeline_spec(plan), self.abstract_state
        )

    # -- plans and steps ---------------------------------------------------------------------

    def initial_plan(self) -> Plan:
        plan = Plan(
            microbatches=microbatches(self.settings),
            dtype=self.settings.train.dtype,
            stage_layers=stage_layers(
                self.settings,
                layer_sizes(self.abstract_state["params"], self.settings.model.num_layers),
            ),
            schedule=self.settings.pipeline.schedule,
            virtual_stages=self.settings.pipeline.virtual_stages,
            remat=(self.settings.model.remat,) * self.settings.model.num_layers,
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

    def compile_key(self, plan: Plan) -> Hashable:
        """`ProgramSpecs.compile_key`: Plans the same programs run share one key."""
        return self.specs.compile_key(plan)

    def step_spec(self, plan: Plan) -> StageSpec:
        """The single-program step of ``plan`` (`ProgramSpecs.step_spec`)."""
        return self.specs.step_spec(plan)

    @functools.cached_property
    def stage_setup(self) -> StageSetup:
        """What every stage's programs share, the single program's one stage included."""
        t = self.settings.train
        return StageSetup(
            parts=ModelParts.of(self.model_cfg),
            optimizer=self.optimizer,
            grad_clip=t.grad_clip,
            fsdp=self.settings.parallel.fsdp,
            skip_nonfinite=t.nonfinite == "skip",
            recompute=self.settings.pipeline.recompute,
        )

    @functools.cached_property
    def specs(self) -> ProgramSpecs:
        """What this run's Plans' programs are built from: its plugins' records and inputs."""
        m = self.model_cfg
        return ProgramSpecs(self.plugins, m.num_layers, m.hooks, self.settings.train.batch_size)

    def layer_options(self, plan: Plan) -> tuple[LayerOptions, ...]:
        """Each layer's plugin records under ``plan`` (`ProgramSpecs.layer_options`)."""
        return self.specs.layer_options(plan)

    def lower_train_step(self, plan: Plan, *, profiling: bool = False):
        """Trace and lower the train step of ``plan`` from abstract values (no buffers touched).

        A pipeline Plan lowers only the stage programs that are not compiled yet; ``compile()``
        of the result builds them (`dynjax.parallel.executable.LoweredPipeline`). ``profiling``
        (a run that profiles its pipeline steps) adds the programs that profile a step.
        """
        if plan.stage_layers:
            spec = self.pipeline_spec(plan)
            return self.pipeline_programs.lower(spec, profiling=profiling)
        step = make_train_step(
            self.stage_setup, self.step_spec(plan), expert_parallel(self.mesh)
        )
        return lower_step(step, self.abstract_state, self.abstract_batch(plan))

    def abstract_batch(self, plan: Plan) -> dict[str, Any]:
        return abstract_batch(
            self.mesh,
            self.settings.train.batch_size,
            self.settings.data.seq_len,
            inputs=self.step_inputs(plan),
            batch_inputs=self.specs.batch_input_signatures(plan),
        )

    def device_batch(
        self, batch: Batch, batch_in: BatchInputs | None = None, plan: Plan | None = None
    ) -> dict[str, Any]:
        """A host batch (or this process's rows of it, `batch_rows`) on the mesh, with its
        batch inputs (``batch_in``: `batch_inputs`, None for none) and ``plan``'s step
        inputs (none without a Plan: for runs whose plugins declare none)."""
        inputs = {} if plan is None else self.step_inputs(plan)
        return place_batch(self.mesh, batch, batch_in, inputs)

    def step_inputs(self, plan: Plan) -> dict[str, dict[int, np.ndarray]]:
        """The step inputs of ``plan`` (`ProgramSpecs.step_inputs`)."""
        return self.specs.step_inputs(plan)

    def batch_inputs(self, step: int, batch: Batch, plan: Plan) -> BatchInputs | None:
        """The batch inputs of ``step``'s batch under ``plan`` (`ProgramSpecs.batch_inputs`)."""
        return self.specs.batch_inputs(step, batch.sample_ids, plan)

    # -- the pipeline ---------------------------------------------------------------------------

    def pipeline_spec(self, plan: Plan) -> PipelineSpec:
        """The stages of ``plan``'s pipeline (`ProgramSpecs.pipeline_spec`)."""
        return self.specs.pipeline_spec(plan)

    @functools.cached_property
    def pipeline_programs(self) -> PipelinePrograms:
        # Up to `cache_size` Plans' worth of stage programs: about four kinds per stage, and
        # a forward and a backward per layer for profiling.
        per_plan = 4 * self.ctx.pipeline_stages + 2 * self.ctx.num_layers
        entries = self.settings.recompile.cache_size * per_plan
        return PipelinePrograms(
            self.stage_setup,
            Transport(self.mesh, virtual_stages=self.settings.pipeline.virtual_stages),
            self.abstract_params,
            self.settings.data.seq_len,
            max_entries=entries,
        )

    def runtime(self, plan: Plan, state: dict[str, Any] | None = None) -> Runtime:
        """The runtime of ``plan``'s kind (`dynjax.parallel.runtime`), holding the initial state
        or ``state`` (host arrays, or arrays restored into `restore_target`, which stay where
        they are); a pipeline over several processes gathers its profiles through
        `stage_rounds`."""
        t = self.settings.train
        if plan.stage_layers:
            profiles = self.stage_rounds("profile")
            pipeline = Pipeline(self.pipeline_programs, self.abstract_state, profiles)
            pipeline.place(
                state if state is not None else self.init_host_state(),
                self.pipeline_spec(plan),
            )
            pipeline.set_inputs(self.step_inputs(plan))
            return PipelineRuntime(
                pipeline,
                pipeline_stages=self.ctx.pipeline_stages,
                batch_size=t.batch_size,
                seq_len=self.settings.data.seq_len,
                step_inputs=self.step_inputs,
                val_batches=self.val_batches,
                rounds=self.stage_rounds,
            )
        state = self.init_state() if state is None else self.place_state(state)
        return SingleProgramRuntime(
            state,
            plan,
            pipeline_stages=self.ctx.pipeline_stages,
            mesh=self.mesh,
            batch_size=t.batch_size,
            seq_len=self.settings.data.seq_len,
            place_batch=self.device_batch,
            eval_step=self.eval_step,
            val_batches=self.val_batches,
        )

    def stage_rounds(self, name: str) -> Rounds:
        """The numbered exchange by which each process combines what it computed from its own
        stages with the others': a plugin's (`Plugin.before_step`'s ``states`` are this
        process's), and the pipeline runtime's metrics, evaluations and profiles. Over the
        processes of a pipeline over several, whose stages they hold in process order; this
        process alone otherwise (one process, or one program whose arrays are global). One per
        ``name``, kept for the run (a runtime rebuilt by a recovery numbers on): every process
        makes the same calls."""
        return self.link.rounds(name)

    def eval_step(self, plan: Plan):
        """Jitted mean validation loss of one batch under ``plan``'s records (the last
        ``recompile.cache_size`` kept: `EvalSteps`)."""
        spec = dataclasses.replace(self.step_spec(plan), frozen=(), embed_frozen=False)
        return self._eval_steps.get(spec)  # no backward: nothing frozen
