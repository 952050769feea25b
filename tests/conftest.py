"""Test session set-up: 8 fake CPU devices (DESIGN.md "Testing without GPUs") and shared helpers."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import pytest  # noqa: E402

from .tiny import tiny_config  # noqa: E402


@pytest.fixture
def tiny():
    return tiny_config


@pytest.fixture
def without_pallas_triton(monkeypatch):
    """This jax as a later one whose Pallas Triton lowering is gone: where jax registers the
    backend's deprecation (0.11+) it is accelerated into the error a later jax raises; an older
    jax is told the lowering is missing."""
    from jax._src import deprecations

    from pallas_kernels import backend

    usable = backend.pallas_triton_usable
    usable.cache_clear()
    backend._warn_xla_once.cache_clear()
    state = deprecations._registered_deprecations.get(backend._DEPRECATION)
    if state is not None:
        monkeypatch.setattr(state, "accelerated", True)
    else:
        monkeypatch.setattr(backend, "pallas_triton_usable", lambda: False)
    yield
    usable.cache_clear()
