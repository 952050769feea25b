"""Mixture-of-experts block: softmax top-k router, a capacity per expert, expert-parallel dispatch.

Tokens are dispatched in *groups* of one sequence each (GShard's groups). Expert e has C_e slots
per group; a group's (token, choice) pairs claim slots in priority order — every token's first
choice before any second choice, earlier tokens first — and pairs beyond C_e are dropped: they add
nothing, so the token passes through the block's residual. Because groups are whole sequences,
routing, dropping and outputs do not depend on the batch size or on how the batch is sharded.

On the static path (``moe.dispatch="static"``) capacities are Python ints compiled into the program
(changing them recompiles), and each expert computes on exactly its own slots, so shrinking a cold
expert's capacity removes its FLOPs (DynaMoE, seed 001 §4.1). Under expert parallelism
(``jax.shard_map`` over the mesh axis ``'expert'``, dispatch and combine by ``jax.lax.all_to_all``)
every device runs the same program, so local expert slot j is sized by the largest capacity among
the experts that sit in slot j on the devices; the per-expert drop rule stays exact.

The ragged path (``moe.dispatch="ragged"``, issue 12 §1; MaxText's dropless MoE) keeps the same
pairs with the capacities as a runtime array: the kept pairs are sorted by expert and run through
``jax.lax.ragged_dot`` with runtime group sizes inside a static buffer of ``shard_total`` rows per
group and expert shard, so capacities change without a recompile and the program's size does not
grow with the expert count.

Routing (``moe.routing``, issue 12 §2). ``"token_choice"``: each token picks its top-k experts as
above. ``"expert_choice"`` (Zhou et al. 2022, "Mixture-of-Experts with Expert Choice Routing"
§3.1): each expert takes the C_e tokens of a group with the highest router probability for it,
C_e its capacity, and weights each by that probability; nothing is dropped by construction, a
token may be taken by several experts or by none (``unrouted``), and there is no balance loss
(every expert computes exactly C_e tokens). Auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2,
MaxText's ``routed_bias``) adds a per-expert `RoutedBias` to the probabilities for the top-k
*selection* only; the gates stay the unbiased probabilities. On the ragged path expert choice is
dispatched as one pair per (token, expert) whose pair is kept where the expert took the token, so
its dispatch scatters E rows per token where token choice scatters k.

Auxiliary losses follow Switch Transformer (seed 001 eq. 3: E * sum_e f_e * P_e) and ST-MoE's
router z-loss, computed per group and averaged so they too are independent of the sharding. f_e
is the fraction of the group's S * k (token, choice) pairs dispatched to expert e before dropping,
so it sums to 1 over the experts; HF Mixtral and MaxText let it sum to k, so their balance loss is
k times this one and their weight w is k * w here (docs/schemes/moe.md).

MPipeMoE (seed 002 §III-B..D, issue 12 §3): a `Chunking` record splits the layer's dispatch
groups on each expert-parallel shard into ``chunks`` partitions along the token dimension (Fig.
5b: each partition its own, smaller all-to-all), each running dispatch -> experts -> combine on its
own. The partitions share no operation, so XLA's latency-hiding scheduler (GPU) may overlap
partition i+1's dispatch with partition i's experts; their outputs are the unchunked layer's
exactly, since routing and slots are per group. ``reuse`` (Table II) restores the dispatched input
T_DI and the experts' hidden activation T_M in the backward instead of keeping every partition's
copy: S1 offloads both to pinned host memory, S2 re-communicates T_DI and offloads T_M, S3
offloads T_DI and recomputes T_M, S4 re-communicates T_DI and recomputes T_M (`jax.checkpoint`
with named residuals). With a strategy the partitions run as a `jax.lax.scan`, so one set of
buffers serves them in turn (§III-D's memory reuse; an unrolled loop let XLA's CPU scheduler
keep every partition's buffers live at once, measured in benchmarks/moe_chunks.py); overlap
across the scan's iterations is then up to XLA's loop pipelining. Without one (``"none"``) they
are unrolled, the overlap path.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dynjax.model.hooks import HookSet, LayerOptions, layer_options
from dynjax.model.mlp import MLP, SwiGLU

ROUTINGS = ("token_choice", "expert_choice")
BIAS = "routed_bias"  # the `RoutedBias` attribute of an MoE block: its path ends in moe/routed_bias
# MPipeMoE's memory reuse strategies (seed 002 Table II); "none" keeps every residual.
REUSE = ("none", "S1", "S2", "S3", "S4")
# Checkpoint names of a partition's residuals: T_DI (the dispatched rows after the all-to-all),
# T_M (the experts' hidden pre-activation) and the expert outputs after the combine all-to-all.
DISPATCHED, HIDDEN, RETURNED = "moe_dispatched", "moe_hidden", "moe_returned"
# What each strategy offloads to host memory; what it neither offloads nor keeps is restored in
# the backward: T_DI by dispatching again (re-communication), T_M by recomputing the matmul.
OFFLOADED = {"S1": (DISPATCHED, HIDDEN), "S2": (HIDDEN,), "S3": (DISPATCHED,), "S4": ()}


@dataclasses.dataclass(frozen=True)
class Chunking:
    """An MoE layer's MPipeMoE options (seed 002 §III-B, §III-D): ``chunks`` partitions of its
    local dispatch groups, each its own dispatch all-to-all -> experts -> combine all-to-all,
    and ``reuse``, the memory reuse strategy of Table II (one of `REUSE`)."""

    chunks: int = 1
    reuse: str = "none"

    def __post_init__(self):
        if self.chunks < 1:
            raise ValueError(f"moe.chunks={self.chunks} must be >= 1")
        if self.reuse not in REUSE:
            raise ValueError(f"moe.memory_reuse={self.reuse!r} is not one of {REUSE}")


@functools.cache
def host_offload_supported() -> bool:
    """Whether the default device has a ``pinned_host`` memory space to offload residuals to."""
    return "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}


def reuse_policy(reuse: str) -> Callable:
    """The `jax.checkpoint` policy of strategy ``reuse`` (seed 002 Table II): the combined
    expert outputs stay on device (the gates' gradient reads them; recomputing them would re-run
    the experts), the strategy's offloaded tensors go to pinned host memory, everything else is
    recomputed. Without a pinned host memory space the offloaded tensors stay on device instead
    (a warning says so): the layer is then correct but saves only what S4's recomputation does
    not need to keep."""
    offloaded = list(OFFLOADED[reuse])
    if not offloaded:
        return jax.checkpoint_policies.save_only_these_names(RETURNED)
    if host_offload_supported():
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[RETURNED],
            names_which_can_be_offloaded=offloaded,
            offload_src="device",
            offload_dst="pinned_host",
        )
    warnings.warn(
        f"moe.memory_reuse={reuse!r}: the {jax.default_backend()} backend has no pinned_host "
        f"memory, so {offloaded} stay in device memory instead of being offloaded",
        stacklevel=2,
    )
    return jax.checkpoint_policies.save_only_these_names(RETURNED, *offloaded)


def chunked(fn: Callable, chunking: Chunking | None, tokens: int) -> Callable:
    """``fn(*token_args, w_in, w_out)`` (the first ``tokens`` arguments [g, ...] per dispatch
    group) run on ``chunking.chunks`` partitions of the g groups, each under the strategy's
    `jax.checkpoint` policy, outputs concatenated (seed 002 §III-B, Fig. 5b). Without memory
    reuse an unrolled loop of independent partitions: nothing orders partition i's experts
    before partition i+1's dispatch, so the latency-hiding scheduler may overlap them. With it
    a `jax.lax.scan`: the partitions take turns in one set of buffers (§III-D, Fig. 6)."""
    if chunking is None:
        return fn
    reuse = chunking.reuse
    part = fn if reuse == "none" else jax.checkpoint(fn, policy=reuse_policy(reuse))
    n = chunking.chunks
    if n == 1:
        return part

    def run(*args):
        g = args[0].shape[0]
        if g % n:
            raise ValueError(
                f"moe.chunks={n} does not divide the {g} dispatch groups (sequences) per "
                "expert-parallel shard: choose a divisor of train.batch_size / (mesh.data * "
                "mesh.expert * microbatches)"
            )
        size, rest = g // n, args[tokens:]
        if reuse == "none":
            parts = [[a[i * size : (i + 1) * size] for a in args[:tokens]] for i in range(n)]
            return jnp.concatenate([part(*p, *rest) for p in parts], axis=0)
        split = [a.reshape(n, size, *a.shape[1:]) for a in args[:tokens]]
        _, outs = jax.lax.scan(lambda carry, xs: (carry, part(*xs, *rest)), None, split)
        return outs.reshape(g, *outs.shape[2:])

    return run


class RoutedBias(nnx.Variable):
    """Per-expert selection bias [E] (DeepSeek-V3 §2.1.2): model state but not a parameter. No
    gradient reaches it (it only moves the top-k indices), the optimizer leaves it out
    (`dynjax.dynamism.moe`), and both train steps move it after each update by the state rule
    `balance_rule` on the layers whose options hold a `BiasBalancing` record. Being a variable
    of the layer, it moves with the layer between pipeline stages and is checkpointed, restored
    and resharded by path like the weights."""


@dataclasses.dataclass(frozen=True)
class BiasBalancing:
    """An MoE layer's layer option (under `BIAS`) for auxiliary-loss-free balancing: the step
    ``rate`` of its `RoutedBias` (``moe.bias_balancing.rate``)."""

    rate: float


def balance_bias(bias: jax.Array, loads: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3 §2.1.2's update: ``bias + rate * sign(mean(loads) - loads)``; ``loads`` [E]
    the (token, choice) pairs the step routed to each expert (before dropping)."""
    loads = loads.astype(jnp.float32)
    return bias + rate * jnp.sign(jnp.mean(loads) - loads)


