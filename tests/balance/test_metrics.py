"""imbalance, stage_costs, the package surface: no JAX, tested docstring examples."""

import doctest
import importlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynjax.balance import imbalance, stage_costs

from ..helpers import ROOT

MODULES = ["baselines", "diffusion", "metrics", "partition", "repack", "schedules", "simulate"]


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ([1.0, 1.0, 1.0], 0.0),
        ([3.0, 1.0, 2.0], 1.0),  # (3 - 1) / 2
        ([4.0, 0.0], 2.0),  # (4 - 0) / 2
        ([1.25, 1.0, 1.0, 0.75], 0.5),  # DynMo's MoE case: a 25% hot worker
        ([0.0, 0.0], 0.0),
        ([5.0], 0.0),
    ],
)
def test_imbalance_examples(loads, expected):
    assert imbalance(loads) == pytest.approx(expected)


@given(st.lists(st.floats(0.001, 1e6), min_size=1, max_size=20), st.floats(0.001, 1e3))
def test_imbalance_is_scale_free_and_bounded(loads, scale):
    value = imbalance(loads)
    assert value == pytest.approx(imbalance([x * scale for x in loads]), rel=1e-9, abs=1e-12)
    assert 0.0 <= value <= len(loads) + 1e-9  # (max - min) / mean <= max / (max / n)


def test_imbalance_rejects_bad_loads():
    for bad in ([], [1.0, -1.0], [1.0, float("inf")]):
        with pytest.raises(ValueError):
            imbalance(bad)


def test_stage_costs_add_the_outgoing_hop():
    costs = [1.0, 2.0, 3.0, 4.0]
    assert stage_costs(costs, (1, 2, 1)).tolist() == [1.0, 5.0, 4.0]
    assert stage_costs(costs, (1, 2, 1), comm=0.5).tolist() == [1.5, 5.5, 4.0]
    assert stage_costs(costs, (1, 2, 1), comm=[1.0, 2.0]).tolist() == [2.0, 7.0, 4.0]
    with pytest.raises(ValueError):
        stage_costs(costs, (2, 1))
    with pytest.raises(ValueError):
        stage_costs(costs, (1, 2, 1), comm=[1.0])
    assert np.array_equal(stage_costs(costs, (4,), comm=9.0), [10.0])


def test_importing_balance_does_not_import_jax():
    code = "import sys, dynjax.balance; assert 'jax' not in sys.modules, 'jax was imported'"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(f"dynjax.balance.{name}")
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
