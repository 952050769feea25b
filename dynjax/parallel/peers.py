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


class Rounds:
    """Numbered all-gathers of one name over `Peers` (``None``: this process alone): each
    `all` publishes under a fresh key ``name/<n>``, collects every process's value and forgets
    ``name/<n-1>``, which every process read before publishing ``n``. Every process must make
    the same sequence of calls."""

    def __init__(self, peers: Peers | None, name: str) -> None:
        self.peers, self.name, self.rounds = peers, name, 0

    @property
    def index(self) -> int:
        """This process's place in `all`'s lists."""
        return 0 if self.peers is None else self.peers.index

    @property
    def count(self) -> int:
        return 1 if self.peers is None else self.peers.count

    def all(self, value: Any) -> list[Any]:
        """Every process's ``value`` of this round, by process index."""
        if self.peers is None or self.peers.count == 1:
            return [value]
        key = f"{self.name}/{self.rounds}"
        self.peers.publish(key, value)
        values = self.peers.collect(key)
        if self.rounds:
            self.peers.forget(f"{self.name}/{self.rounds - 1}")
        self.rounds += 1
        return values

    def first(self, value: Any) -> Any:
        """Process 0's ``value`` of this round (every process takes the same answer)."""
        return self.all(value)[0]


ALONE = Rounds(None, "alone")  # this process by itself: `Rounds.all` returns ``[value]``
