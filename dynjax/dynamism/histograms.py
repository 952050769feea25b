"""Budgets from histograms of needed counts, shared by the schemes that size a static budget
from what their steps report (sparse attention's key blocks, early exit's token buckets): like
MoE capacities, a budget below the need drops the excess and counts it."""

from __future__ import annotations

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
