"""Dynamic, per-expert capacities from observed expert loads (seed 001 §4.1, §5.2, Figs. 8-9).

A static, global capacity factor (`static_capacities`) sizes every expert for the worst one and
never adapts; seed 001 §5.2 shows that per-expert capacities that follow the load give a better
runtime/accuracy trade-off, provided the policy does not recompile every iteration.
"""

from __future__ import annotations

import numpy as np

from dynjax.dynamism.moe.part import (
    MoEContext,
    base_capacity,
    capacities_of,
    capacity_for_factor,
    with_capacities,
)
from dynjax.dynamism.moe.settings import CapacitySettings
from dynjax.recompile import History, Plan, Proposal

LOADS = "moe/group_loads"  # int [num_moe_layers, G, E]: tokens routed per group, before dropping


def ragged_totals(
    ctx: MoEContext,
    capacities: tuple[tuple[int, ...], ...],
    shards: int,
    bucket: float,
    expert_choice: bool = False,
) -> tuple[int, ...]:
    """Per MoE layer, the static buffer rows per group and expert shard of the ragged path
    (`dynjax.model.RaggedCapacities`, issue 12 §1): the largest shard's summed capacities,
    rounded up to a multiple of `bucket` capacity factors' worth of slots for the shard's
    experts, and at most the worst case a shard can receive, group_tokens * min(top_k, local
    experts) (the dropless total, as MaxText sizes it); under ``expert_choice`` routing a token
    can reach every local expert: group_tokens * local experts. Only a change of these
    recompiles."""
    local = ctx.num_experts // shards
    worst = ctx.group_tokens * (local if expert_choice else min(ctx.top_k, local))
    unit = max(1, int(np.ceil(bucket * base_capacity(ctx) * local - 1e-9)))
    need = np.asarray(capacities, np.int64).reshape(len(capacities), shards, local).sum(-1)
    return tuple(min(worst, -(-int(n) // unit) * unit) for n in need.max(axis=1))


def drop_fraction(loads: np.ndarray, capacities: np.ndarray) -> np.ndarray:
    """[L] fraction of each layer's routed tokens dropped at `capacities` [L, E].

    loads: [L, N, E] tokens routed to each expert in each of N dispatch groups. A group drops
    max(0, load - C) tokens of an expert.
    """
    dropped = np.maximum(loads - capacities[:, None, :], 0).sum(axis=(1, 2))
    return dropped / np.maximum(loads.sum(axis=(1, 2)), 1)


def required_capacity(loads: np.ndarray, target_drop_rate: float) -> np.ndarray:
    """[L, E] capacities of least total size whose `drop_fraction` is <= target_drop_rate.

    Water-filling: slot c of expert e saves one token in every group whose load exceeds c,
    a saving that only falls as c grows, so the optimum takes slots in order of their saving
    (greedy is exact for such concave gains). Taking every slot that saves more than τ tokens
    gives C_e(τ) = the (τ+1)-th largest load of e: every expert overflows in at most τ groups.
    A bisection per layer finds the largest τ within the budget; the budget left then removes
    slots that save exactly τ+1 tokens, as many as it pays for.
    """
    loads = loads.astype(np.int64)
    num_layers, n, num_experts = loads.shape
    levels = np.concatenate(  # [L, N + 1, E]: level τ = (τ+1)-th largest load, then 0
        [-np.sort(-loads, axis=1), np.zeros((num_layers, 1, num_experts), np.int64)], axis=1
    )
    allowed = target_drop_rate * loads.sum(axis=(1, 2))

    def capacities(tau: np.ndarray) -> np.ndarray:
        return np.take_along_axis(levels, tau[:, None, None], axis=1)[:, 0, :]

    def dropped(caps: np.ndarray) -> np.ndarray:
        return np.maximum(loads - caps[:, None, :], 0).sum(axis=(1, 2))

    lo = np.zeros(num_layers, np.int64)  # feasible: τ = 0 drops nothing
    hi = np.full(num_layers, n + 1, np.int64)  # past the last level
    while (hi - lo > 1).any():
        mid = (lo + hi) // 2
        ok = dropped(capacities(mid)) <= allowed
        lo = np.where(ok, mid, lo)
        hi = np.where(ok, hi, mid)
    caps = capacities(lo)
    spare_slots = np.floor((allowed - dropped(caps)) / (lo + 1)).astype(np.int64)  # [L]
    cheap = caps - capacities(np.minimum(lo + 1, n))  # [L, E] slots saving exactly τ+1
    taken_before = np.cumsum(cheap, axis=1) - cheap
    return caps - np.clip(spare_slots[:, None] - taken_before, 0, cheap)


class DynamicCapacity:
    """Sets each expert's capacity per layer from its load over a window (seed 001 §4.1, §5.2).

    Rule, per MoE layer, over the `window` newest steps with `"moe/group_loads"`:

    1. need = the per-expert capacities of least total size whose dropped fraction of the
       layer's routed tokens over the window is <= `target_drop_rate` (`required_capacity`:
       the budget is water-filled across experts, so hot experts get more slots, cold ones
       fewer, as in Fig. 8);
    2. capacities are rounded up to buckets: those of the factors `min_factor, min_factor +
       bucket, ..., max_factor` (factor 1.0 = group_tokens * top_k / E, Eq. 4), so that few
       distinct Plans exist and returns to earlier ones hit the compile cache;
    3. hysteresis: an expert shrinks only when bucket(need * headroom * (1 + hysteresis)) is
       below its capacity C, and then to that value; if the layer then drops more than the
       target, every expert whose C is below need grows to bucket(need * headroom) at once.
       So C stays put while need is within (C / (headroom * (1 + hysteresis)), C], and noise
       in the window moves no capacity back and forth.

    Seed 001 §5.2 notes that chasing the exact need (average factor 1.0) recompiles every
    iteration; headroom, buckets and hysteresis trade a little capacity for few recompiles.
    After a proposal each layer's drop rate over the window is <= target unless `max_factor`
    caps an expert.
    """

    name = "capacity"

    def __init__(
        self,
        ctx: MoEContext,
        *,
        target_drop_rate: float = 0.01,
        min_factor: float = 0.5,
        max_factor: float = 2.0,
        window: int = 20,
        headroom: float = 1.1,
        bucket: float = 0.25,
        hysteresis: float = 0.2,
    ) -> None:
        if not 0 <= target_drop_rate < 1:
            raise ValueError(f"target_drop_rate = {target_drop_rate} must be in [0, 1)")
        if not 0 < min_factor <= max_factor:
            raise ValueError(f"need 0 < min_factor <= max_factor, got {min_factor}, {max_factor}")
        if window < 1 or headroom < 1 or bucket <= 0 or hysteresis < 0:
            raise ValueError(
                "need window >= 1, headroom >= 1, bucket > 0 and hysteresis >= 0, got "
                f"{window}, {headroom}, {bucket}, {hysteresis}"
            )
        self.ctx = ctx
        self.target_drop_rate = target_drop_rate
        self.window = window
        self.headroom = headroom
        self.hysteresis = hysteresis
        n = int(np.floor((max_factor - min_factor) / bucket + 1e-9))
        factors = [min_factor + i * bucket for i in range(n + 1)] + [max_factor]
        self.buckets = np.unique([capacity_for_factor(ctx, f) for f in factors])

    @classmethod
    def from_settings(cls, ctx: MoEContext, c: CapacitySettings) -> DynamicCapacity:
        """The policy with the ``moe.capacity`` settings ``c``."""
        return cls(
            ctx,
            target_drop_rate=c.target_drop_rate,
            min_factor=c.min_factor,
            max_factor=c.max_factor,
            window=c.window,
            headroom=c.headroom,
            bucket=c.bucket,
            hysteresis=c.hysteresis,
        )

    def propose(self, history: History, plan: Plan) -> Proposal | None:
        if not capacities_of(plan):
            return None
        steps = history.values(LOADS, self.window)
        if len(steps) < self.window:
            return None
        loads = np.concatenate([np.asarray(x) for x in steps], axis=1)  # [L, window * G, E]
        current = np.asarray(capacities_of(plan))  # [L, E]
        if loads.ndim != 3 or loads.shape[::2] != current.shape:
            raise ValueError(
                f"{LOADS} has shape {loads.shape[::2]} (layers, experts) but the "
                f"plan's capacities have shape {current.shape}"
            )
        need = required_capacity(loads, self.target_drop_rate)
        shrunk = self._bucket(need * self.headroom * (1 + self.hysteresis))
        new = np.minimum(shrunk, current)
        over = drop_fraction(loads, new) > self.target_drop_rate  # [L]
        grow = over[:, None] & (need > new)
        new = np.where(grow, np.maximum(self._bucket(need * self.headroom), new), new)
        if (new == current).all():
            return None
        base = base_capacity(self.ctx)
        reason = (
            f"{int((new > current).sum())} experts grow, {int((new < current).sum())} shrink; "
            f"window drop rate {drop_fraction(loads, current).mean():.2%} -> "
            f"{drop_fraction(loads, new).mean():.2%}, "
            f"mean capacity factor {current.mean() / base:.2f} -> {new.mean() / base:.2f}"
        )
        return Proposal(with_capacities(plan, new.tolist()), reason)

    def _bucket(self, capacity: np.ndarray) -> np.ndarray:
        """The smallest bucket >= `capacity` (the largest bucket if none is)."""
        idx = np.searchsorted(self.buckets, capacity, side="left")
        return self.buckets[np.minimum(idx, len(self.buckets) - 1)]
