"""CI's time budget (`DYNJAX_TEST_DEADLINE`, conftest.py): tests past it are skipped by name,
tests before it run, and a value that is not a time stops pytest with an error naming it."""

import os
import subprocess
import sys

import pytest

from .conftest import DEADLINE_VARIABLE, deadline_passed
from .helpers import ROOT

# This file's own plain test, run in a pytest subprocess under a given deadline.
TARGET = "tests/test_ci_deadline.py::test_the_deadline_compares_wall_clock_seconds"


def test_the_deadline_compares_wall_clock_seconds():
    assert not deadline_passed(None, 100.0)
    assert not deadline_passed("", 100.0)
    assert not deadline_passed("150", 100.0)
    assert deadline_passed("50.5", 100.0)


def test_a_value_that_is_not_a_time_is_an_error_naming_the_variable():
    with pytest.raises(pytest.UsageError, match=f"error: {DEADLINE_VARIABLE}='soon'"):
        deadline_passed("soon", 100.0)


def _pytest_with_deadline(value: str) -> subprocess.CompletedProcess:
    env = {**os.environ, DEADLINE_VARIABLE: value}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", TARGET],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_test_past_the_deadline_is_skipped_with_the_reason_and_one_before_it_runs():
    past = _pytest_with_deadline("1")
    assert past.returncode == 0, past.stdout + past.stderr
    assert "1 skipped" in past.stdout, past.stdout
    assert f"spent ({DEADLINE_VARIABLE}): {TARGET} not run" in past.stdout, past.stdout
    future = _pytest_with_deadline("4102444800")  # 2100-01-01
    assert future.returncode == 0, future.stdout + future.stderr
    assert "1 passed" in future.stdout, future.stdout


def test_a_bad_deadline_stops_pytest_before_any_test():
    bad = _pytest_with_deadline("tomorrow")
    assert bad.returncode != 0
    assert f"{DEADLINE_VARIABLE}='tomorrow'" in bad.stdout + bad.stderr
    assert "passed" not in bad.stdout
