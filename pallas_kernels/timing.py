"""Median wall time of a jitted call: shared by the selector's measurement and the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def median_seconds(fn: Callable, *args, warmup: int = 1, repeats: int = 5) -> float:
    """Median over ``repeats`` timed calls of ``fn(*args)``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)
