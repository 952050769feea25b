"""Sample-assignment caching: reuse a sample's previous expert assignment (seed 001 §4.2, §5.3).

Router assignments converge early in training (seed 001 Fig. 10). Once they are stable, the
experts can be dispatched with the assignment a sample got the previous time it was seen, so they
need not wait for the router; the router still runs, its output refreshes the cache for the next
time, and the gating weights applied are the current ones. `AssignmentCache` keeps assignments on
the host and measures stability; `CachingPolicy` switches the MoE part's ``cached_routing`` on
and off.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from dynjax.dynamism.moe.part import NAME, cached_routing_of
from dynjax.recompile import History, Plan, Proposal

STABILITY = "moe/routing_stability"  # scalar per step; NaN when no sample of the step repeated


class AssignmentCache:
    """The newest top-k expert assignment of each sample, keyed by its stable sample index.

    Holds at most `max_entries` samples (least recently seen are evicted first), each as int16
    [num_moe_layers, seq_len, top_k]: max_entries * L * S * k * 2 bytes in all.
    """

    def __init__(
        self,
        num_moe_layers: int,
        seq_len: int,
        top_k: int,
        num_experts: int,
        *,
        max_entries: int = 65536,
    ) -> None:
        if num_experts > np.iinfo(np.int16).max or max_entries < 1:
            raise ValueError(
                f"need num_experts <= 32767 and max_entries >= 1, got {num_experts}, {max_entries}"
            )
        self.shape = (num_moe_layers, seq_len, top_k)
        self.max_entries = max_entries
        self._store: OrderedDict[int, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return len(self._store)

    def update(self, sample_ids: np.ndarray, assignments: np.ndarray) -> float | None:
        """Store `assignments` [L, B, S, k] of `sample_ids` [B]; return the routing stability.

        Stability: over the samples seen before, the fraction of (layer, token) pairs whose
        top-k expert *set* equals the cached one (order within the k does not matter), i.e. the
        fraction a cached dispatch would have got right (seed 001 §5.3). None if no sample of
        the batch was seen before.
        """
        assignments = np.asarray(assignments)
        L, B, S, k = assignments.shape
        if (L, S, k) != self.shape or len(sample_ids) != B:
            raise ValueError(
                f"assignments {assignments.shape} do not match the cache "
                f"(L, S, k) = {self.shape} and {len(sample_ids)} sample ids"
            )
        new = assignments.astype(np.int16)
        new_sets = np.sort(new, axis=-1)  # [L, B, S, k]: equal sets sort equal
        same = total = 0
        for b, sid in enumerate(np.asarray(sample_ids).tolist()):
            old = self._store.pop(sid, None)
            if old is not None:
                same += int((np.sort(old, axis=-1) == new_sets[:, b]).all(axis=-1).sum())
                total += L * S
            self._store[sid] = new[:, b].copy()  # a copy: a view would pin the whole batch
            if len(self._store) > self.max_entries:
                self._store.popitem(last=False)
        return same / total if total else None

    def lookup(self, sample_ids: np.ndarray) -> np.ndarray:
        """Cached assignments [L, B, S, k] (int32, in the router's order) of `sample_ids`.

        -1 for samples not cached: the model routes those tokens with the router.
        """
        L, S, k = self.shape
        out = np.full((L, len(sample_ids), S, k), -1, np.int32)
        for b, sid in enumerate(np.asarray(sample_ids).tolist()):
            cached = self._store.get(sid)
            if cached is not None:
                out[:, b] = cached
        return out


class CachingPolicy:
    """Switches cached routing on when assignments are stable, off when they are not.

    Over the `window` newest steps that measured `"moe/routing_stability"` (NaN = not
    measured), the mean stability turns caching on when >= `on_threshold`, but not before step
    `warmup_steps`, and off when < `off_threshold`; in between the Plan is kept (hysteresis).
    Seed 001 §5.3 used 96% / 90% and no caching before epoch 10.
    """

    name = "caching"

    def __init__(
        self,
        *,
        on_threshold: float = 0.96,
        off_threshold: float = 0.90,
        warmup_steps: int = 1000,
        window: int = 10,
    ) -> None:
        if not 0 <= off_threshold <= on_threshold <= 1 or window < 1 or warmup_steps < 0:
            raise ValueError(
                "need 0 <= off_threshold <= on_threshold <= 1, window >= 1, warmup_steps >= 0; "
                f"got {off_threshold}, {on_threshold}, {window}, {warmup_steps}"
            )
        self.on_threshold = on_threshold
        self.off_threshold = off_threshold
        self.warmup_steps = warmup_steps
        self.window = window

    def propose(self, history: History, plan: Plan) -> Proposal | None:
        measured = history.finite(STABILITY, len(history))[-self.window :]
        if not measured:
            return None
        stability = sum(measured) / len(measured)
        if not cached_routing_of(plan) and stability >= self.on_threshold:
            if history.latest_step >= self.warmup_steps:
                return Proposal(
                    plan.with_part(NAME, cached_routing=True),
                    f"routing stability {stability:.1%} >= {self.on_threshold:.0%}",
                )
        elif cached_routing_of(plan) and stability < self.off_threshold:
            return Proposal(
                plan.with_part(NAME, cached_routing=False),
                f"routing stability {stability:.1%} < {self.off_threshold:.0%}",
            )
        return None