def balance_rule(
    state: dict[str, jax.Array], metrics: Mapping[str, jax.Array], record: BiasBalancing
) -> dict[str, jax.Array]:
    """The state rule (`HookSet.state_rule`) that moves an MoE layer's `RoutedBias` by
    `balance_bias` from the step's routed loads: its ``moe/group_loads`` [B, E] summed over
    the batch's groups."""
    path = f"moe/{BIAS}"
    loads = jnp.sum(metrics[GROUP_LOADS], axis=0)
    return {path: balance_bias(state[path], loads, record.rate)}


BIAS_HOOKS = HookSet(BIAS, state_rule=balance_rule, rule_state=(BIAS,))

MOE = "moe"  # the MoE blocks' record (`MoELayer`) and the prefix of their metrics
GROUP_LOADS = "moe/group_loads"  # [L, B, E] (token, choice) pairs per group, before dropping
ASSIGNMENTS = "moe/assignments"  # [L, B, S, k] the router's top-k per token (caching)
TOKENS_PER_EXPERT = "moe/tokens_per_expert"  # [L, E] routed pairs per expert in the step


@dataclasses.dataclass(frozen=True)
class MoELayer:
    """An MoE block's layer option (under `MOE`, from the MoE plugin's records): its static
    choices under one Plan. ``capacities``: the static path's per-expert capacities, compiled
    in; ``ragged_total`` (> 0): the ragged path's static buffer (`RaggedCapacities`), whose
    per-expert capacities the block reads from its step input ``capacities``; ``chunking``:
    MPipeMoE's partitions and memory reuse (None: one partition, no reuse); ``assignments``:
    report the router's top-k per token (`ASSIGNMENTS`, for a routing cache); the weights of
    the auxiliary balance and z losses in the training loss. A block given the batch input
    ``routes`` ([B, S, k], -1 where nothing is cached) dispatches by it."""

    capacities: tuple[int, ...] = ()
    ragged_total: int = 0
    chunking: Chunking | None = None
    assignments: bool = False
    aux_loss_weight: float = 0.0
    z_loss_weight: float = 0.0

    def block_capacities(self, inputs: Mapping[str, jax.Array]) -> Any:
        """What `MoE.__call__` takes as ``capacities`` given the layer's step ``inputs``."""
        if self.ragged_total:
            return RaggedCapacities(inputs["capacities"], self.ragged_total)
        return self.capacities


