"""How unbalanced a pipeline is: DynMo's imbalance metric and (network-aware) stage costs."""

from collections.abc import Sequence

import numpy as np

from dynjax.balance._checks import as_counts, as_nonneg, hop_costs


def imbalance(loads: Sequence[float] | np.ndarray) -> float:
    """DynMo eq. 2 (seed 000 §2): ``(max(L) - min(L)) / mean(L)`` over the workers' loads.

    0 means perfectly balanced; all-zero loads count as balanced.

    >>> imbalance([3.0, 1.0, 2.0])
    1.0
    >>> imbalance([2.0, 2.0])
    0.0
    """
    arr = as_nonneg(loads, "loads")
    if arr.size == 0:
        raise ValueError("imbalance needs at least one load")
    mean = float(arr.mean())
    if mean == 0.0:
        return 0.0
    return float((arr.max() - arr.min()) / mean)


def stage_costs(
    costs: Sequence[float] | np.ndarray,
    counts: Sequence[int],
    *,
    comm: float | Sequence[float] = 0.0,
) -> np.ndarray:
    """Per-stage load: each stage's summed layer costs plus the time to send its activations on.

    Network-aware balancing (seed 003 §D.2) counts, for worker A, its own work *plus* the transfer
    to its neighbour B, so a slow link pushes work away from the sender. ``comm`` is the per-hop
    transfer time (scalar, or one value per stage boundary); the last stage sends nothing.

    >>> stage_costs([1.0, 2.0, 3.0], (2, 1), comm=0.5).tolist()
    [3.5, 3.0]
    """
    c = as_nonneg(costs, "costs")
    n = as_counts(counts, c.size)
    ends = np.cumsum(n)
    prefix = np.concatenate(([0.0], np.cumsum(c)))
    return prefix[ends] - prefix[ends - n] + hop_costs(comm, n.size)
