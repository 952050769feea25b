"""Test session set-up: 8 fake CPU devices (a parallel test needs no GPU) and shared fixtures.

Layout: ``tests/<package>/`` tests ``dynjax/<package>/`` (and ``pallas_kernels/``); the tests of
dynjax's top-level modules (config, data, train, resume, optim, flops, jax_private), notebooks
and benchmarks stay at this root, which mirrors dynjax's own top level (an ``edge/`` folder would
name no package). Helpers that test modules share are in ``helpers.py``, the tiny run in
``tiny.py``, the scripts tests start as subprocesses in ``scripts/``, pinned data in ``data/``.
"""

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests' models are tiny: compiling is most of their time, and running them takes little of
# it. So XLA:CPU compiles them without LLVM's optimizations (the README command took 444 s
# instead of 743 s on 2 cores). Set in the environment, so the processes that the multi-process
# tests start compile the same way.
_TEST_XLA_FLAGS = {
    "xla_force_host_platform_device_count": "8",
    "xla_backend_optimization_level": "0",
    "xla_llvm_disable_expensive_passes": "true",
}
for _flag, _value in _TEST_XLA_FLAGS.items():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_flag}={_value}".strip()

import pytest  # noqa: E402

from .tiny import tiny_config  # noqa: E402

# CI's time budget (.ci/run): a test that would start after this wall-clock time (seconds since
# the epoch) is skipped, and says so in the summary, so that a slow day ends the stage with its
# results and the names of the tests it did not reach rather than a CI killed mid-run. Unset, as
# on a developer's machine, every test runs.
DEADLINE_VARIABLE = "DYNJAX_TEST_DEADLINE"
DEADLINE_REASON = "CI's time budget is spent ({variable}): {test} not run this time"


def deadline_passed(value: str | None, now: float) -> bool:
    """Whether `value` (the variable's text, or None when unset) names a time before `now`."""
    if not value:
        return False
    try:
        return now > float(value)
    except ValueError:
        raise pytest.UsageError(
            f"error: {DEADLINE_VARIABLE}={value!r} is not a time in seconds since the epoch; "
            f"unset it to run every test"
        ) from None


def pytest_configure(config):
    deadline_passed(os.environ.get(DEADLINE_VARIABLE), time.time())  # a bad value fails at once


def pytest_runtest_setup(item):
    if deadline_passed(os.environ.get(DEADLINE_VARIABLE), time.time()):
        pytest.skip(DEADLINE_REASON.format(variable=DEADLINE_VARIABLE, test=item.nodeid))


@pytest.fixture
def tiny():
    return tiny_config


@pytest.fixture
def without_pallas_triton(monkeypatch):
    """This jax as a later one whose Pallas Triton lowering is gone: where jax registers the
    backend's deprecation (0.11+) it is accelerated into the error a later jax raises; an older
    jax is told the lowering is missing."""
    from jax_private import deprecation_accelerated
    from pallas_kernels import backend

    usable = backend.pallas_triton_usable
    usable.cache_clear()
    backend._warn_xla_once.cache_clear()
    with deprecation_accelerated(backend._DEPRECATION) as registered:
        if not registered:
            monkeypatch.setattr(backend, "pallas_triton_usable", lambda: False)
        yield
    usable.cache_clear()
