"""Layer-freezing decisions: AutoFreeze's gradient rule, Egeria's plasticity rule (seed 000 §2.3).

Hand-computed cases for each rule and its limits, then property tests against loop-by-loop
references over a simulated run in which frozen layers report NaN.
"""

import doctest
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynjax.dynamism import freezing_math
from dynjax.dynamism.freezing_math import (
    check_settings,
    frozen_layers,
    gradient_freeze_prefix,
    interval_changes,
    max_frozen_layers,
    plasticity_freeze_prefix,
    prefix_length,
    series,
    window_plasticity,
)

NAN = math.nan
STEPS = np.arange(4)
# Two intervals of two steps (every = 2). Interval 0 means to 1.0 for every layer (step 0 and 1
# differ, so a rule reading single steps instead of means gets other changes); interval 1 gives
# relative changes (0.05, 0.5, 0.01, 0.2): layer 2 barely moves but sits behind layer 1.
GRADS = np.array(
    [
        [0.8, 1.0, 1.0, 0.5],
        [1.2, 1.0, 1.0, 1.5],
        [1.05, 1.5, 1.01, 1.2],
        [1.05, 1.5, 1.01, 1.2],
    ]
)


def grad_prefix(steps=STEPS, grads=GRADS, prefix=0, **kw):
    args = dict(every=2, percentile=50.0, start_step=0, max_layers=3) | kw
    return gradient_freeze_prefix(steps, grads, prefix, **args)


def test_gradient_changes_compare_interval_means():
    np.testing.assert_allclose(interval_changes(STEPS, GRADS, every=2), [0.05, 0.5, 0.01, 0.2])


def test_gradient_rule_freezes_front_to_back():
    # Median of the changes is 0.125: layer 0 (0.05) freezes, layer 1 (0.5) stops the prefix,
    # so layer 2 stays trainable though its change (0.01) is the smallest.
    assert grad_prefix() == 1


def test_gradient_rule_percentile_sets_the_cut():
    grads = GRADS[:, [0, 2, 3, 1]]  # changes (0.05, 0.01, 0.2, 0.5)
    assert grad_prefix(grads=grads, percentile=25.0) == 0  # cut 0.04: layer 0 is above it
    assert grad_prefix(grads=grads, percentile=50.0) == 2  # cut 0.125
    assert grad_prefix(grads=grads, percentile=75.0) == 3  # cut 0.275
    assert grad_prefix(grads=grads, percentile=75.0, max_layers=2) == 2


def test_gradient_rule_waits_for_start_step_and_two_complete_intervals():
    assert grad_prefix(start_step=4) == 0
    assert grad_prefix(start_step=3) == 1
    assert interval_changes(STEPS[:3], GRADS[:3], every=2) is None
    assert grad_prefix(STEPS[:3], GRADS[:3]) == 0
    # A history that starts after interval 0 began has only one complete interval.
    assert interval_changes(STEPS[1:], GRADS[1:], every=2) is None
    assert grad_prefix(STEPS[1:], GRADS[1:]) == 0
    assert grad_prefix(np.array([], dtype=int), np.zeros((0, 0))) == 0


def test_gradient_rule_never_shrinks_the_prefix():
    assert grad_prefix(prefix=3) == 3
    assert grad_prefix(prefix=3, max_layers=2) == 3  # a cap lowered later unfreezes nothing


def test_gradient_rule_gives_the_same_answer_when_asked_again():
    grads = GRADS[:, [0, 2, 3, 1]]  # changes (0.05, 0.01, 0.2, 0.5): the median 0.125 freezes 2
    assert grad_prefix(grads=grads) == 2
    # Layers 0 and 1 were still training in these intervals, so they stay in the percentile:
    # dropping them would raise the cut to 0.35 and freeze layer 2 on the same evidence.
    assert grad_prefix(grads=grads, prefix=2) == 2