def static_options(
    num_layers: int,
    moe_layers: Sequence[int],
    capacities: Sequence[Sequence[int]],
    *,
    base: Sequence[LayerOptions] = (),
    **record: Any,
) -> tuple[LayerOptions, ...]:
    """Each layer's options with an `MoELayer` of the static path on each MoE layer
    (``capacities``: one tuple per MoE layer, in order; ``record``: its other fields), added to
    ``base`` (each layer's other records; empty: none): a model run by hand, as the MoE plugin's
    records would run it."""
    if len(capacities) != len(moe_layers):
        raise ValueError(f"{len(capacities)} capacity tuples for {len(moe_layers)} MoE layers")
    caps = dict(zip(moe_layers, capacities, strict=True))
    base = tuple(base) or ((),) * num_layers
    return tuple(
        layer_options(
            {**dict(base[i]), MOE: MoELayer(capacities=tuple(caps[i]), **record)}
            if i in caps
            else dict(base[i])
        )
        for i in range(num_layers)
    )


def layer_metrics(stats: MoEStats, record: MoELayer) -> dict[str, jax.Array]:
    """One MoE block's hook metrics (`MOE_HOOKS` declares their reductions)."""
    metrics = {
        GROUP_LOADS: stats.group_loads,
        "moe/dropped": jnp.sum(stats.dropped),  # pairs dropped for lack of capacity
        "moe/unrouted": jnp.sum(stats.unrouted),  # tokens no expert computes
        "moe/expert_tokens": jnp.sum(stats.expert_tokens, 0),  # [E] tokens each computes
        "moe/aux_loss": jnp.mean(stats.aux_loss),
        "moe/z_loss": jnp.mean(stats.z_loss),
    }
    if record.assignments:
        metrics[ASSIGNMENTS] = stats.router_experts
    return metrics


