"""Errors every layer raises: a leaf module, so the config, the data and the plugins can share
them without importing each other (docs/architecture.md "The layers of the house": no circle)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config key, value or combination of values that cannot run; the message says the fix."""


def at_least(values: dict[str, float], least: float, note: str = "") -> None:
    """Raise for the first key whose value is below ``least``; ``note`` says what it means."""
    for key, value in values.items():
        if value < least:
            raise ConfigError(f"{key}={value} must be >= {least}{note}")