def test_gradient_rule_ignores_frozen_layers_nan():
    grads = np.array(
        [
            [NAN, 1.0, 1.0, 1.0],
            [NAN, 1.0, 1.0, 1.0],
            [NAN, 1.01, 1.3, 1.4],
            [NAN, 1.01, 1.3, 1.4],
        ]
    )
    # Changes (NaN, 0.01, 0.3, 0.4): the 60th percentile of the three trainable ones is 0.32,
    # so layers 1 and 2 freeze. Counting the frozen layer as a zero change would lower the cut
    # to 0.242 and stop at layer 2; letting the NaN through would freeze nothing.
    assert grad_prefix(grads=grads, prefix=1, percentile=60.0) == 3
    # A trainable layer with no measurement gives no evidence: it is not frozen.
    assert grad_prefix(grads=grads, prefix=0, percentile=60.0) == 0


def test_gradient_rule_skipped_steps_do_not_read_as_a_drop():
    kept = [0, 1, 3]  # step 2 not measured: interval 1 is step 3 alone
    changes = interval_changes(STEPS[kept], GRADS[kept], every=2)
    np.testing.assert_allclose(changes, [0.05, 0.5, 0.01, 0.2])


def test_gradient_change_needs_a_nonzero_earlier_norm():
    grads = GRADS.copy()
    grads[:2, 0] = 0.0
    change = interval_changes(STEPS, grads, every=2)
    assert math.isnan(change[0]) and change[1] == pytest.approx(0.5)
    assert grad_prefix(grads=grads) == 0


# Plasticity: periods of two steps (reference_every = 2), zero at each refresh.
PLAST = np.array(
    [
        [0.0, 0.0, 0.0, 0.0],
        [0.05, 0.30, 0.01, 0.4],
        [0.0, 0.0, 0.0, 0.0],
        [0.08, 0.05, 0.01, 0.4],
    ]
)


def plast_prefix(steps=STEPS, plast=PLAST, prefix=0, **kw):
    args = dict(reference_every=2, threshold=0.1, patience=2, start_step=0, max_layers=3) | kw
    return plasticity_freeze_prefix(steps, plast, prefix, **args)


def test_plasticity_window_takes_each_layers_peak():
    peak = window_plasticity(STEPS, PLAST, reference_every=2, patience=2)
    np.testing.assert_allclose(peak, [0.08, 0.30, 0.01, 0.4])
    peak = window_plasticity(STEPS, PLAST, reference_every=2, patience=1)
    np.testing.assert_allclose(peak, [0.08, 0.05, 0.01, 0.4])


def test_plasticity_rule_freezes_front_to_back():
    # Layer 1 moved 0.30 in period 0: it stops the prefix, so layer 2 (0.01) stays trainable.
    assert plast_prefix() == 1


def test_plasticity_patience_counts_periods():
    assert plast_prefix(patience=1) == 3  # period 1 alone: layers 0-2 below 0.1
    assert plast_prefix(patience=1, max_layers=2) == 2
    assert window_plasticity(STEPS[:3], PLAST[:3], reference_every=2, patience=2) is None
    assert plast_prefix(STEPS[:3], PLAST[:3]) == 0
    assert plast_prefix(STEPS[:3], PLAST[:3], patience=1) == 1  # period 0 is complete at step 1


def test_plasticity_rule_ignores_the_current_period():
    steps, plast = np.arange(5), np.vstack([PLAST, np.full(4, 0.001)])
    assert plast_prefix(steps, plast, patience=1) == 3  # step 4 (period 2) is not read
    plast[4] = 0.9
    assert plast_prefix(steps, plast, patience=1) == 3


def test_plasticity_rule_limits():
    assert plast_prefix(start_step=4) == 0
    assert plast_prefix(prefix=3) == 3
    assert plast_prefix(prefix=3, max_layers=2) == 3
    unmeasured = PLAST.copy()
    unmeasured[:2, 0] = NAN  # layer 0 trainable but not measured in period 0
    assert plast_prefix(plast=unmeasured) == 0
    frozen = PLAST.copy()
    frozen[:, 0] = NAN
    assert plast_prefix(plast=frozen, prefix=1, patience=1) == 3
    assert plast_prefix(threshold=0.08, patience=1) == 0  # strictly below the threshold


