"""Plan swaps that every process of a multi-process run makes at the same step (issue 15 §4).

The processes of a run execute the same programs: one SPMD program over all their devices, or
pipeline stages whose transfers both neighbours join. A process that swapped in a new program
alone would wait forever in a collective the others never enter. So one process decides (the
leader, process 0, runs the policies: seed 001 §3's trigger, once per run), its decision travels
to the others, each compiles it on its own Controller thread while training goes on, and at every
step boundary each process publishes one small `Status` through the coordinator's key-value store
(host to host: it never waits for queued device work). At boundary s every process reads the
statuses of boundary s - lag, and from the same statuses derives the same `Verdict`: the Plan to
compile, swap now (every process held the executable at s - lag, so it does at s), or drop the
Plan (a process failed to build it). The lag lets a process run ahead of a slower one by as many
steps as metrics arrive late (`Monitor`), so that when a peer dies, the survivors still log the
steps it finished. One process decides, all swap at the same step boundary (docs/parallelism.md,
"Plans over processes").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dynjax.recompile.plan import Plan

LEADER = 0  # the process whose policies decide


@dataclass(frozen=True)
class Announcement:
    """A Plan the leader's policies accepted, numbered in the order the leader announced them."""

    number: int
    plan: Plan
    step: int  # training step when proposed
    metrics_step: int | None
    reason: str
    policy: str


@dataclass(frozen=True)
class Status:
    """What one process says at a step boundary."""

    announce: Announcement | None = None  # the leader's new Plan, once
    ready: int | None = None  # the number of the Plan whose executable this process holds
    failed: tuple[int, str] | None = None  # the number and error of a Plan it could not build
    stop: str | None = None  # the signal that asked this process to stop (`StopRequest`)


@dataclass(frozen=True)
class Verdict:
    """What every process does at a boundary: the same on all, derived from the same statuses."""

    announced: Announcement | None = None  # compile this Plan (the leader already does)
    swap: int | None = None  # swap to the Plan of this number now
    failed: tuple[int, int, str] | None = None  # drop the Plan: (number, process, its error)
    stop: str | None = None  # stop now, saving: the signal a process got (the first's)


def verdict(statuses: Sequence[Status]) -> Verdict:
    """The boundary's verdict from every process's status, in process order.

    A Plan swaps in only when every process reports it ready, and is dropped everywhere as soon
    as one process reports that it could not build it; a failure wins over readiness. A stop
    that any process asked for holds for all: they stop at the same boundary.
    """
    announced = statuses[LEADER].announce
    stop = next((status.stop for status in statuses if status.stop is not None), None)
    for process, status in enumerate(statuses):
        if status.failed is not None:
            number, error = status.failed
            return Verdict(announced, failed=(number, process, error), stop=stop)
    ready = {status.ready for status in statuses}
    swap = ready.pop() if len(ready) == 1 else None
    return Verdict(announced, swap=swap, stop=stop)
