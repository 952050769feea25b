"""MoE as a dynamism plugin: per-expert capacities, sample-assignment caching, routing variants.

Seed 001 §4.1 (dynamic per-expert capacities) and §4.2 (sample-assignment caching); seed 000
§2.1 (MoE's load: a layer's cost follows the tokens its experts are given). The MoE block
itself is `dynjax.model.moe`; its Plan part is the Plan's `capacities` and `cached_routing`
fields (they predate the plugin interface and saved Plans name them).

Routing variants (issue 12 §2): ``moe.routing="expert_choice"`` (Zhou et al. 2022) and
auxiliary-loss-free balancing (``moe.bias_balancing``, DeepSeek-V3 §2.1.2). The balancing bias
is a non-trainable variable of each MoE block (`dynjax.model.moe.RoutedBias`), not Plan or
host state: the Plan is static (a bias that moves every step would recompile every step), and
host state would need the step's loads on the host before the next step (a sync per step) and
checkpoint, restore and pipeline-migration code of its own. As a variable of its layer it is
train state: it moves with the layer between pipeline stages and is checkpointed, restored and
resharded by path. `MoEPlugin.wrap_optimizer` keeps it out of the optimizer (no moments, no
weight decay, no update) and the train step (single program and pipeline stages alike) moves it
after each update from the step's routed loads (`dynjax.model.moe.balance_bias`), on device.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import ml_collections
import numpy as np
import optax

from dynjax.config import ConfigError, at_least, moe_layer_indices, num_stages
from dynjax.dynamism.base import Plugin, register
from dynjax.model.moe import BIAS, ROUTINGS, SlotLayout
from dynjax.recompile import (
    CachingPolicy,
    DynamicCapacity,
    Plan,
    PlanContext,
    Policy,
    base_capacity,
    static_capacities,
)

if TYPE_CHECKING:
    from dynjax.experiment import Experiment


EXPERT_TOKENS = "moe/expert_tokens"  # [MoE layers, E] per step: tokens each expert computed


class MoEPlugin(Plugin):
    """The `moe` section: model shape (experts, top-k, which layers), loss weights, capacities
    and caching. On when `moe.every > 0`."""

    name = "moe"
    fixed_on_resume = (
        "moe.every",
        "moe.num_experts",
        "moe.top_k",
        "moe.expert_mlp_dim",
        "moe.bias_balancing.enabled",  # adds or removes each block's `RoutedBias`
    )
    logged_metrics = ("moe/unrouted",)  # [MoE layers] tokens no expert computed in the step

    def config(self) -> ml_collections.ConfigDict:
        c = ml_collections.ConfigDict()
        c.num_experts = 8
        c.top_k = 2
        c.every = 0  # an MoE block in every n-th layer (layers n-1, 2n-1, ...); 0 = dense model
        c.expert_mlp_dim = 0  # 0: same as model.mlp_dim
        c.aux_loss_weight = 0.01
        c.z_loss_weight = 0.0
        # "static": a matmul pair per expert, capacities compiled in (a change recompiles);
        # "ragged": ragged_dot over the kept pairs sorted by expert, capacities a runtime input
        # (only a new bucketed total recompiles; issue 12 §1)
        c.dispatch = "static"
        # "token_choice": each token its top-k experts; "expert_choice": each expert its top-C
        # tokens of a group, C its capacity (Zhou et al. 2022; no drops, no balance loss)
        c.routing = "token_choice"
        # Auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2): a per-expert bias on the router's
        # probabilities for the top-k selection only, moved after each step by
        # rate * sign(mean load - load); not trained, checkpointed with the model
        c.bias_balancing = ml_collections.ConfigDict()
        c.bias_balancing.enabled = False
        c.bias_balancing.rate = 1e-3
        c.capacity = ml_collections.ConfigDict()
        # the static global factor, and the start of a dynamic run; <= 0: dropless (needs
        # moe.dispatch="ragged": every capacity is the group's tokens, the buffer the worst case)
        c.capacity.factor = 1.25
        c.capacity.policy = "static"  # "static" | "dynamic" (per-expert, seed 001 §4.1)
        c.capacity.target_drop_rate = 0.01
        c.capacity.min_factor = 0.5
        c.capacity.max_factor = 2.0
        c.capacity.window = 20  # steps of observed loads per decision
        c.capacity.headroom = 1.1
        c.capacity.bucket = 0.25  # capacity factors are rounded up to multiples of this
        c.capacity.hysteresis = 0.2  # shrink only when it saves at least this fraction
        c.caching = ml_collections.ConfigDict()  # sample-assignment caching (seed 001 §4.2)
        c.caching.enabled = False
        c.caching.on_threshold = 0.96
        c.caching.off_threshold = 0.90
        c.caching.warmup_steps = 100
        c.caching.window = 10
        c.caching.max_entries = 65536  # samples whose assignments are kept on the host
        return c

    def enabled(self, cfg: ml_collections.ConfigDict) -> bool:
        return cfg.moe.every > 0

    def validate(self, cfg: ml_collections.ConfigDict) -> None:
        m, moe, mesh = cfg.model, cfg.moe, cfg.mesh
        if moe.every < 0:
            raise ConfigError(f"moe.every={moe.every} must be >= 0 (0 = no MoE layers)")
        if moe.every:
            if not moe_layer_indices(cfg):
                raise ConfigError(
                    f"moe.every={moe.every} > model.num_layers={m.num_layers}: no layer would "
                    "be MoE"
                )
            if not 1 <= moe.top_k <= moe.num_experts:
                raise ConfigError(
                    f"moe.top_k={moe.top_k} must be in [1, moe.num_experts={moe.num_experts}]"
                )
            if moe.num_experts % mesh.expert:
                raise ConfigError(
                    f"moe.num_experts={moe.num_experts} must be divisible by "
                    f"mesh.expert={mesh.expert}"
                )
            if moe.dispatch not in ("static", "ragged"):
                raise ConfigError(
                    f"moe.dispatch={moe.dispatch!r} is not one of ('static', 'ragged')"
                )
            if moe.capacity.factor <= 0 and moe.dispatch != "ragged":
                raise ConfigError(
                    f"moe.capacity.factor={moe.capacity.factor} (dropless) needs "
                    "moe.dispatch='ragged': set it, or a factor > 0"
                )
            if moe.capacity.factor <= 0 and moe.capacity.policy == "dynamic":
                raise ConfigError(
                    f"moe.capacity.factor={moe.capacity.factor} (dropless) leaves nothing for "
                    "moe.capacity.policy='dynamic' to size: set a factor > 0 or policy='static'"
                )
            if moe.dispatch == "ragged" and num_stages(cfg):
                raise ConfigError(
                    "moe.dispatch='ragged' does not run on the pipeline runtime yet "
                    f"(pipeline.stage_layers={cfg.pipeline.stage_layers!r}): set "
                    "moe.dispatch='static' or pipeline.stage_layers=''"
                )
            _check_routing(cfg)
            if moe.capacity.policy not in ("static", "dynamic"):
                raise ConfigError(
                    f"moe.capacity.policy={moe.capacity.policy!r} is not one of "
                    "('static', 'dynamic')"
                )
            _check_moe(cfg)
        elif mesh.expert != 1:
            raise ConfigError(
                f"mesh.expert={mesh.expert} needs MoE layers: set moe.every > 0 or mesh.expert=1"
            )
        else:
            moe_policies = {
                "moe.capacity.policy='dynamic'": moe.capacity.policy == "dynamic",
                "moe.caching.enabled=True": moe.caching.enabled,
                "moe.bias_balancing.enabled=True": moe.bias_balancing.enabled,
            }
            asked = [key for key, on in moe_policies.items() if on]
            if asked:  # it would be ignored: the run would not be what the config says
                raise ConfigError(
                    f"{', '.join(asked)} needs MoE layers: set moe.every > 0, or turn it off"
                )

    def initial_plan(self, plan: Plan, cfg: ml_collections.ConfigDict, ctx: PlanContext) -> Plan:
        factor = cfg.moe.capacity.factor
        if factor <= 0:  # dropless: an expert can take every token of a group
            factor = ctx.num_experts / ctx.top_k
        return plan.replace(capacities=static_capacities(ctx, factor))

    def resumed_plan(self, saved: Plan, implied: Plan, changed: Collection[str]) -> Plan:
        """Capacities follow `moe.capacity.*` (back to the static factor when it changed),
        cached routing follows `moe.caching.*` (off until the policy decides again)."""
        fields = {"capacities": "moe.capacity.", "cached_routing": "moe.caching."}
        return saved.replace(
            **{
                field: getattr(implied, field)
                for field, prefix in fields.items()
                if any(key.startswith(prefix) for key in changed)
            }
        )

    def policies(self, cfg: ml_collections.ConfigDict, exp: Experiment) -> list[Policy]:
        moe, out = cfg.moe, []
        if not self.enabled(cfg):
            return out
        if moe.capacity.policy == "dynamic":
            c = moe.capacity
            out.append(
                DynamicCapacity(
                    exp.ctx,
                    target_drop_rate=c.target_drop_rate,
                    min_factor=c.min_factor,
                    max_factor=c.max_factor,
                    window=c.window,
                    headroom=c.headroom,
                    bucket=c.bucket,
                    hysteresis=c.hysteresis,
                )
            )
        if moe.caching.enabled:
            c = moe.caching
            out.append(
                CachingPolicy(
                    on_threshold=c.on_threshold,
                    off_threshold=c.off_threshold,
                    warmup_steps=c.warmup_steps,
                    window=c.window,
                )
            )
        return out

    def wrap_optimizer(
        self, cfg: ml_collections.ConfigDict, optimizer: optax.GradientTransformation
    ) -> optax.GradientTransformation:
        """With bias balancing, the `RoutedBias` leaves bypass ``optimizer`` (no moments, no
        weight decay, a zero update): only the step's balancing rule moves them."""
        if not cfg.moe.bias_balancing.enabled:
            return optimizer
        return optax.multi_transform({"trained": optimizer, BIAS: optax.set_to_zero()}, _labels)

    def layer_costs(self, plan: Plan, exp: Experiment) -> Sequence[float] | None:
        """Static path: an MoE layer costs what its busiest expert-parallel rank computes (seed
        000 §2.1: the layer's time is its slowest rank's, the others wait in the all-to-all),
        over a rank's share at capacity factor 1. Every rank runs the same program, local slot
        j sized for the largest capacity among the experts in slot j (`SlotLayout`), so the
        busiest rank computes ``shard_slots`` rows per group; with one rank that is the mean
        capacity. The ragged path computes the tokens it is given: `metric_costs`."""
        if not plan.capacities or exp.ragged:
            return None
        shards = exp.cfg.mesh.expert
        share = exp.ctx.num_experts // shards * base_capacity(exp.ctx)
        costs = [1.0] * exp.ctx.num_layers
        for layer, caps in zip(exp.model_cfg.moe_layers, plan.capacities, strict=True):
            costs[layer] = SlotLayout(tuple(caps), shards).shard_slots / share
        return costs

    def metric_costs(
        self, metrics: Mapping[str, Any], exp: Experiment
    ) -> Sequence[float] | None:
        """Ragged path: the tokens the busiest expert-parallel rank's experts computed in the
        step (``moe/expert_tokens``, kept pairs), over a rank's share of the step's
        batch * seq * top_k pairs (seed 000 §2.1)."""
        if not exp.ragged or EXPERT_TOKENS not in metrics:
            return None
        tokens = np.asarray(metrics[EXPERT_TOKENS], np.float64)  # [MoE layers, E]
        shards = exp.cfg.mesh.expert
        busiest = tokens.reshape(len(tokens), shards, -1).sum(-1).max(-1)
        ctx = exp.ctx
        share = ctx.batch_size * ctx.group_tokens * ctx.top_k / shards
        costs = [1.0] * ctx.num_layers
        for layer, busy in zip(exp.model_cfg.moe_layers, busiest, strict=True):
            costs[layer] = float(busy / share)
        return costs


