"""MoE as a dynamism plugin: per-expert capacities, sample-assignment caching, routing variants.

Seed 001 §4.1 (dynamic per-expert capacities) and §4.2 (sample-assignment caching); seed 000
§2.1 (MoE's load: a layer's cost follows the tokens its experts are given). The MoE block
itself is `dynjax.model.moe`; its Plan part (`dynjax.dynamism.moe.part`) holds the capacities
and cached routing, its policies are `capacity`, `caching` and `granularity` beside it; its
config section and checks are `section`, the arrays its layers read at runtime `inputs`.

Routing variants (issue 12 §2): ``moe.routing="expert_choice"`` (Zhou et al. 2022) and
auxiliary-loss-free balancing (``moe.bias_balancing``, DeepSeek-V3 §2.1.2). The balancing bias
is a non-trainable variable of each MoE block (`dynjax.model.moe.RoutedBias`), not Plan or
host state: the Plan is static (a bias that moves every step would recompile every step), and
host state would need the step's loads on the host before the next step (a sync per step) and
checkpoint, restore and pipeline-migration code of its own. As a variable of its layer it is
train state: it moves with the layer between pipeline stages and is checkpointed, restored and
resharded by path. `MoEPlugin.wrap_optimizer` keeps it out of the optimizer (no moments, no
weight decay, no update) and the state rule `dynjax.model.moe.balance_rule`, which the MoE
layers' `BiasBalancing` options name (`MoEPlugin.layer_options`), moves it after each update from
the step's routed loads, on device, in the single program and each pipeline stage alike.

MPipeMoE (seed 002 §III, issue 12 §3): ``moe.chunks`` partitions each MoE layer's dispatch
groups (`dynjax.model.moe.Chunking`) and ``moe.memory_reuse`` picks Table II's strategy
(``"auto"``: eq. 10 on speeds measured when the run starts, `choose_reuse`). Both are the
plugin's Plan part (``chunks`` per MoE layer, ``memory_reuse``), handed to the MoE blocks as
layer options; ``moe.granularity`` runs Alg. 1 (`AdaptiveGranularity`), which changes n by
RECOMPILE, timed by the step seconds this plugin measures between steps.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax

from dynjax.checkpoint.settings import CheckpointSettings
from dynjax.dynamism.base import Plugin
from dynjax.dynamism.moe import section
from dynjax.dynamism.moe.caching import STABILITY, CachingPolicy
from dynjax.dynamism.moe.capacity import DynamicCapacity
from dynjax.dynamism.moe.checkpoint import PLT, ExpertRows
from dynjax.dynamism.moe.granularity import (
    STEP_CHUNKS,
    STEP_ROWS,
    STEP_SECONDS,
    AdaptiveGranularity,
    choose_reuse,
    chunks_of,
    reuse_costs,
)
from dynjax.dynamism.moe.inputs import MoEInputs
from dynjax.dynamism.moe.part import (
    NAME,
    MoEContext,
    base_capacity,
    cached_routing_of,
    capacities_of,
    moe_context,
    plan_problems,
    static_capacities,
)
from dynjax.dynamism.moe.section import local_groups
from dynjax.dynamism.moe.settings import MoESettings
from dynjax.model.facts import ModelFacts
from dynjax.model.moe import (
    BIAS,
    BIAS_HOOKS,
    MOE_HOOKS,
    TOKENS_PER_EXPERT,
    BiasBalancing,
    Chunking,
    MoELayer,
    SlotLayout,
)
from dynjax.parallel.step_inputs import InputSignature
from dynjax.recompile import Plan, Policy

EXPERT_TOKENS = "moe/expert_tokens"  # [MoE layers, E] per step: tokens each expert computed


class MoEPlugin(Plugin):
    """The `moe` section: model shape (experts, top-k, which layers), loss weights, capacities
    and caching. On when `moe.every > 0`."""

    name = NAME
    switch = "every"
    # The MoE blocks' metrics, losses and records (`MoELayer`), and auxiliary-loss-free
    # balancing's state rule.
    hook_sets = (MOE_HOOKS, BIAS_HOOKS)
    fixed_on_resume = (
        "moe.every",
        "moe.num_experts",
        "moe.top_k",
        "moe.expert_mlp_dim",
        "moe.bias_balancing.enabled",  # adds or removes each block's `RoutedBias`
        "moe.shared_expert_dim",  # adds or removes each block's shared expert
        "moe.shared_expert_gate",  # and its gate
    )
    logged_metrics = ("moe/unrouted",)  # [MoE layers] tokens no expert computed in the step
    logged_scalars = (PLT,)  # partial expert checkpoints' proportion of lost tokens
    Settings = MoESettings
    settings: MoESettings

    # The section's own function, not a wrapper: the config reference reads its keys' comments
    # from this attribute's source (`dynjax.config_reference`).
    config = staticmethod(section.config)

    @classmethod
    def enabled(cls, settings: MoESettings) -> bool:
        return settings.every > 0

    @classmethod
    def validate(cls, moe: MoESettings, facts: ModelFacts) -> None:
        section.validate(moe, facts)

    def claims(self) -> dict[str, tuple[int, ...]]:
        """The MoE layers' token sets: capacities are sized for every token of a group."""
        return {"token_set": self.facts.model.moe_layers}

    @classmethod
    def speed_probe(cls, moe: MoESettings, facts: ModelFacts) -> tuple[int, int, int] | None:
        """With ``moe.memory_reuse="auto"``: eq. 10's (rows of one partition, d_model, hidden)
        at the static capacities, for the edge to time on this machine."""
        if moe.memory_reuse != "auto" or not cls.enabled(moe):
            return None
        model = facts.model
        hidden = model.expert_mlp_dim or model.mlp_dim
        return _static_rows(moe, facts) // moe.chunks, model.d_model, hidden

    @classmethod
    def report_plots(cls) -> Sequence[tuple[str, str, Callable, Callable, str]]:
        """Each expert's load against its capacity (`dynjax.dynamism.moe.report`)."""
        from dynjax.dynamism.moe import report  # the report's, never a run's import

        return report.PLOTS

    def checkpoint_rows(self, checkpoint: CheckpointSettings, history: int) -> ExpertRows:
        """Each MoE layer's stacked expert leaves, a row per expert, and the ledger choosing
        which experts a save holds (partial expert checkpoints, seed 004 §3)."""
        facts = self.facts
        return ExpertRows.of(
            facts.model.moe_layers, facts.model.num_experts, facts.expert_shards, checkpoint,
            history,
        )

    @functools.cached_property
    def moe(self) -> MoEContext:
        """The model facts the part is sized and checked against."""
        return moe_context(self.facts)

    def plan_problems(self, plan: Plan) -> list[str]:
        return plan_problems(plan, self.moe)

    @functools.cached_property
    def inputs(self) -> MoEInputs:
        """The step and batch inputs of the MoE layers and the routing cache."""
        return MoEInputs(self.settings, self.facts, self.moe)

    def step_inputs(self, plan: Plan) -> dict[str, dict[int, np.ndarray]]:
        return self.inputs.step_inputs(plan)

    def input_fills(self) -> dict[str, float]:
        return self.inputs.input_fills()

    def compiled_part(self, plan: Plan) -> dict[str, Any] | None:
        return self.inputs.compiled_part(plan)

    def batch_input_signatures(self, plan: Plan) -> tuple[InputSignature, ...]:
        return self.inputs.batch_input_signatures(plan)

    def batch_inputs(
        self, step: int, sample_ids: np.ndarray, plan: Plan
    ) -> dict[str, dict[int, np.ndarray]]:
        return self.inputs.batch_inputs(step, sample_ids, plan)

    def observe(
        self, step: int, metrics: dict[str, Any], sample_ids: np.ndarray, plan: Plan
    ) -> None:
        self.inputs.observe(step, metrics, sample_ids, plan)

    def record_fields(self, metrics: Mapping[str, Any], plan: Plan) -> dict[str, Any]:
        """Each layer's routed pairs per expert and the Plan's mean capacity factor; the
        routing stability and whether routing was cached where measured."""
        out: dict[str, Any] = {}
        if TOKENS_PER_EXPERT in metrics:
            out["tokens_per_expert"] = metrics[TOKENS_PER_EXPERT].tolist()
            out["capacity_factor"] = float(
                np.mean(capacities_of(plan)) / base_capacity(self.moe)
            )
        if STABILITY in metrics and np.isfinite(metrics[STABILITY]):
            out["routing_stability"] = float(metrics[STABILITY])
            out["cached_routing"] = cached_routing_of(plan)
        return out

    def initial_plan(self, plan: Plan) -> Plan:
        moe = self.settings
        caps = static_capacities(self.moe, _static_factor(moe, self.moe))
        reuse = moe.memory_reuse
        if reuse == "auto":  # eq. 10 on this machine's speeds, reported at the first step
            rows, d, hidden = self.speed_probe(moe, self.facts)
            speeds = self.link.speeds
            reuse = choose_reuse(speeds, rows, d, hidden)
            self._reuse_event = {
                "event": "moe_memory_reuse",
                "strategy": reuse,
                "rows_per_chunk": rows,
                "speeds": dataclasses.asdict(speeds),
                "predicted_seconds": reuse_costs(speeds, rows, d, hidden),
            }
        return plan.with_part(
            NAME,
            capacities=caps,
            cached_routing=False,
            chunks=(moe.chunks,) * self.moe.num_moe_layers,
            memory_reuse=reuse,
        )

    @classmethod
    def resumed_plan(cls, saved: Plan, implied: Plan, changed: Collection[str]) -> Plan:
        """Capacities follow `moe.capacity.*` (back to the static factor when it changed),
        cached routing follows `moe.caching.*` (off until the policy decides again), the
        partitions and memory reuse `moe.chunks`, `moe.memory_reuse` and `moe.granularity.*`."""
        saved_part, implied_part = saved.part(NAME), implied.part(NAME)
        if not implied_part:  # a dense model (`moe.every` is fixed on resume)
            return saved
        follows = {
            "capacities": ("moe.capacity.",),
            "cached_routing": ("moe.caching.",),
            # Plans saved before MPipeMoE have no partitions: take the config's
            "chunks": ("moe.chunks", "moe.memory_reuse", "moe.granularity."),
            "memory_reuse": ("moe.chunks", "moe.memory_reuse", "moe.granularity."),
        }
        part = {
            key: implied_part[key]
            if key not in saved_part or any(k.startswith(prefixes) for k in changed)
            else saved_part[key]
            for key, prefixes in follows.items()
        }
        return saved.with_part(NAME, **part)

    def layer_options(self, plan: Plan) -> Sequence[Any] | None:
        """Each MoE layer's `MoELayer` (None for the others): its capacities on the static
        path, its bucketed total on the ragged one (the capacities then a step input), its
        `Chunking` (None for the plain layer, one partition and no memory reuse, so its program
        is exactly the layer without them), whether it reports assignments for the routing
        cache, and the loss weights; with bias balancing its `BiasBalancing` record (under
        `BIAS`), which runs the routed-bias state rule `dynjax.model.moe.balance_rule` after
        each step."""
        model, moe = self.facts.model, self.settings
        chunks = chunks_of(plan) or (1,) * len(model.moe_layers)
        reuse = plan.part(NAME).get("memory_reuse", "none")
        chunking = not (set(chunks) <= {1} and reuse == "none")
        balancing = model.routed_bias
        totals = self.inputs.ragged_totals(plan)
        caps = capacities_of(plan)
        records: list[dict[str, Any] | None] = [None] * model.num_layers
        for j, (layer, n) in enumerate(zip(model.moe_layers, chunks, strict=True)):
            block = MoELayer(
                capacities=() if totals else tuple(caps[j]),
                ragged_total=totals[j] if totals else 0,
                chunking=Chunking(n, reuse) if chunking else None,
                assignments=moe.caching.enabled,
                aux_loss_weight=moe.aux_loss_weight,
                z_loss_weight=moe.z_loss_weight,
            )
            records[layer] = {
                NAME: block,
                BIAS: BiasBalancing(moe.bias_balancing.rate) if balancing else None,
            }
        return records

    def measure(
        self, step: int, states: Sequence[dict[str, Any]], plan: Plan
    ) -> dict[str, Any]:
        """With ``moe.granularity``: the wall seconds, partitions and dispatch rows of the step
        before this one (`STEP_SECONDS`, `STEP_CHUNKS`, `STEP_ROWS`), what Alg. 1 times. The
        loop dispatches asynchronously but waits for step t - Δ's metrics, so in steady state
        an iteration lasts one device step. The seconds are NaN when the Plan changed after
        that step (the swap's stall is in them)."""
        if not self.settings.granularity.enabled:
            return {}
        now, last = time.perf_counter(), self._last_step
        self._last_step = (step, now, plan)
        if last is None or last[0] != step - 1:
            return {}
        seconds = now - last[1] if last[2] == plan else float("nan")
        return {
            STEP_SECONDS: np.float64(seconds),
            STEP_CHUNKS: np.int64(max(chunks_of(last[2]), default=1)),
            STEP_ROWS: np.int64(dispatch_rows(last[2], self.facts)),
        }

    def before_step(
        self, step: int, states: Sequence[dict[str, Any]], plan: Plan
    ) -> list[dict[str, Any]]:
        """The strategy ``moe.memory_reuse="auto"`` chose, with the speeds and eq. 10 costs it
        chose by, as an event of the first step."""
        event, self._reuse_event = self._reuse_event, None
        return [] if event is None else [{**event, "step": step}]

    _last_step: tuple | None = None  # (step, perf_counter, plan) of this run's last `measure`
    _reuse_event: dict[str, Any] | None = None  # `initial_plan`'s auto choice, not yet emitted

    def policies(self) -> list[Policy]:
        moe, out = self.settings, []
        if moe.capacity.policy == "dynamic":
            out.append(DynamicCapacity.from_settings(self.moe, moe.capacity))
        if moe.granularity.enabled:
            g = moe.granularity
            out.append(
                AdaptiveGranularity(
                    chunk_candidates(moe, self.facts),
                    trials=g.trials,
                    warmup=g.warmup,
                    d_model=self.facts.model.d_model,
                    hidden=self.facts.model.expert_mlp_dim or self.facts.model.mlp_dim,
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
        self, optimizer: optax.GradientTransformation
    ) -> optax.GradientTransformation:
        """With bias balancing, the `RoutedBias` leaves bypass ``optimizer`` (no moments, no
        weight decay, a zero update): only the step's balancing rule moves them."""
        if not self.settings.bias_balancing.enabled:
            return optimizer
        return optax.multi_transform({"trained": optimizer, BIAS: optax.set_to_zero()}, _labels)

    def layer_costs(self, plan: Plan) -> Sequence[float] | None:
        """Static path: an MoE layer costs what its busiest expert-parallel rank computes (seed
        000 §2.1: the layer's time is its slowest rank's, the others wait in the all-to-all),
        over a rank's share at capacity factor 1. Every rank runs the same program, local slot
        j sized for the largest capacity among the experts in slot j (`SlotLayout`), so the
        busiest rank computes ``shard_slots`` rows per group; with one rank that is the mean
        capacity. The ragged path computes the tokens it is given: `metric_costs`."""
        if not capacities_of(plan) or self.inputs.ragged:
            return None
        shards = self.facts.expert_shards
        share = self.moe.num_experts // shards * base_capacity(self.moe)
        costs = [1.0] * self.facts.num_layers
        for layer, caps in zip(self.facts.model.moe_layers, capacities_of(plan), strict=True):
            costs[layer] = SlotLayout(tuple(caps), shards).shard_slots / share
        return costs

    def metric_costs(self, metrics: Mapping[str, Any]) -> Sequence[float] | None:
        """Ragged path: the tokens the busiest expert-parallel rank's experts computed in the
        step (``moe/expert_tokens``, kept pairs), over a rank's share of the step's
        batch * seq * top_k pairs (seed 000 §2.1)."""
        if not self.inputs.ragged or EXPERT_TOKENS not in metrics:
            return None
        tokens = np.asarray(metrics[EXPERT_TOKENS], np.float64)  # [MoE layers, E]
        shards = self.facts.expert_shards
        busiest = tokens.reshape(len(tokens), shards, -1).sum(-1).max(-1)
        moe = self.moe
        share = self.facts.batch_size * moe.group_tokens * moe.top_k / shards
        costs = [1.0] * self.facts.num_layers
        for layer, busy in zip(self.facts.model.moe_layers, busiest, strict=True):
            costs[layer] = float(busy / share)
        return costs


def chunk_candidates(moe: MoESettings, facts: ModelFacts) -> tuple[int, ...]:
    """Alg. 1's candidates: the powers of two up to ``moe.granularity.max_chunks`` that divide
    the groups per shard, and ``moe.chunks``."""
    groups = local_groups(facts)
    powers = [2**i for i in range(moe.granularity.max_chunks.bit_length())]
    ok = [n for n in powers if n <= moe.granularity.max_chunks and groups % n == 0]
    return tuple(sorted({*ok, moe.chunks}))


def _static_factor(moe: MoESettings, ctx: MoEContext) -> float:
    """``moe.capacity.factor``; dropless (<= 0): an expert can take every token of a group."""
    factor = moe.capacity.factor
    return ctx.num_experts / ctx.top_k if factor <= 0 else factor


def _static_rows(moe: MoESettings, facts: ModelFacts) -> int:
    """`dispatch_rows` of a fresh run's Plan (the static capacities)."""
    ctx = moe_context(facts)
    caps = static_capacities(ctx, _static_factor(moe, ctx))
    plan = Plan(microbatches=facts.microbatches).with_part(NAME, capacities=caps)
    return dispatch_rows(plan, facts)


def dispatch_rows(plan: Plan, facts: ModelFacts) -> int:
    """Alg. 1's B: rows one expert-parallel shard dispatches per MoE layer in a microbatch
    (static path: its groups times the layer's slot buffer; mean over the MoE layers). The
    ragged path's buffers are bucketed totals of the same capacities, so B moves with them too."""
    groups = facts.batch_size // (plan.microbatches * facts.batch_shards)
    caps = capacities_of(plan)
    if not caps:
        return 0
    totals = [SlotLayout(tuple(c), facts.expert_shards).total for c in caps]
    return int(round(groups * float(np.mean(totals))))


def _labels(params):
    """`BIAS` for each `RoutedBias` leaf, "trained" for the others."""

    def label(path, _) -> str:
        return BIAS if getattr(path[-1], "key", None) == BIAS else "trained"

    return jax.tree_util.tree_map_with_path(label, params)