def stage_loss(
    layer_metrics: Sequence[Mapping[str, jax.Array]], records: Sequence[MoELayer]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A stage's MoE loss term, its blocks' auxiliary and z losses weighted by their records
    (zero on a stage without MoE blocks), and those losses as the step metrics ``aux_loss``
    and ``z_loss``."""
    aux = sum((m["moe/aux_loss"] for m in layer_metrics if "moe/aux_loss" in m), jnp.float32(0))
    z = sum((m["moe/z_loss"] for m in layer_metrics if "moe/z_loss" in m), jnp.float32(0))
    metrics = {"aux_loss": aux, "z_loss": z}
    if not records:
        return jnp.float32(0), metrics
    return records[0].aux_loss_weight * aux + records[0].z_loss_weight * z, metrics


def totals(metrics: Mapping[str, Any], xp: Any) -> dict[str, Any]:
    """What follows from the folded MoE metrics of the whole model (none without them): each
    layer's routed pairs per expert and the fraction of pairs dropped."""
    if GROUP_LOADS not in metrics:
        return {}
    loads, dropped = metrics[GROUP_LOADS], metrics["moe/dropped"]
    return {
        TOKENS_PER_EXPERT: xp.sum(loads, axis=1),  # [L, E]
        "dropped_fraction": xp.float32(xp.sum(dropped)) / xp.float32(xp.sum(loads)),
    }


def _update_record(record: MoELayer) -> MoELayer:
    """What of a record the update program reads: not the capacities (forward only)."""
    return dataclasses.replace(record, capacities=(), ragged_total=0)


MOE_HOOKS = HookSet(
    MOE,
    reductions=(
        (GROUP_LOADS, "rows"),
        ("moe/dropped", "sum"),
        ("moe/unrouted", "sum"),
        ("moe/expert_tokens", "sum"),
        (ASSIGNMENTS, "rows"),
    ),
    stage_loss=stage_loss,
    step_metrics=(
        ("aux_loss", "mean", "sum"),
        ("z_loss", "mean", "sum"),
        ("dropped_fraction", "mean", "first"),  # derived after the fold
    ),
    derived=totals,
    update_record=_update_record,
)


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Where an MoE layer runs: tokens sharded over ``token_axes``, experts over ``expert_axis``."""

    mesh: Mesh
    token_axes: tuple[str, ...] = ("data", "expert")
    expert_axis: str = "expert"

    @property
    def expert_shards(self) -> int:
        return self.mesh.shape[self.expert_axis]


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """Static placement of expert slots in one group's dispatch buffer.

    The buffer holds ``shards`` chunks of ``shard_slots`` rows; chunk j belongs to the device that
    owns experts [j*El, (j+1)*El). Inside a chunk, local expert i owns ``slot_sizes[i]`` rows.
    """

    capacities: tuple[int, ...]
    shards: int = 1

    def __post_init__(self):
        if len(self.capacities) % self.shards:
            raise ValueError(
                f"{len(self.capacities)} experts cannot be split over {self.shards} expert shards"
            )

    @property
    def slot_sizes(self) -> tuple[int, ...]:
        per = np.asarray(self.capacities).reshape(self.shards, -1)
        return tuple(int(c) for c in per.max(axis=0))

    @property
    def shard_slots(self) -> int:
        return sum(self.slot_sizes)

    @property
    def total(self) -> int:
        return self.shards * self.shard_slots

    def expert_base(self) -> np.ndarray:
        """First buffer row of each expert, shape [E]."""
        offsets = np.concatenate([[0], np.cumsum(self.slot_sizes)[:-1]])
        shard = np.arange(len(self.capacities)) // len(self.slot_sizes)
        return shard * self.shard_slots + np.tile(offsets, self.shards)


@dataclasses.dataclass(frozen=True)
class RaggedCapacities:
    """The ragged path's capacities: per-expert ``values`` [E] int are a runtime input (changing
    them needs no recompile); ``shard_total``, the static rows per group per expert shard of the
    dispatch buffer, is compiled in and must be >= each shard's kept pairs per group, i.e.
    min(its summed capacities, group_tokens * min(top_k, local experts))."""

    values: jax.Array
    shard_total: int

    def __len__(self) -> int:
        return self.values.shape[0]


class MoEStats(NamedTuple):
    """Per-layer routing statistics; G = number of groups (sequences), S = seq len."""

    group_loads: jax.Array  # [G, E] int32: (token, choice) pairs routed to each expert, pre-drop
    dropped: jax.Array  # [G] int32: pairs dropped for lack of capacity
    aux_loss: jax.Array  # [G] f32: Switch balance loss per group
    z_loss: jax.Array  # [G] f32: router z-loss per group
    router_experts: jax.Array  # [G, S, k] int32: the router's own top-k (what a cache stores)
    unrouted: jax.Array  # [G] int32: tokens no expert computes (all pairs dropped / not chosen)
    expert_tokens: jax.Array  # [G, E] int32: tokens each expert computes (kept pairs)


def route(
    logits: jax.Array,
    top_k: int,
    cached: jax.Array | None = None,
    bias: jax.Array | None = None,
    normalize: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Softmax top-k routing. Returns (probs [G,S,E], gates [G,S,k], experts, router_experts).

    With ``cached`` ([G,S,k], -1 where nothing is cached) dispatch uses the cached experts, but the
    gates are the current router's probabilities for them (DynaMoE §4.2). ``bias`` [E] is added
    to the probabilities for the selection only (DeepSeek-V3 §2.1.2): the gates do not see it.

    ``normalize`` (``moe.normalize_topk``): the k gates of a token (k > 1) are renormalised to sum
    to 1, which equals a softmax over the top-k logits (Mixtral, Qwen3-MoE); without it they are
    the full softmax's probabilities (Qwen1.5/2-MoE, OLMoE). With k = 1 the gate is the
    probability either way (Switch), so the router gets a gradient through it.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    scores = probs if bias is None else probs + jax.lax.stop_gradient(bias.astype(jnp.float32))
    _, router_experts = jax.lax.top_k(scores, top_k)
    experts = router_experts if cached is None else jnp.where(cached >= 0, cached, router_experts)
    gates = jnp.take_along_axis(probs, experts, axis=-1)
    if top_k > 1 and normalize:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return probs, gates, experts, router_experts


def _positions(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each (token, choice) pair's rank among its group's pairs for the same expert, in priority
    order (every token's first choice before any second choice, earlier tokens first).

    Returns (order [G, kS] expert ids choice-major, position [G, kS], group_loads [G, E]).
    """
    g, s, k = experts.shape
    order = jnp.swapaxes(experts, 1, 2).reshape(g, k * s)  # choice-major priority
    onehot = jax.nn.one_hot(order, num_experts, dtype=jnp.int32)  # [G, kS, E]
    position = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1)
    return order, position, jnp.sum(onehot, axis=1)


