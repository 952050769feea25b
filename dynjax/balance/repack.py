"""Re-pack a pipeline onto fewer workers (seed 000 §3.4 Alg. 2; seed 003 §B.4 Alg. 3).

DynMo's first-fit moves *all* layers of a worker onto another whose memory still fits, until the
target worker count is reached; freed GPUs go back to the job manager. In a pipeline only
neighbouring stages can merge (the layers must stay consecutive), so a re-packed layout is a
coarsening of the current one: each new stage is a run of whole old stages, and nothing but
whole stages moves. Among the coarsenings that fit, the one with the smallest maximum stage cost
is chosen (:func:`~dynjax.balance.partition` over the old stages as units). To rebalance at
layer granularity afterwards, call ``partition(costs, len(packed), ..., current=packed)``.

Note: Alg. 2 in seed 000 tests ``sum(active) > target`` where seed 003's Alg. 3 prints ``<=``; the
prose of both says merging continues while the active count exceeds the target, which is what this
does.
"""

from collections.abc import Sequence

import numpy as np

from dynjax.balance._checks import as_counts, as_nonneg, per_stage
from dynjax.balance.errors import InfeasibleError
from dynjax.balance.partition import partition


def repack(
    costs: Sequence[float] | np.ndarray,
    counts: Sequence[int],
    *,
    memory: Sequence[float] | np.ndarray,
    capacity: float,
    target: int | None = None,
) -> tuple[int, ...]:
    """Merge neighbouring stages of ``counts`` down to ``target`` stages (default: fewest that fit).

    Args:
      costs: per-layer cost ``[L]``, used to balance the merged stages.
      counts: current layers per stage ``[S]``.
      memory: per-layer memory ``[L]``.
      capacity: memory of one worker (all workers alike, as in Alg. 2).
      target: number of stages wanted, ``1 <= target <= S``.

    Raises:
      InfeasibleError: a current stage is already over capacity, or ``target`` stages cannot hold
        the model.

    >>> repack([1, 1, 1, 1], (1, 1, 1, 1), memory=[1, 1, 1, 1], capacity=2)
    (2, 2)
    """
    c = as_nonneg(costs, "costs")
    n = as_counts(counts, c.size)
    mem = as_nonneg(memory, "memory")
    if mem.size != c.size:
        raise ValueError(f"memory has {mem.size} entries, expected {c.size} (one per layer)")
    if np.ndim(capacity) != 0:
        raise ValueError("repack takes one capacity shared by all workers (Alg. 2's MAX_MEM)")
    cap = float(per_stage(capacity, 1, "capacity")[0])
    bounds = np.concatenate(([0], np.cumsum(n)))
    unit_cost = np.add.reduceat(c, bounds[:-1])
    unit_mem = np.add.reduceat(mem, bounds[:-1])
    over = np.flatnonzero(unit_mem > cap)
    if over.size:
        raise InfeasibleError(
            f"stage {int(over[0])} already needs memory {unit_mem[over[0]]:g} > capacity {cap:g}; "
            "re-packing only merges stages"
        )
    fewest = _fewest_runs(unit_mem, cap)
    if target is None:
        target = fewest
    elif not 1 <= target <= n.size:
        raise ValueError(f"target must be in [1, {n.size}], got {target}")
    elif target < fewest:
        raise InfeasibleError(
            f"{target} stages cannot hold the model: merging neighbouring stages needs at least "
            f"{fewest} workers of capacity {cap:g}"
        )
    groups = partition(unit_cost, target, memory=unit_mem, capacity=cap)
    group_bounds = np.concatenate(([0], np.cumsum(groups)))
    return tuple(int(x) for x in np.diff(bounds[group_bounds]))


def _fewest_runs(unit_mem: np.ndarray, cap: float) -> int:
    """Fewest runs of consecutive units with memory ``<= cap`` each (greedy first-fit is optimal
    on a line: extending the current run never hurts the rest). Sums are prefix differences, the
    same float expression :func:`partition` tests, so both agree on what fits."""
    prefix = np.concatenate(([0.0], np.cumsum(unit_mem))).tolist()
    runs, start = 1, 0
    for end in range(1, len(prefix)):
        if prefix[end] - prefix[start] > cap:
            runs, start = runs + 1, end - 1
    return runs
