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