def _back(a: jax.Array, experts: jax.Array) -> jax.Array:
    """[G, kS] choice-major -> [G, S, k]."""
    g, s, k = experts.shape
    return jnp.swapaxes(a.reshape(g, k, s), 1, 2)


def assign_slots(experts: jax.Array, layout: SlotLayout) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Buffer row of every (token, choice) pair; dropped pairs point at row ``layout.total``.

    Returns (slot [G,S,k] int32, kept [G,S,k] bool, group_loads [G,E] int32).
    """
    order, position, loads = _positions(experts, len(layout.capacities))
    capacity = jnp.asarray(layout.capacities, jnp.int32)[order]
    kept = position < capacity
    base = jnp.asarray(layout.expert_base(), jnp.int32)[order]
    slot = jnp.where(kept, base + position, layout.total)
    return _back(slot, experts), _back(kept, experts), loads


def choose_tokens(
    probs: jax.Array, capacities: tuple[int, ...] | jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Expert choice (Zhou et al. 2022 §3.1): expert e takes the min(C_e, S) tokens of each group
    with the highest probability for it. Static ``capacities`` (ints) look at the top max(C)
    tokens only; runtime ones ([E] array) rank all S.

    Returns (token [G,E,c] int32 indices, best first; taken [E,c] bool; gate [G,E,c]: the
    tokens' probabilities for the expert).
    """
    g, s, e = probs.shape
    c = min(max(*capacities, 1), s) if isinstance(capacities, tuple) else s
    by_expert = jnp.swapaxes(probs, 1, 2)  # [G, E, S]
    _, token = jax.lax.top_k(by_expert, c)
    taken = jnp.arange(c) < jnp.minimum(jnp.asarray(capacities, jnp.int32), s)[:, None]
    return token.astype(jnp.int32), taken, jnp.take_along_axis(by_expert, token, axis=-1)


def chosen_pairs(token: jax.Array, taken: jax.Array, num_tokens: int) -> jax.Array:
    """[G,S,E] bool: whether expert e took token s (expert choice as one pair per expert)."""
    g, e, c = token.shape
    rows = jnp.arange(g)[:, None, None]
    experts = jnp.broadcast_to(jnp.arange(e)[None, :, None], token.shape)
    hit = jnp.broadcast_to(taken, token.shape).astype(jnp.int32)
    return jnp.zeros((g, num_tokens, e), jnp.int32).at[rows, token, experts].add(hit) > 0


def expert_choice_rows(
    token: jax.Array, gate: jax.Array, layout: SlotLayout, num_tokens: int
) -> tuple[jax.Array, jax.Array]:
    """Expert choice on the static layout: (row [G, total] the token each buffer row computes,
    ``num_tokens`` for a padding row; weight [G, total], 0 on padding)."""
    sizes = np.minimum(layout.capacities, num_tokens)
    es = np.repeat(np.arange(len(sizes)), sizes)
    cs = np.concatenate([np.arange(n) for n in sizes]).astype(np.int64)
    dest = layout.expert_base()[es] + cs
    g = token.shape[0]
    row = jnp.full((g, layout.total), num_tokens, jnp.int32).at[:, dest].set(token[:, es, cs])
    weight = jnp.zeros((g, layout.total), gate.dtype).at[:, dest].set(gate[:, es, cs])
    return row, weight