def test_prefix_and_layer_helpers():
    assert frozen_layers(3) == (0, 1, 2) and frozen_layers(0) == ()
    assert prefix_length(frozen_layers(3)) == 3
    assert prefix_length((0, 1, 3)) == 2 and prefix_length((1, 2)) == 0
    assert max_frozen_layers(10, 0.29) == 2
    assert max_frozen_layers(100, 0.29) == 29
    assert max_frozen_layers(4, 0.99) == 3
    assert max_frozen_layers(4, 0.0) == 0 and max_frozen_layers(0, 0.5) == 0


def test_docstring_examples_hold():
    result = doctest.testmod(freezing_math)
    assert result.attempted >= 3 and result.failed == 0


def test_series_reads_history_entries():
    entries = [(0, {"g": [1.0, 2.0]}), (1, {"loss": 3.0}), (2, {"g": np.array([3.0, NAN])})]
    steps, values = series(entries, "g")
    assert steps.tolist() == [0, 2]
    np.testing.assert_array_equal(values, [[1.0, 2.0], [3.0, NAN]])
    steps, values = series(entries, "absent")
    assert steps.shape == (0,) and values.shape == (0, 0)


def test_inputs_are_checked():
    with pytest.raises(ValueError, match="strictly increasing"):
        grad_prefix(np.array([0, 2, 1, 3]))
    with pytest.raises(ValueError, match="do not match"):
        grad_prefix(STEPS[:3])
    with pytest.raises(ValueError, match="every"):
        interval_changes(STEPS, GRADS, every=0)


GOOD = dict(
    metric="gradient",
    every=50,
    percentile=50.0,
    start_step=0,
    max_fraction=0.5,
    reference_every=100,
    threshold=0.05,
    patience=2,
)


def test_check_settings_accepts_good_values():
    check_settings(**GOOD)
    check_settings(**GOOD | dict(metric="plasticity", percentile=100, max_fraction=0))


@pytest.mark.parametrize(
    "key, value",
    [
        ("metric", "loss"),
        ("every", 0),
        ("every", 2.5),
        ("every", True),
        ("percentile", 0.0),
        ("percentile", 100.5),
        ("percentile", NAN),
        ("start_step", -1),
        ("max_fraction", 1.0),
        ("max_fraction", -0.1),
        ("reference_every", 0),
        ("threshold", 0.0),
        ("threshold", math.inf),
        ("patience", 0),
    ],
)
def test_check_settings_names_the_bad_key(key, value):
    with pytest.raises(ValueError, match=rf"freezing\.{key} = "):
        check_settings(**GOOD | {key: value})


def test_check_settings_reports_every_problem():
    with pytest.raises(ValueError, match=r"freezing\.every.*freezing\.max_fraction"):
        check_settings(**GOOD | dict(every=0, max_fraction=2.0))


# Loop-by-loop references (no masks, no np.percentile) for the property tests.


