"""Event-driven simulation of one pipeline iteration.

Wall-clock speedups of a pipeline cannot be measured on a CPU runner (its fake devices share the
same cores), so measured per-stage times go through this simulator instead. Each stage executes its
task list (:mod:`dynjax.balance.schedules`) in order, one task at a time; a forward waits for the
previous stage's forward of that microbatch plus one hop of ``comm``, a backward for the next
stage's backward plus one hop. Transfers are pure delays (no link contention).

Bubble ratio = idle time / (stages x iteration time), seed 003 §A's "ratio of the idle time of
devices". (Eq. 1 there is for the Chimera schedule and is garbled by the PDF conversion; for
GPipe/1F1B with equal stages and no comm the ratio is the classic ``(S-1)/(M+S-1)``.)
"""

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dynjax.balance._checks import as_nonneg, per_stage
from dynjax.balance.schedules import (
    Schedule,
    Task,
    check_schedule,
    peak_in_flight,
    schedule_tasks,
)


@dataclass(frozen=True)
class Event:
    """A task as it ran: ``kind`` ``"F"``/``"B"`` of ``microbatch`` from ``start`` to ``end``."""

    kind: str
    microbatch: int
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """Outcome of one simulated iteration."""

    iteration_time: float  # first task start (0) to last task end
    idle: tuple[float, ...]  # [stages] iteration_time minus the stage's busy time
    timeline: tuple[tuple[Event, ...], ...]  # [stages][tasks], in execution order
    peak_in_flight: tuple[int, ...]  # [stages] most microbatches with stored activations

    @property
    def bubble_ratio(self) -> float:
        """Idle fraction of all stage-time in the iteration."""
        if self.iteration_time == 0.0:
            return 0.0
        return sum(self.idle) / (len(self.idle) * self.iteration_time)


def simulate(
    fwd: Sequence[float] | np.ndarray,
    bwd: Sequence[float] | np.ndarray,
    num_microbatches: int,
    *,
    schedule: str | Schedule = "1f1b",
    comm: float | Sequence[float] = 0.0,
) -> Simulation:
    """Simulate one iteration of ``num_microbatches`` through the stages.

    Args:
      fwd, bwd: per-stage forward / backward time of one microbatch, ``[S]``.
      schedule: ``"gpipe"``, ``"1f1b"`` or explicit per-stage task lists.
      comm: per-hop transfer time, scalar or ``[S-1]`` (one per stage boundary).

    >>> sim = simulate([1.0] * 4, [2.0] * 4, 8, schedule="gpipe")
    >>> sim.iteration_time, round(sim.bubble_ratio, 4)  # (M+S-1)(f+b); (S-1)/(M+S-1) = 3/11
    (33.0, 0.2727)
    """
    f = as_nonneg(fwd, "fwd")
    b = as_nonneg(bwd, "bwd")
    num_stages = f.size
    if b.size != num_stages or num_stages == 0:
        raise ValueError(f"fwd and bwd need one entry per stage, got {f.size} and {b.size}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    hop = per_stage(comm, num_stages - 1, "comm").tolist()
    tasks = (schedule_tasks(schedule, num_stages, num_microbatches)
             if isinstance(schedule, str) else tuple(tuple(t) for t in schedule))
    check_schedule(tasks, num_stages, num_microbatches)
    durations = {"F": f.tolist(), "B": b.tolist()}
    # end[kind][s][m]: finish time of that task, None until it has run
    end = {k: [[None] * num_microbatches for _ in range(num_stages)] for k in "FB"}
    free = [0.0] * num_stages
    nxt = [0] * num_stages
    events: list[list[Event]] = [[] for _ in range(num_stages)]
    # Event loop over stages: a stage runs tasks until one waits on a neighbour; a finished F may
    # unblock the next stage, a finished B the previous one, so only those are revisited.
    waiting = deque(range(num_stages))
    queued = [True] * num_stages
    while waiting:
        s = waiting.popleft()
        queued[s] = False
        while nxt[s] < len(tasks[s]):
            task = tasks[s][nxt[s]]
            ready = _ready(task, s, num_stages, end, hop)
            if ready is None:
                break
            start = max(free[s], ready)
            finish = start + durations[task.kind][s]
            end[task.kind][s][task.microbatch] = finish
            events[s].append(Event(task.kind, task.microbatch, start, finish))
            free[s] = finish
            nxt[s] += 1
            other = s + 1 if task.kind == "F" else s - 1
            if 0 <= other < num_stages and not queued[other]:
                waiting.append(other)
                queued[other] = True
    if any(n < len(t) for n, t in zip(nxt, tasks, strict=True)):
        raise ValueError("schedule deadlocks: every stage waits on a task that never runs")
    total = max(free)
    busy = num_microbatches * (f + b)
    return Simulation(
        iteration_time=total,
        idle=tuple(float(total - x) for x in busy),
        timeline=tuple(tuple(e) for e in events),
        peak_in_flight=tuple(peak_in_flight(t) for t in tasks),
    )


def _ready(
    task: Task, s: int, num_stages: int, end: dict[str, list[list[float | None]]], hop: list[float]
) -> float | None:
    """When the task's input has arrived, or ``None`` if its producer has not run yet."""
    m = task.microbatch
    if task.kind == "F":
        if s == 0:
            return 0.0
        done = end["F"][s - 1][m]
        return None if done is None else done + hop[s - 1]
    if s == num_stages - 1:
        return end["F"][s][m]  # the loss gradient starts where the forward ended
    done = end["B"][s + 1][m]
    return None if done is None else done + hop[s]
