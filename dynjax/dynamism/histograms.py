"""Budgets from histograms of needed counts, shared by the schemes that size a static budget
from what their steps report (sparse attention's key blocks, early exit's token buckets): like
MoE capacities, a budget below the need drops the excess and counts it."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np


def overflow_at(hist: np.ndarray, budget: int) -> float:
    """The fraction of the needed units beyond ``budget`` for a histogram of needed counts
    (``hist[c]``: how many holders need c units, e.g. query blocks needing c key blocks)."""
    counts = np.arange(len(hist))
    total = float(np.sum(hist * counts))
    return float(np.sum(hist * np.maximum(counts - budget, 0))) / total if total else 0.0


def smallest_budget(hist: np.ndarray, max_overflow: float) -> int:
    """The smallest budget whose overflow on ``hist`` is at most ``max_overflow``."""
    for budget in range(len(hist)):
        if overflow_at(hist, budget) <= max_overflow:
            return budget
    return len(hist) - 1


def resized_budget(
    hist: np.ndarray,
    budget: int,
    *,
    max_overflow: float,
    headroom: float,
    hysteresis: float,
    bucket: Callable[[int], int],
) -> int:
    """The budget a policy keeps for ``hist``: the smallest meeting ``max_overflow``, times
    ``1 + headroom``, bucketed. It grows at once when ``budget`` overflows and shrinks only below
    ``(1 - hysteresis)`` x ``budget``, so noise does not recompile."""
    target = bucket(math.ceil(smallest_budget(hist, max_overflow) * (1 + headroom)))
    over = overflow_at(hist, budget) > max_overflow
    shrink = target < (1 - hysteresis) * budget
    return target if over or shrink else budget
