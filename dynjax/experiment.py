"""Everything a run builds once from its config: data, model, mesh, optimizer, initial Plan.

The config is unpacked here, at the edge (STYLE.md trap 1); below this point functions take the
few numbers they need.
"""

from __future__ import annotations

import dataclasses
import functools
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
from dynjax.data import Batch, TokenWindows, TrainOrder, load_tokens, validation_batches
from dynjax.model import GPT, GPTConfig
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
from dynjax.recompile import Plan, PlanContext, static_capacities


def gpt_config(cfg: ml_collections.ConfigDict) -> GPTConfig:
    m, moe = cfg.model, cfg.moe
    return GPTConfig(
        vocab_size=m.vocab_size,
        num_layers=m.num_layers,
        d_model=m.d_model,
        num_heads=m.num_heads,
        mlp_dim=m.mlp_dim,
        max_len=cfg.data.seq_len,
        positions=m.positions,
        moe_layers=config_lib.moe_layer_indices(cfg),
        num_experts=moe.num_experts,
        top_k=moe.top_k,
        expert_mlp_dim=moe.expert_mlp_dim,
    )


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
    _eval_steps: dict = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, cfg: ml_collections.ConfigDict) -> Experiment:
        config_lib.validate_config(cfg, jax.device_count())
        model_cfg = gpt_config(cfg)
        windows = TokenWindows(
            load_tokens(cfg.data.path, cfg.data.max_tokens),
            cfg.data.seq_len,
            cfg.data.val_fraction,
            cfg.model.vocab_size,
        )
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: GPT(model_cfg, rngs=nnx.Rngs(0))))
        t = cfg.train
        ctx = PlanContext(
            num_moe_layers=len(model_cfg.moe_layers),
            num_experts=cfg.moe.num_experts,
            top_k=cfg.moe.top_k,
            group_tokens=cfg.data.seq_len,
            batch_size=t.batch_size,
        )
        return cls(
            cfg=cfg,
            model_cfg=model_cfg,
            ctx=ctx,
            mesh=make_mesh(cfg.mesh.stage, cfg.mesh.data, cfg.mesh.expert),
            graphdef=graphdef,
            optimizer=make_optimizer(t),
            schedule=learning_rate_schedule(
                t.learning_rate, t.warmup_steps, t.steps, t.min_lr_ratio
            ),
            windows=windows,
            order=TrainOrder(windows, t.batch_size, cfg.seed),
            val_batches=validation_batches(windows, t.batch_size, t.eval_batches),
        )

    # -- state -------------------------------------------------------------------------------

    def init_state(self) -> dict[str, Any]:
        """Fresh parameters (from ``seed``) and optimizer state, placed on the mesh."""
        params = nnx.to_pure_dict(nnx.state(GPT(self.model_cfg, rngs=nnx.Rngs(self.cfg.seed))))
        params = jax.device_put(params, self.param_shardings)
        return {"params": params, "opt_state": jax.jit(self.optimizer.init)(params)}

    @functools.cached_property
    def abstract_state(self) -> dict[str, Any]:
        """Shapes, dtypes and shardings of the training state (what lowering and restore need)."""
        params = jax.eval_shape(
            lambda: nnx.to_pure_dict(nnx.state(GPT(self.model_cfg, rngs=nnx.Rngs(0))))
        )
        params = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            params,
            param_shardings(params, self.mesh),
        )
        opt_state = jax.eval_shape(self.optimizer.init, params)
        opt_shardings = jax.jit(self.optimizer.init).lower(params).compile().output_shardings
        opt_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            opt_state,
            opt_shardings,
        )
        return {"params": params, "opt_state": opt_state}

    @property
    def param_shardings(self):
        return jax.tree.map(lambda a: a.sharding, self.abstract_state["params"])

    def place_state(self, host_state: dict[str, Any]) -> dict[str, Any]:
        """Host arrays (e.g. restored from a checkpoint) onto this run's mesh."""
        shardings = jax.tree.map(lambda a: a.sharding, self.abstract_state)
        return jax.device_put(host_state, shardings)

    # -- plans and steps ---------------------------------------------------------------------

    def initial_plan(self) -> Plan:
        t = self.cfg.train
        plan = Plan(
            capacities=static_capacities(self.ctx, self.cfg.moe.capacity.factor),
            microbatches=t.microbatches,
            dtype=t.dtype,
        )
        plan.validate(self.ctx)
        return plan

    def step_options(self, plan: Plan) -> StepOptions:
        return StepOptions(
            capacities=plan.capacities,
            cached_routing=plan.cached_routing,
            microbatches=plan.microbatches,
            dtype=plan.dtype,
            aux_loss_weight=self.cfg.moe.aux_loss_weight,
            z_loss_weight=self.cfg.moe.z_loss_weight,
            return_assignments=self.ctx.num_moe_layers > 0 and self.cfg.moe.caching.enabled,
        )

    def lower_train_step(self, plan: Plan) -> jax.stages.Lowered:
        """Trace and lower the train step of ``plan`` from abstract values (no buffers touched)."""
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
        return batch

    @property
    def cached_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(None, TOKEN_AXES))

    def device_batch(self, batch: Batch, cached: np.ndarray | None = None) -> dict[str, jax.Array]:
        sharding = batch_sharding(self.mesh)
        out = {
            "inputs": jax.device_put(batch.inputs, sharding),
            "targets": jax.device_put(batch.targets, sharding),
        }
        if cached is not None:
            out["cached"] = jax.device_put(cached, self.cached_sharding)
        return out

    def eval_step(self, plan: Plan):
        """Jitted mean validation loss of one batch under ``plan``'s capacities (cached)."""
        opts = self.step_options(plan)
        if opts not in self._eval_steps:
            self._eval_steps[opts] = jax.jit(
                make_eval_step(self.graphdef, opts, expert_parallel(self.mesh))
            )
        return self._eval_steps[opts]

    def evaluate(self, params, plan: Plan) -> float | None:
        if not self.val_batches:
            return None
        fn = self.eval_step(plan)
        losses = [fn(params, self.device_batch(b)) for b in self.val_batches]
        return float(np.mean(jax.device_get(losses)))