def _percentile(values, q):
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean_in(steps, column, start, stop):
    xs = [x for s, x in zip(steps, column, strict=True) if start <= s < stop and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else NAN


def _grow(ok, prefix, max_layers):
    stop = prefix
    while stop < len(ok) and ok[stop]:
        stop += 1
    return max(prefix, min(stop, max_layers))


def reference_gradient(steps, grads, prefix, every, percentile, start_step, max_layers):
    if steps[-1] < start_step:
        return prefix
    k = (steps[-1] + 1) // every - 1
    if k < 1 or steps[0] > (k - 1) * every:
        return prefix
    changes = []
    for column in grads.T:
        a = _mean_in(steps, column, (k - 1) * every, k * every)
        b = _mean_in(steps, column, k * every, (k + 1) * every)
        changes.append(abs(b - a) / a if a > 0 else NAN)
    finite = [c for c in changes if math.isfinite(c)]
    if not finite:
        return prefix
    cut = _percentile(finite, percentile)
    return _grow([math.isfinite(c) and c < cut for c in changes], prefix, max_layers)


def reference_plasticity(steps, plast, prefix, every, threshold, patience, start_step, max_layers):
    if steps[-1] < start_step:
        return prefix
    newest = (steps[-1] + 1) // every - 1
    if newest + 1 < patience:
        return prefix
    ok = []
    for column in plast.T:
        good = True
        for r in range(newest - patience + 1, newest + 1):
            xs = [x for s, x in zip(steps, column, strict=True) if s // every == r]
            xs = [x for x in xs if math.isfinite(x)]
            good = good and bool(xs) and max(xs) < threshold
        ok.append(good)
    return _grow(ok, prefix, max_layers)


FRACTIONS = st.sampled_from([0.5, 0.75, 0.99, 0.3, 0.0])


@st.composite
def runs(draw):
    """A run: strictly increasing steps from 0 (gaps allowed) and non-negative [T, L] values."""
    layers = draw(st.integers(2, 8))
    gaps = draw(st.lists(st.integers(1, 3), min_size=4, max_size=40))
    steps = np.cumsum([0] + gaps[:-1])
    cell = st.one_of(st.just(0.0), st.floats(0.001, 10.0))
    rows = draw(
        st.lists(
            st.lists(cell, min_size=layers, max_size=layers),
            min_size=len(steps),
            max_size=len(steps),
        )
    )
    return steps, np.array(rows)


def simulate(steps, values, decide, max_layers):
    """Decide after every step on the history so far; frozen layers report NaN from then on."""
    values, prefix = values.copy(), 0
    for t in range(1, len(steps) + 1):
        values[t - 1, :prefix] = NAN
        new = decide(steps[:t], values[:t], prefix)
        assert prefix <= new <= max_layers
        assert decide(steps[:t], values[:t], new) == new  # asking again changes nothing
        yield t, values[:t], prefix, new
        prefix = new


@settings(max_examples=150, deadline=None)
@given(
    run=runs(),
    every=st.integers(1, 6),
    percentile=st.floats(1.0, 100.0),
    max_fraction=FRACTIONS,
    start_step=st.integers(0, 20),
)
def test_gradient_prefix_only_grows_within_its_cap(
    run, every, percentile, max_fraction, start_step
):
    steps, grads = run
    max_layers = max_frozen_layers(grads.shape[1], max_fraction)
    kw = dict(every=every, percentile=percentile, start_step=start_step, max_layers=max_layers)

    def decide(s, g, p):
        return gradient_freeze_prefix(s, g, p, **kw)

    for t, seen, prefix, new in simulate(steps, grads, decide, max_layers):
        assert new == reference_gradient(steps[:t], seen, prefix, **kw)
        if steps[t - 1] < start_step:
            assert new == prefix


@settings(max_examples=150, deadline=None)
@given(
    run=runs(),
    every=st.integers(1, 6),
    threshold=st.floats(0.01, 10.0),
    patience=st.integers(1, 3),
    max_fraction=FRACTIONS,
    start_step=st.integers(0, 20),
)
def test_plasticity_prefix_only_grows_within_its_cap(
    run, every, threshold, patience, max_fraction, start_step
):
    steps, plast = run
    max_layers = max_frozen_layers(plast.shape[1], max_fraction)

    def decide(s, p, prefix):
        return plasticity_freeze_prefix(
            s,
            p,
            prefix,
            reference_every=every,
            threshold=threshold,
            patience=patience,
            start_step=start_step,
            max_layers=max_layers,
        )

    for t, seen, prefix, new in simulate(steps, plast, decide, max_layers):
        expected = reference_plasticity(
            steps[:t], seen, prefix, every, threshold, patience, start_step, max_layers
        )
        assert new == expected