def _labels(params):
    """`BIAS` for each `RoutedBias` leaf, "trained" for the others."""

    def label(path, _) -> str:
        return BIAS if getattr(path[-1], "key", None) == BIAS else "trained"

    return jax.tree_util.tree_map_with_path(label, params)


def _check_routing(cfg: ml_collections.ConfigDict) -> None:
    """``moe.routing`` and ``moe.bias_balancing``, and what expert choice cannot combine with."""
    moe = cfg.moe
    if moe.routing not in ROUTINGS:
        raise ConfigError(f"moe.routing={moe.routing!r} is not one of {ROUTINGS}")
    if moe.bias_balancing.enabled and moe.bias_balancing.rate <= 0:
        raise ConfigError(
            f"moe.bias_balancing.rate={moe.bias_balancing.rate} must be > 0 (DeepSeek-V3 uses "
            "1e-3), or set moe.bias_balancing.enabled=False"
        )
    if moe.routing != "expert_choice":
        return
    clashes = {
        "moe.bias_balancing.enabled=True": moe.bias_balancing.enabled,
        "moe.capacity.policy='dynamic'": moe.capacity.policy == "dynamic",
        "moe.caching.enabled=True": moe.caching.enabled,
        f"moe.capacity.factor={moe.capacity.factor} (dropless)": moe.capacity.factor <= 0,
    }
    asked = [key for key, on in clashes.items() if on]
    if asked:  # every expert takes exactly its capacity: nothing to balance, size or cache
        raise ConfigError(
            f"moe.routing='expert_choice' balances by construction (each expert takes its "
            f"capacity's tokens) and does not combine with {', '.join(asked)}: turn it off "
            "(a factor > 0), or set moe.routing='token_choice'"
        )


