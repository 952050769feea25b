"""When to freeze layers: AutoFreeze's gradient rule and Egeria's plasticity rule, in NumPy.

Seed 000 §2.3: a frozen layer contributes no compute (``c_i = 0``) to its worker's load, and
earlier layers converge first (Egeria [59]). Seed 000 §4.2.3: DynMo sits on top of a freezing
scheme (Egeria) and rebalances whenever its reference model is updated. Both rules here therefore
freeze a *prefix* of the layers, front to back, that only grows (a frozen prefix runs no backward
at all, `Plan.frozen_layers`): never before `start_step`, never more than `max_layers` layers.

Pure functions of plain arrays (STYLE habit 1): `series` turns a policy's History entries into
`steps [T]` and `values [T, L]`; the measurements themselves are made on device by the plugin
(`dynjax/dynamism/freezing.py`), NaN for layers that are frozen or not measured at a step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from numbers import Integral, Real
from typing import Any

import numpy as np

METRICS = ("gradient", "plasticity")


def series(
    entries: Iterable[tuple[int, Mapping[str, Any]]], key: str
) -> tuple[np.ndarray, np.ndarray]:
    """`steps [T]` and `values [T, L]` of the per-layer metric `key` in `(step, metrics)` entries.

    Entries without `key` are skipped, so `History.entries` can be passed as they are.

    >>> steps, values = series([(0, {"g": [1.0, 2.0]}), (1, {}), (2, {"g": [3.0, 4.0]})], "g")
    >>> steps.tolist(), values.tolist()
    ([0, 2], [[1.0, 2.0], [3.0, 4.0]])
    """
    rows = [(step, metrics[key]) for step, metrics in entries if key in metrics]
    steps = np.array([step for step, _ in rows], dtype=np.int64)
    if not rows:
        return steps, np.zeros((0, 0))
    return steps, np.stack([np.asarray(v, dtype=np.float64).reshape(-1) for _, v in rows])


def frozen_layers(prefix: int) -> tuple[int, ...]:
    """The layers of a frozen prefix of length `prefix`, as `Plan.frozen_layers` holds them."""
    return tuple(range(prefix))


def prefix_length(layers: Iterable[int]) -> int:
    """How many layers from layer 0 on are all in `layers` (e.g. `Plan.frozen_layers`).

    >>> prefix_length((0, 1, 2, 5)), prefix_length((1, 2))
    (3, 0)
    """
    present = set(layers)
    prefix = 0
    while prefix in present:
        prefix += 1
    return prefix


def max_frozen_layers(num_layers: int, max_fraction: float) -> int:
    """At most ``floor(max_fraction * num_layers)`` layers freeze, and at least one stays trainable.

    The 1e-9 forgives float rounding (``0.29 * 100 = 28.999...``) so the count reads as written.
    """
    return max(0, min(math.floor(max_fraction * num_layers + 1e-9), num_layers - 1))


def interval_changes(steps: np.ndarray, grad_norms: np.ndarray, *, every: int) -> np.ndarray | None:
    """Each layer's relative change of gradient norm between the two newest complete intervals.

    Interval ``k`` holds steps ``[k * every, (k + 1) * every)``; ``A_k`` is the mean over its steps
    of a layer's gradient norm (the sum AutoFreeze accumulates, divided by the steps measured, so
    a skipped step does not read as a drop). The change is ``|A_k - A_{k-1}| / A_{k-1}`` for the
    newest complete ``k``: NaN where a layer has no measurement in either interval (frozen) or
    ``A_{k-1} = 0``. An interval is complete once the history reaches from its first step to its
    last. Returns `[L]`, or None before two intervals are complete.
    """
    steps, values = _checked(steps, grad_norms, every, "every")
    if len(steps) == 0:
        return None
    newest = int(steps[-1] + 1) // every - 1
    if newest < 1 or steps[0] > (newest - 1) * every:
        return None
    before = _interval_mean(steps, values, newest - 1, every)
    after = _interval_mean(steps, values, newest, every)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(before > 0, np.abs(after - before) / before, np.nan)


def gradient_freeze_prefix(
    steps: np.ndarray,
    grad_norms: np.ndarray,
    frozen_prefix: int,
    *,
    every: int,
    percentile: float,
    start_step: int,
    max_layers: int,
) -> int:
    """The new frozen prefix by AutoFreeze's rule (Liu et al., arXiv:2102.01386; seed 000 ref [31]).

    As we read it, AutoFreeze accumulates each layer's gradient norm over an evaluation
    interval, takes its relative change from the previous interval and freezes front to back:
    every layer before the first whose change is at or above the `percentile`-th percentile
    (linear interpolation) of the layers still training. Here those are the layers with a defined
    change (`interval_changes`): a layer frozen in the measured intervals reports NaN and drops
    out. A trainable layer with no defined change stops the prefix (no evidence, no freezing). A
    layer frozen by an earlier decision on the same intervals keeps its change in the percentile,
    so deciding again on the same history returns the same prefix: the answer does not depend on
    how often it is asked.

    `grad_norms [T, L]` is one gradient norm (not squared) per layer per step of `steps [T]`.
    Returns at least `frozen_prefix` (it never shrinks) and grows it to at most `max_layers`;
    unchanged while the newest step is before `start_step` or two intervals are not complete.
    """
    _check_prefix(frozen_prefix, max_layers)
    if len(steps) == 0 or steps[-1] < start_step:
        return frozen_prefix
    change = interval_changes(steps, grad_norms, every=every)
    if change is None or not np.isfinite(change).any():
        return frozen_prefix
    cut = np.percentile(change[np.isfinite(change)], percentile)
    return _grown(change < cut, frozen_prefix, max_layers)


def window_plasticity(
    steps: np.ndarray, plasticity: np.ndarray, *, reference_every: int, patience: int
) -> np.ndarray | None:
    """Each layer's largest plasticity over the `patience` newest complete reference periods.

    Period ``r`` holds steps ``[r * reference_every, (r + 1) * reference_every)``, measured against
    the reference snapshot taken at its first step; it is complete once its last step is in the
    history (measurements of the current period, against a fresh reference, would read low).
    NaN for a layer without a measurement in one of those periods. Returns `[L]`, or None before
    `patience` periods are complete.
    """
    steps, values = _checked(steps, plasticity, reference_every, "reference_every")
    if patience < 1:
        raise ValueError(f"patience = {patience} must be >= 1")
    if len(steps) == 0:
        return None
    newest = int(steps[-1] + 1) // reference_every - 1
    if newest + 1 < patience:
        return None
    periods = range(newest - patience + 1, newest + 1)
    return np.stack([_period_max(steps, values, r, reference_every) for r in periods]).max(axis=0)


def plasticity_freeze_prefix(
    steps: np.ndarray,
    plasticity: np.ndarray,
    frozen_prefix: int,
    *,
    reference_every: int,
    threshold: float,
    patience: int,
    start_step: int,
    max_layers: int,
) -> int:
    """The new frozen prefix by Egeria's rule (Wang et al., arXiv:2201.06227; seed 000 §4.2.3).

    As we read it, Egeria compares each layer's activations on the same inputs with those of a
    reference model refreshed periodically, and freezes front to back once that "plasticity"
    stops moving within a tolerance over a window of evaluations. With `plasticity [T, L]` the
    relative change ``||h - h_ref|| / ||h_ref||`` of a layer's output on a fixed probe batch, and
    the reference refreshed at the start of every period, the plasticity at the end of a period
    *is* how far the layer moved during it (it is zero at the refresh). So a layer counts as
    converged when every measurement of it in the `patience` newest complete periods is below
    `threshold` (`window_plasticity`), and the prefix grows over converged layers up to the first
    that is not.

    Returns at least `frozen_prefix` and at most `max_layers` (unless `frozen_prefix` is larger);
    unchanged while the newest step is before `start_step` or `patience` periods are not complete.
    """
    _check_prefix(frozen_prefix, max_layers)
    if len(steps) == 0 or steps[-1] < start_step:
        return frozen_prefix
    peak = window_plasticity(steps, plasticity, reference_every=reference_every, patience=patience)
    if peak is None:
        return frozen_prefix
    return _grown(peak < threshold, frozen_prefix, max_layers)


def check_settings(
    *,
    metric: str,
    every: int,
    percentile: float,
    start_step: int,
    max_fraction: float,
    reference_every: int,
    threshold: float,
    patience: int,
) -> None:
    """Raise ValueError naming every `freezing.<key>` whose value the rules above cannot use."""
    problems = []
    if metric not in METRICS:
        problems.append(f"freezing.metric = {metric!r} must be one of {METRICS}")
    for key, value, low in (
        ("every", every, 1),
        ("start_step", start_step, 0),
        ("reference_every", reference_every, 1),
        ("patience", patience, 1),
    ):
        if not _is_int(value) or value < low:
            problems.append(f"freezing.{key} = {value!r} must be an integer >= {low}")
    if not _is_real(percentile) or not 0 < percentile <= 100:
        problems.append(f"freezing.percentile = {percentile!r} must be a number in (0, 100]")
    if not _is_real(max_fraction) or not 0 <= max_fraction < 1:
        problems.append(f"freezing.max_fraction = {max_fraction!r} must be a number in [0, 1)")
    if not _is_real(threshold) or not 0 < threshold < math.inf:
        problems.append(f"freezing.threshold = {threshold!r} must be a finite number > 0")
    if problems:
        raise ValueError("; ".join(problems))


def _grown(converged: np.ndarray, frozen_prefix: int, max_layers: int) -> int:
    """Extend the prefix over consecutive converged layers; cap the growth at `max_layers`."""
    stop = frozen_prefix
    while stop < len(converged) and converged[stop]:
        stop += 1
    return max(frozen_prefix, min(stop, max_layers))


def _interval_mean(steps: np.ndarray, values: np.ndarray, k: int, every: int) -> np.ndarray:
    """Per-layer mean of the finite measurements in interval ``k`` (NaN where there are none)."""
    rows = values[(steps >= k * every) & (steps < (k + 1) * every)]
    finite = np.isfinite(rows)
    count = finite.sum(axis=0)
    total = np.where(finite, rows, 0.0).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / count, np.nan)


def _period_max(steps: np.ndarray, values: np.ndarray, r: int, every: int) -> np.ndarray:
    """Per-layer largest finite measurement in period ``r`` (NaN where there are none)."""
    rows = values[(steps >= r * every) & (steps < (r + 1) * every)]
    peak = np.where(np.isfinite(rows), rows, -np.inf).max(axis=0, initial=-np.inf)
    return np.where(peak > -np.inf, peak, np.nan)


def _checked(
    steps: np.ndarray, values: np.ndarray, every: int, name: str
) -> tuple[np.ndarray, np.ndarray]:
    if every < 1:
        raise ValueError(f"{name} = {every} must be >= 1")
    steps = np.asarray(steps, dtype=np.int64).reshape(-1)
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2 or values.shape[0] != len(steps):
        raise ValueError(f"values of shape {values.shape} do not match {len(steps)} steps x layers")
    if np.any(np.diff(steps) <= 0):
        raise ValueError("steps must be strictly increasing")
    return steps, values


def _check_prefix(frozen_prefix: int, max_layers: int) -> None:
    if frozen_prefix < 0 or max_layers < 0:
        raise ValueError(f"need frozen_prefix ({frozen_prefix}) and max_layers ({max_layers}) >= 0")


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and not math.isnan(value)
