"""Event-driven simulation of one pipeline iteration.

Wall-clock speedups of a pipeline cannot be measured on a CPU runner (its fake devices share the
same cores), so measured per-stage times go through this simulator instead. Each stage executes its
task list (:mod:`dynjax.balance.schedules`) in order, one task at a time; a forward waits for the
previous logical stage's forward of that microbatch plus one hop of ``comm``, a backward for the
next one's backward plus one hop, a weight-gradient pass (``W``) for its own stage's ``B``.
Transfers are pure delays (no link contention).

Bubble ratio = idle time / (stages x iteration time), seed 003 §A's "ratio of the idle time of
devices". (Eq. 1 there is for the Chimera schedule and is garbled by the PDF conversion; for
GPipe/1F1B with equal stages and no comm the ratio is the classic ``(S-1)/(M+S-1)``; interleaving
``v`` chunks divides the idle time by ``v``; ZB-H1 idles ``(S-1)(F+B-W)`` per stage.)
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
    has_split_backward,
    logical_stage,
    peak_in_flight,
    schedule_tasks,
)


@dataclass(frozen=True)
class Event:
    """A task as it ran: ``kind`` ``"F"``/``"B"``/``"W"`` of ``microbatch`` on ``chunk`` of its
    device from ``start`` to ``end``."""

    kind: str
    microbatch: int
    start: float
    end: float
    chunk: int = 0


@dataclass(frozen=True)
class Simulation:
    """Outcome of one simulated iteration."""

    iteration_time: float  # first task start (0) to last task end
    idle: tuple[float, ...]  # [devices] iteration_time minus the device's busy time
    timeline: tuple[tuple[Event, ...], ...]  # [devices][tasks], in execution order
    peak_in_flight: tuple[int, ...]  # [devices] most microbatches with stored activations

    @property
    def bubble_ratio(self) -> float:
        """Idle fraction of all device-time in the iteration."""
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
    virtual_stages: int = 1,
    weight_grad: Sequence[float] | np.ndarray | None = None,
) -> Simulation:
    """Simulate one iteration of ``num_microbatches`` through the stages.

    Args:
      fwd, bwd: per logical stage forward / backward time of one microbatch, ``[S * v]`` in
        model order (``[S]`` without interleaving).
      schedule: a name of `SCHEDULES` or explicit per-device task lists.
      comm: per-hop transfer time, scalar or ``[S * v - 1]`` (one per logical stage boundary).
      virtual_stages: ``v``, the chunks each device holds (``interleaved_1f1b``).
      weight_grad: where the schedule splits the backward, the part of ``bwd`` that is ``W``
        ``[S * v]``; default half of it (a matmul's backward is one matmul for the input
        gradient and one for the weights).

    >>> sim = simulate([1.0] * 4, [2.0] * 4, 8, schedule="gpipe")
    >>> sim.iteration_time, round(sim.bubble_ratio, 4)  # (M+S-1)(f+b); (S-1)/(M+S-1) = 3/11
    (33.0, 0.2727)
    >>> simulate([1.0] * 4, [2.0] * 4, 8, schedule="zb_h1").iteration_time  # 8*3 + 3*(1+1-1)
    27.0
    """
    f = as_nonneg(fwd, "fwd")
    b = as_nonneg(bwd, "bwd")
    v = virtual_stages
    if v < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {v}")
    if b.size != f.size or f.size == 0 or f.size % v:
        raise ValueError(
            f"fwd and bwd need one entry per logical stage (a multiple of virtual_stages={v}), "
            f"got {f.size} and {b.size}"
        )
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    logical, devices = f.size, f.size // v
    hop = per_stage(comm, logical - 1, "comm").tolist()
    tasks = (schedule_tasks(schedule, devices, num_microbatches, v)
             if isinstance(schedule, str) else tuple(tuple(t) for t in schedule))
    check_schedule(tasks, devices, num_microbatches, v)
    w = b / 2 if weight_grad is None else as_nonneg(weight_grad, "weight_grad")
    if w.size != logical or np.any(w > b):
        raise ValueError("weight_grad needs one entry per logical stage, each at most its bwd")
    split = has_split_backward(tasks)
    durations = {"F": f.tolist(), "B": (b - w if split else b).tolist(), "W": w.tolist()}
    # end[kind][logical stage][m]: finish time of that task, None until it has run
    end = {k: [[None] * num_microbatches for _ in range(logical)] for k in "FBW"}
    free = [0.0] * devices
    nxt = [0] * devices
    events: list[list[Event]] = [[] for _ in range(devices)]
    # Event loop over devices: a device runs tasks until one waits on a neighbour; a finished F
    # may unblock the next device, a finished B the previous one, so only those are revisited.
    waiting = deque(range(devices))
    queued = [True] * devices
    while waiting:
        d = waiting.popleft()
        queued[d] = False
        while nxt[d] < len(tasks[d]):
            task = tasks[d][nxt[d]]
            j = logical_stage(d, task.chunk, devices)
            ready = _ready(task, j, end, hop)
            if ready is None:
                break
            start = max(free[d], ready)
            finish = start + durations[task.kind][j]
            end[task.kind][j][task.microbatch] = finish
            events[d].append(Event(task.kind, task.microbatch, start, finish, task.chunk))
            free[d] = finish
            nxt[d] += 1
            for other in ((d + 1) % devices, (d - 1) % devices):
                if not queued[other]:
                    waiting.append(other)
                    queued[other] = True
    if any(n < len(t) for n, t in zip(nxt, tasks, strict=True)):
        raise ValueError("schedule deadlocks: every stage waits on a task that never runs")
    total = max(free)
    busy = num_microbatches * (f + b).reshape(v, devices).sum(axis=0)
    return Simulation(
        iteration_time=total,
        idle=tuple(float(total - x) for x in busy),
        timeline=tuple(tuple(e) for e in events),
        peak_in_flight=tuple(peak_in_flight(t) for t in tasks),
    )


def _ready(
    task: Task, j: int, end: dict[str, list[list[float | None]]], hop: list[float]
) -> float | None:
    """When the input of ``task`` on logical stage ``j`` has arrived, or ``None`` if its
    producer has not run yet."""
    m, last = task.microbatch, len(end["F"]) - 1
    if task.kind == "W":
        return end["B"][j][m]
    if task.kind == "F":
        if j == 0:
            return 0.0
        done = end["F"][j - 1][m]
        return None if done is None else done + hop[j - 1]
    if j == last:
        return end["F"][j][m]  # the loss gradient starts where the forward ended
    done = end["B"][j + 1][m]
    return None if done is None else done + hop[j]