def _check_moe(cfg: ml_collections.ConfigDict) -> None:
    """The MoE block's loss weights and the keys of the policies that are on: everything
    `DynamicCapacity`, `CachingPolicy` and `AssignmentCache` would reject, named by key."""
    moe = cfg.moe
    at_least(
        {
            "moe.expert_mlp_dim": moe.expert_mlp_dim,
            "moe.aux_loss_weight": moe.aux_loss_weight,
            "moe.z_loss_weight": moe.z_loss_weight,
        },
        0,
    )
    if moe.capacity.policy == "dynamic":
        _check_dynamic_capacity(moe.capacity)
    if moe.caching.enabled:
        _check_caching(moe.caching, moe.num_experts)


def _check_dynamic_capacity(c: ml_collections.ConfigDict) -> None:
    if not 0 <= c.target_drop_rate < 1:
        raise ConfigError(
            f"moe.capacity.target_drop_rate={c.target_drop_rate} must be in [0, 1): the "
            "fraction of routed tokens an expert may drop"
        )
    if c.min_factor <= 0:
        raise ConfigError(f"moe.capacity.min_factor={c.min_factor} must be > 0")
    if c.min_factor > c.max_factor:
        raise ConfigError(
            f"moe.capacity.min_factor={c.min_factor} exceeds moe.capacity.max_factor="
            f"{c.max_factor}: lower min_factor or raise max_factor"
        )
    if c.bucket <= 0:
        raise ConfigError(f"moe.capacity.bucket={c.bucket} must be > 0 (factors round up to it)")
    at_least({"moe.capacity.window": c.window}, 1, " (steps of loads per decision)")
    at_least({"moe.capacity.headroom": c.headroom}, 1, " (a multiplier on the need; 1 = none)")
    at_least({"moe.capacity.hysteresis": c.hysteresis}, 0, " (0 = none)")


def _check_caching(c: ml_collections.ConfigDict, num_experts: int) -> None:
    if not 0 <= c.off_threshold <= c.on_threshold <= 1:
        raise ConfigError(
            f"moe.caching needs 0 <= off_threshold <= on_threshold <= 1, got off_threshold="
            f"{c.off_threshold}, on_threshold={c.on_threshold}: caching switches on at a "
            "routing stability >= on_threshold and off below off_threshold"
        )
    at_least({"moe.caching.warmup_steps": c.warmup_steps}, 0)
    at_least({"moe.caching.window": c.window, "moe.caching.max_entries": c.max_entries}, 1)
    if num_experts > 32767:
        raise ConfigError(
            f"moe.caching.enabled stores expert ids as int16: moe.num_experts={num_experts} "
            "must be <= 32767, or set moe.caching.enabled=False"
        )


register(MoEPlugin())
