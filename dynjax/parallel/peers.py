"""The processes of a multi-process run, as the runtime and the Controller exchange small host
values with them (`dynjax.launch.distributed.Peers` over the coordinator's key-value store;
tests use threads)."""

from __future__ import annotations

from typing import Any, Protocol


class Peers(Protocol):
    """The run's processes: this one's index, their count and a host key-value exchange."""

    index: int  # this process's
    count: int

    def publish(self, key: str, value: Any) -> None:
        """Store this process's ``value`` for ``key`` (a name every process uses once)."""
        ...

    def collect(self, key: str) -> list[Any]:
        """Every process's value for ``key``, by process index; blocks until all published."""
        ...

    def forget(self, key: str) -> None:
        """Delete this process's value of a key that every process has collected."""
        ...
