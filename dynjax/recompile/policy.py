"""The policy interface: what a policy reads (History), what it returns (Plan or Proposal).

A policy is the "recompile trigger" of seed 001 §3: a user-provided decision on model metrics.
Like optax's transformations (STYLE.md habit 1) it is a pure function of its inputs and its own
parameters: `propose(history, plan)` does no I/O and no device calls, so it can be unit-tested
with plain NumPy and run on the controller's host thread while training continues.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dynjax.recompile.plan import Plan

Metrics = dict[str, Any]  # host metrics of one step: name -> np.ndarray or Python scalar


@dataclass(frozen=True)
class History:
    """An immutable snapshot of the newest observed `(step, metrics)` entries, oldest first."""

    entries: tuple[tuple[int, Metrics], ...] = ()

    @classmethod
    def of(cls, entries: Iterable[tuple[int, Metrics]]) -> History:
        return cls(tuple(entries))

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def latest_step(self) -> int | None:
        return self.entries[-1][0] if self.entries else None

    def window(self, n: int, key: str | None = None) -> Sequence[tuple[int, Metrics]]:
        """The newest `n` entries (those that have `key`, if given), oldest first."""
        entries = self.entries if key is None else [e for e in self.entries if key in e[1]]
        return entries[-n:] if n > 0 else ()

    def values(self, key: str, n: int) -> list[Any]:
        """The values of metric `key` in the newest `n` entries that have it, oldest first."""
        return [m[key] for _, m in self.window(n, key)]

    def finite(self, key: str, n: int) -> list[float]:
        """Like `values` for a scalar metric, skipping NaN (steps where it was not measured)."""
        return [x for x in map(float, self.values(key, n)) if not math.isnan(x)]


@dataclass(frozen=True)
class Proposal:
    """A proposed Plan and why; events record `"<policy name>: <reason>"`.

    `records` are decision records the Controller writes to events.jsonl as they are, plus the
    round's `step`, `metrics_step` and `policy` (each needs an `"event"` name). A policy that
    decides to keep the Plan returns the unchanged Plan with its records: they are emitted and
    nothing is compiled.
    """

    plan: Plan
    reason: str = ""
    records: tuple[dict[str, Any], ...] = ()


class Policy(Protocol):
    """A recompile trigger. `name` identifies it in events.

    `propose(history, plan)` returns the Plan it wants (or a `Proposal` with a reason), or None
    to keep `plan`. It must be pure: no I/O, no device calls, no hidden state that changes what
    it proposes for the same inputs, except a record of its own past decisions (`Periodic`):
    the history does not say which steps earlier rounds saw, so "decided already this period"
    cannot be read from the inputs.
    """

    name: str

    def propose(self, history: History, plan: Plan) -> Plan | Proposal | None: ...


@dataclass
class Periodic:
    """When a decision taken once every `every` metrics steps is due (`every` = 0: never).

    Due in the first round whose newest metrics step lies in a period (``step // every``) not
    decided in yet. Testing ``step % every == 0`` instead misses its turn whenever the multiple
    is not the newest step of a round: the Controller observes metrics in batches and runs no
    round while a compile is pending, so the decision would wait a whole interval more.
    """

    every: int
    decided: int = -1  # the period of the last decision; -1: none yet, so period 0 is due

    def due(self, step: int) -> bool:
        return self.every > 0 and step // self.every > self.decided

    def decide(self, step: int) -> None:
        """Record a decision taken on metrics up to ``step``: the next is due a period on."""
        self.decided = step // self.every


def as_proposal(policy: Policy, result: Plan | Proposal | None) -> Proposal | None:
    """Normalise a policy's answer: a bare Plan is a Proposal with no reason given."""
    if result is None or isinstance(result, Proposal):
        return result
    if isinstance(result, Plan):
        return Proposal(result, "")
    raise TypeError(f"policy {policy.name!r} returned {type(result).__name__}, not a Plan")