def keep_pairs(experts: jax.Array, capacities: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The static path's drop rule with runtime capacities ([E] int): (kept [G,S,k], loads)."""
    order, position, loads = _positions(experts, capacities.shape[0])
    return _back(position < capacities.astype(jnp.int32)[order], experts), loads


def expert_activation(h: jax.Array, w_out: jax.Array) -> jax.Array:
    """The experts' hidden activation of ``h = x @ w_in``: GELU, or SwiGLU when ``w_in`` holds
    gate and up side by side ([.., d, 2h] against ``w_out``'s h rows: Mixtral's experts), so
    both kinds travel as the same two stacked arrays through dispatch and expert parallelism."""
    if h.shape[-1] == 2 * w_out.shape[-2]:
        gate, up = jnp.split(h, 2, axis=-1)
        return jax.nn.silu(gate) * up
    return jax.nn.gelu(h)


def _expert_ffn(rows: jax.Array, w_in: jax.Array, w_out: jax.Array, slot_sizes) -> jax.Array:
    """Each local expert's MLP on exactly its own slots. rows: [g, X, K, d]."""
    outs, start = [], 0
    for i, size in enumerate(slot_sizes):
        h = jnp.einsum("gxcd,dh->gxch", rows[:, :, start : start + size], w_in[i])
        h = expert_activation(checkpoint_name(h, HIDDEN), w_out)
        outs.append(jnp.einsum("gxch,hd->gxcd", h, w_out[i]))
        start += size
    return jnp.concatenate(outs, axis=2)


def _dispatch_experts_combine(x, slot, weight, w_in, w_out, *, layout, expert_axis):
    """Scatter pairs into slots, run experts (all-to-all when sharded), gather and weight."""
    g, s, d = x.shape
    k = slot.shape[-1]
    rows = jnp.arange(g)[:, None, None]
    pairs = jnp.broadcast_to(x[:, :, None, :], (g, s, k, d))
    buf = jnp.zeros((g, layout.total + 1, d), x.dtype).at[rows, slot].add(pairs)
    send = buf[:, : layout.total].reshape(g, layout.shards, layout.shard_slots, d)
    if layout.shards > 1:
        send = jax.lax.all_to_all(send, expert_axis, 1, 1, tiled=True)
    out = _expert_ffn(checkpoint_name(send, DISPATCHED), w_in, w_out, layout.slot_sizes)
    if layout.shards > 1:
        out = jax.lax.all_to_all(out, expert_axis, 1, 1, tiled=True)
    out = checkpoint_name(out, RETURNED)
    out = jnp.concatenate([out.reshape(g, layout.total, d), jnp.zeros((g, 1, d), out.dtype)], 1)
    return jnp.einsum("gskd,gsk->gsd", out[rows, slot], weight.astype(out.dtype))


def _gather_experts_combine(x, row, weight, w_in, w_out, *, layout, expert_axis):
    """Expert choice on the static path: gather each buffer row's token (a zero row for
    padding), run experts (all-to-all when sharded), add each row's weighted output back."""
    g, s, d = x.shape
    groups = jnp.arange(g)[:, None]
    padded = jnp.concatenate([x, jnp.zeros((g, 1, d), x.dtype)], axis=1)
    send = padded[groups, row].reshape(g, layout.shards, layout.shard_slots, d)
    if layout.shards > 1:
        send = jax.lax.all_to_all(send, expert_axis, 1, 1, tiled=True)
    out = _expert_ffn(checkpoint_name(send, DISPATCHED), w_in, w_out, layout.slot_sizes)
    if layout.shards > 1:
        out = jax.lax.all_to_all(out, expert_axis, 1, 1, tiled=True)
    out = checkpoint_name(out, RETURNED)
    out = out.reshape(g, layout.total, d) * weight[..., None].astype(out.dtype)
    return jnp.zeros((g, s + 1, d), out.dtype).at[groups, row].add(out)[:, :s]


def tile_rows(rows: int, local: int) -> int:
    """CPU tile height for ``rows`` dispatched rows over ``local`` experts: a power of two in
    [8, 128] near a quarter of an expert's even share. Smaller tiles pad less (at most
    ``local * (tile - 1)`` rows) but make more, smaller matmuls; 16 measured slower than 32 and
    64 at the benchmark's shapes (benchmarks/moe_ragged.py)."""
    return int(np.clip(2 ** int(np.log2(max(rows // (4 * local), 1))), 8, 128))


def grouped_ffn(
    buf: jax.Array, expert: jax.Array, w_in: jax.Array, w_out: jax.Array, *, tiles: bool
) -> jax.Array:
    """Each tile's expert MLP. ``buf`` [n, t, d]: n tiles of t rows; ``expert`` [n] names each
    tile's expert, ``E`` (= w_in.shape[0]) an unused tile (its rows are zero; output 0).

    ``tiles=True`` (CPU, where ``ragged_dot`` computes every row against every expert under a
    mask, E times the FLOPs): one batched matmul of every tile with its expert's gathered
    weights, megablox's tiling done by hand. ``tiles=False``: the rows sorted by expert through
    ``jax.lax.ragged_dot`` (a grouped GEMM on GPU/TPU) with runtime group sizes; unused tiles
    fall outside every group.
    """
    num, (n, t, d) = w_in.shape[0], buf.shape
    if tiles:
        e = jnp.minimum(expert, num - 1)  # an unused tile's zero rows compute zeros
        h = checkpoint_name(jnp.einsum("ntd,ndh->nth", buf, w_in[e]), HIDDEN)
        h = expert_activation(h, w_out)
        return jnp.einsum("nth,nhd->ntd", h, w_out[e])
    ids = jnp.repeat(expert, t)
    sizes = jnp.sum(jax.nn.one_hot(ids, num, dtype=jnp.int32), axis=0)
    perm = jnp.argsort(ids, stable=True)
    rows = buf.reshape(n * t, d)[perm]
    h = expert_activation(checkpoint_name(jax.lax.ragged_dot(rows, w_in, sizes), HIDDEN), w_out)
    out = jnp.zeros((n * t, d), buf.dtype).at[perm].set(jax.lax.ragged_dot(h, w_out, sizes))
    return out.reshape(n, t, d)


def _ragged_experts_combine(x, experts, kept, weight, w_in, w_out, *, shard_total, expert_axis):
    """Kept pairs grouped by expert, each expert's run padded to whole tiles, through
    `grouped_ffn` (runtime group sizes).

    One scatter puts every kept pair straight into its final row: the send buffer holds
    ``shards`` chunks of n tiles of t rows (g = local groups); chunk j holds the pairs for the
    experts of shard j, expert-major, each expert's run padded to whole tiles, so a receiving
    shard multiplies each tile by one local expert with no second sort; the tiles' experts
    travel with the rows. n * t >= g * shard_total + local * (t - 1) holds the kept pairs
    whenever `RaggedCapacities` does. On CPU t = `tile_rows`; elsewhere t = 1 (no padding:
    ``ragged_dot`` groups rows, not tiles). One gather brings the outputs back.
    """
    g, s, d = x.shape
    k = experts.shape[-1]
    local = w_in.shape[0]
    shards = 1 if expert_axis is None else jax.lax.axis_size(expert_axis)
    cpu = jax.default_backend() == "cpu"
    t = tile_rows(g * shard_total, local) if cpu else 1
    n = -(-(g * shard_total + local * (t - 1)) // t)  # tiles per chunk
    chunk = n * t
    e, keep = experts.reshape(-1), kept.reshape(-1)
    onehot = jax.nn.one_hot(jnp.where(keep, e, local * shards), local * shards, dtype=jnp.int32)
    rank = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)
    padded = (-(-jnp.sum(onehot, axis=0) // t) * t).reshape(shards, local)
    ends = jnp.cumsum(padded, axis=1)  # [shards, local]: each expert's run's end in its chunk
    pos = (ends - padded).reshape(-1)[e] + rank
    keep = keep & (pos < chunk)  # only reachable with capacities over the total: never scatter out
    idx = jnp.where(keep, (e // local) * chunk + pos, shards * chunk)
    pairs = jnp.repeat(x.reshape(g * s, d), k, axis=0)
    send = jnp.zeros((shards * chunk + 1, d), x.dtype).at[idx].add(pairs)[:-1]
    send = send.reshape(shards, n, t, d)
    # each tile's local expert; `local` past the last run (an unused tile)
    starts = jnp.arange(n) * t
    tile_expert = jax.vmap(lambda end: jnp.searchsorted(end, starts, side="right"))(ends)
    tile_expert = tile_expert.astype(jnp.int32)
    if shards > 1:
        send = jax.lax.all_to_all(send, expert_axis, 0, 0, tiled=True)
        tile_expert = jax.lax.all_to_all(tile_expert, expert_axis, 0, 0, tiled=True)
    send = checkpoint_name(send.reshape(shards * n, t, d), DISPATCHED)
    out = grouped_ffn(send, tile_expert.reshape(-1), w_in, w_out, tiles=cpu)
    out = out.reshape(shards, chunk, d)
    if shards > 1:
        out = jax.lax.all_to_all(out, expert_axis, 0, 0, tiled=True)
    out = checkpoint_name(out.reshape(shards * chunk, d), RETURNED)
    out = jnp.concatenate([out, jnp.zeros((1, d), out.dtype)])[idx].reshape(g, s, k, d)
    return jnp.einsum("gskd,gsk->gsd", out, weight.astype(out.dtype))


class MoE(nnx.Module):
    """E experts held as stacked weights ``w_in`` [E, d, h] and ``w_out`` [E, h, d]; with
    ``routed_bias`` a `RoutedBias` [E] for auxiliary-loss-free balancing.

    ``gated``: SwiGLU experts, ``w_in`` [E, d, 2h] holding gate then up (`expert_activation`).
    ``normalize_topk``: `route`'s ``normalize``. ``shared``: a dense expert (``shared_dim``
    wide; an `MLP`, or a `SwiGLU` when ``gated``) that every token passes through besides its
    routed ones, its output added (DeepSeekMoE's shared experts, as one MLP of their summed
    width); with ``shared_gate`` scaled per token by ``sigmoid(x @ shared_gate)`` first
    (Qwen-MoE's ``shared_expert_gate``, [d, 1])."""

    def __init__(
        self,
        d_model: int,
        hidden: int,
        num_experts: int,
        top_k: int,
        *,
        out_std: float,
        rngs: nnx.Rngs,
        routing: str = "token_choice",
        routed_bias: bool = False,
        gated: bool = False,
        normalize_topk: bool = True,
        shared_dim: int = 0,
        shared_gate: bool = False,
    ):
        if routing not in ROUTINGS:
            raise ValueError(f"routing={routing!r} is not one of {ROUTINGS}")
        self.top_k = top_k
        self.routing = routing
        self.normalize_topk = normalize_topk
        self.router = nnx.Param(
            nnx.initializers.normal(0.02)(rngs.params(), (d_model, num_experts))
        )
        width = 2 * hidden if gated else hidden
        self.w_in = nnx.Param(
            nnx.initializers.normal(0.02)(rngs.params(), (num_experts, d_model, width))
        )
        self.w_out = nnx.Param(
            nnx.initializers.normal(out_std)(rngs.params(), (num_experts, hidden, d_model))
        )
        if routed_bias:
            setattr(self, BIAS, RoutedBias(jnp.zeros((num_experts,), jnp.float32)))
        if shared_dim:
            mlp = SwiGLU if gated else MLP
            self.shared = mlp(d_model, shared_dim, out_std=out_std, rngs=rngs)
            if shared_gate:
                init = nnx.initializers.normal(0.02)
                self.shared_gate = nnx.Param(init(rngs.params(), (d_model, 1)))

    def __call__(
        self,
        x: jax.Array,
        *,
        capacities: tuple[int, ...] | RaggedCapacities,
        parallel: ExpertParallel | None = None,
        cached: jax.Array | None = None,
        chunking: Chunking | None = None,
    ) -> tuple[jax.Array, MoEStats]:
        """Python ints: the static path, capacities compiled into the program. `RaggedCapacities`:
        the ragged path (``moe.dispatch="ragged"``). Both keep the same (token, choice) pairs.
        ``chunking``: MPipeMoE's partitions and memory reuse (None: one partition, no reuse)."""
        num_experts = self.w_in.shape[0]
        if len(capacities) != num_experts:
            raise ValueError(f"{len(capacities)} capacities given for {num_experts} experts")
        logits = x.astype(jnp.float32) @ self.router[...].astype(jnp.float32)
        bias = getattr(self, BIAS)[...] if hasattr(self, BIAS) else None
        probs, gates, experts, router_experts = route(
            logits, self.top_k, cached, bias, self.normalize_topk
        )
        shards = parallel.expert_shards if parallel else 1
        w_in, w_out = self.w_in[...].astype(x.dtype), self.w_out[...].astype(x.dtype)
        axis = parallel.expert_axis if parallel else None
        ragged = isinstance(capacities, RaggedCapacities)
        total = capacities.shard_total if ragged else 0
        ragged_fn = lambda *a: _ragged_experts_combine(*a, shard_total=total, expert_axis=axis)
        g, s = experts.shape[:2]
        if self.routing == "expert_choice":
            token, taken, gate = choose_tokens(
                probs, capacities.values if ragged else tuple(capacities)
            )
            kept = chosen_pairs(token, taken, s)  # [G, S, E]: one pair per (token, expert)
            loads = expert_tokens = jnp.sum(kept, axis=1, dtype=jnp.int32)
            if ragged:
                fn = ragged_fn
                ids = jnp.broadcast_to(jnp.arange(num_experts, dtype=jnp.int32), kept.shape)
                args = (x, ids, kept, jnp.where(kept, probs, 0.0), w_in, w_out)
            else:
                layout = SlotLayout(tuple(capacities), shards)
                row, weight = expert_choice_rows(token, gate, layout, s)
                fn = lambda *a: _gather_experts_combine(*a, layout=layout, expert_axis=axis)
                args = (x, row, weight, w_in, w_out)
        else:
            if ragged:
                kept, loads = keep_pairs(experts, capacities.values)
                fn = ragged_fn
                args = (x, experts, kept, jnp.where(kept, gates, 0.0), w_in, w_out)
            else:
                layout = SlotLayout(tuple(capacities), shards)
                slot, kept, loads = assign_slots(experts, layout)
                fn = lambda *a: _dispatch_experts_combine(*a, layout=layout, expert_axis=axis)
                args = (x, slot, jnp.where(kept, gates, 0.0), w_in, w_out)
            onehot = jax.nn.one_hot(experts, num_experts, dtype=jnp.int32)
            expert_tokens = jnp.sum(onehot * kept[..., None], axis=(1, 2))
        fn = chunked(fn, chunking, len(args) - 2)
        if parallel is not None:
            tokens, expert = P(parallel.token_axes), P(parallel.expert_axis)
            fn = jax.shard_map(
                fn,
                mesh=parallel.mesh,
                in_specs=(tokens,) * (len(args) - 2) + (expert, expert),
                out_specs=tokens,
            )
        y = fn(*args)
        if hasattr(self, "shared"):
            y = y + self.shared_output(x)
        z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2, axis=-1)
        unrouted = jnp.sum(~jnp.any(kept, axis=-1), axis=1).astype(jnp.int32)
        if self.routing == "expert_choice":  # balanced by construction: no balance loss
            aux, dropped = jnp.zeros((g,), jnp.float32), jnp.zeros((g,), jnp.int32)
        else:
            tokens_per_group = s * self.top_k
            aux = num_experts * jnp.sum(loads / tokens_per_group * jnp.mean(probs, axis=1), -1)
            dropped = jnp.sum(~kept, axis=(1, 2)).astype(jnp.int32)
        stats = MoEStats(loads, dropped, aux, z, router_experts, unrouted, expert_tokens)
        return y, stats

    def shared_output(self, x: jax.Array) -> jax.Array:
        """The shared expert's output on ``x``, gated when the block has a gate (a block
        with a shared expert only)."""
        shared = self.shared(x)
        if hasattr(self, "shared_gate"):
            shared = shared * jax.nn.sigmoid(x @ self.shared_gate[...].astype(x.dtype))
        return shared
