"""The order in which the host dispatches a schedule's tasks and transfers: pure data, no JAX.

A schedule gives each device (a stage's sub-mesh) an ordered task list
(``dynjax.balance.schedule_tasks``); a task on chunk ``c`` of device ``d`` runs logical stage
``c * D + d`` of ``D`` devices (`logical_stage`: one chunk per device, the logical stage is the
device, unless the schedule interleaves). Devices run what they are sent in the order they are
sent it, and a task can only be dispatched once the arrays it consumes exist (as
not-yet-computed futures), so the host merges the per-device lists into one global order that
respects every dependency: F(s, m) after F(s-1, m), B(s, m) after B(s+1, m) of logical stages,
each device's own list in order. An entry is ``(logical stage, task, action)``: ``"run"``
dispatches the task's program, ``"send"`` moves what it produced to the neighbour stage.

Two orders, for two runtimes:

* `dispatch_order` (one process owns every stage): sweep the stages, dispatching each one's
  ready tasks, each send right after its task. Every stage has devices of its own and a copy
  only waits for its source, so the order only decides how many copies go in one call.
* `overlapped_order` (several processes, docs/parallelism.md "Several processes"): a transfer
  between processes is a collective both neighbours take part in, which holds each one's device
  queue until the other arrives, and every process must issue them in the same order. A sweep
  order makes a stage wait at a transfer it does not need yet (stage 0 of 1F1B would receive
  B1's gradient before running B0), which serialises the stages. This order is the timeline of
  a simulated step (forward 1, backward 2, the last stage's fused forward and backward 3): each
  task at its start, each send at its task's end, so a process meets each transfer about when
  the data is needed and the stages overlap as the schedule intends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from dynjax.balance.schedules import logical_stage

Action = Literal["run", "send"]


class TaskLike(Protocol):
    kind: str  # "F", "B" or, where the schedule splits the backward, "W"
    microbatch: int
    chunk: int  # which of its device's chunks of layers (0 without interleaving)


Order = tuple[tuple[int, TaskLike, Action], ...]


def _lanes(tasks: Sequence[Sequence[TaskLike]]) -> tuple[int, int]:
    """(devices, logical stages) of per-device task lists."""
    chunks = 1 + max((t.chunk for lane in tasks for t in lane), default=0)
    return len(tasks), len(tasks) * chunks


def _needs(s: int, task: TaskLike, stages: int) -> tuple[str, int, int] | None:
    """The task (kind, stage, microbatch) whose output ``task`` on stage ``s`` consumes."""
    if task.kind == "F":
        return ("F", s - 1, task.microbatch) if s > 0 else None
    if task.kind == "B":
        return ("B", s + 1, task.microbatch) if s < stages - 1 else None
    if task.kind == "W":  # its own stage's B, earlier in the same list (`_check_own_forward`)
        return None
    raise ValueError(f"unknown task kind {task.kind!r} on stage {s}")


def _sends(s: int, task: TaskLike, stages: int) -> bool:
    """Whether ``task`` produces something a neighbour consumes (the last stage's forward runs
    inside its backward; the first stage's backward sends nothing)."""
    return s < stages - 1 if task.kind == "F" else s > 0 and task.kind == "B"


def dispatch_order(tasks: Sequence[Sequence[TaskLike]]) -> Order:
    """A global order for one process: sweep the devices, dispatching each one's ready tasks.

    >>> from collections import namedtuple
    >>> T = namedtuple("T", "kind microbatch chunk", defaults=(0,))
    >>> one_f_one_b = [[T("F", 0), T("F", 1), T("B", 0), T("B", 1)],  # stage 0
    ...                [T("F", 0), T("B", 0), T("F", 1), T("B", 1)]]  # stage 1
    >>> [f"{s}{t.kind}{t.microbatch}" for s, t, a in dispatch_order(one_f_one_b) if a == "run"]
    ['0F0', '0F1', '1F0', '1B0', '1F1', '1B1', '0B0', '0B1']
    """
    devices, stages = _lanes(tasks)
    done: set[tuple[str, int, int]] = set()
    nxt, order = [0] * devices, []
    while any(n < len(t) for n, t in zip(nxt, tasks, strict=True)):
        progressed = False
        for d in range(devices):
            while nxt[d] < len(tasks[d]):
                task = tasks[d][nxt[d]]
                s = logical_stage(d, task.chunk, devices)
                _check_own_forward(s, task, done)
                needs = _needs(s, task, stages)
                if needs is not None and needs not in done:
                    break
                done.add((task.kind, s, task.microbatch))
                order.append((s, task, "run"))
                if _sends(s, task, stages):
                    order.append((s, task, "send"))
                nxt[d] += 1
                progressed = True
        if not progressed:
            raise _deadlock()
    return tuple(order)


# Simulated task lengths of `overlapped_order` (task kind, last stage, split backward): the
# last stage's backward holds its forward (its forward task is empty); a split backward is
# half B, half W.
_LENGTHS = {
    ("F", False, False): 1.0, ("B", False, False): 2.0,
    ("F", True, False): 0.0, ("B", True, False): 3.0,
    ("F", False, True): 1.0, ("B", False, True): 1.0, ("W", False, True): 1.0,
    ("F", True, True): 0.0, ("B", True, True): 2.0, ("W", True, True): 1.0,
}


def overlapped_order(tasks: Sequence[Sequence[TaskLike]]) -> Order:
    """A global order for several processes: the entries of a simulated step by time.

    >>> from collections import namedtuple
    >>> T = namedtuple("T", "kind microbatch chunk", defaults=(0,))
    >>> one_f_one_b = [[T("F", 0), T("F", 1), T("B", 0), T("B", 1)],  # stage 0
    ...                [T("F", 0), T("B", 0), T("F", 1), T("B", 1)]]  # stage 1
    >>> order = overlapped_order(one_f_one_b)
    >>> [f"{s}{t.kind}{t.microbatch}" + ("" if a == "run" else ">") for s, t, a in order]
    ['0F0', '0F0>', '0F1', '1F0', '1B0', '0F1>', '1B0>', '0B0', '1F1', '1B1', '1B1>', '0B1']

    Stage 1 runs its first microbatch before it takes the second from stage 0, and stage 0
    takes B0's gradient before B1's, so neither waits on a transfer it does not need yet.
    """
    devices, stages = _lanes(tasks)
    split = any(t.kind == "W" for lane in tasks for t in lane)
    finish: dict[tuple[str, int, int], float] = {}
    free, nxt = [0.0] * devices, [0] * devices
    events: list[tuple[float, int, int, int, int, TaskLike, Action]] = []
    while any(n < len(t) for n, t in zip(nxt, tasks, strict=True)):
        ready = []
        for d in range(devices):
            if nxt[d] == len(tasks[d]):
                continue
            task = tasks[d][nxt[d]]
            s = logical_stage(d, task.chunk, devices)
            _check_own_forward(s, task, finish)
            needs = _needs(s, task, stages)
            if needs is None or needs in finish:
                ready.append((max(free[d], finish.get(needs, 0.0)), d, s, task))
        if not ready:
            raise _deadlock()
        start, d, s, task = min(ready, key=lambda r: (r[0], r[1]))
        length = _LENGTHS[task.kind, s == stages - 1, split]
        end = free[d] = finish[task.kind, s, task.microbatch] = start + length
        events.append((start, 1, d, nxt[d], s, task, "run"))
        if _sends(s, task, stages):  # at the same time, a send goes before what it feeds
            events.append((end, 0, d, nxt[d], s, task, "send"))
        nxt[d] += 1
    # by (time, send before run, device, its list's index): a send goes before what it feeds
    events.sort(key=lambda e: e[:4])
    return tuple((s, task, action) for *_, s, task, action in events)


def _check_own_forward(s: int, task: TaskLike, done) -> None:
    before = {"B": "F", "W": "B"}.get(task.kind)
    if before and (before, s, task.microbatch) not in done:
        raise ValueError(f"stage {s} runs {task.kind}{task.microbatch} before its {before}")


def _deadlock() -> ValueError:
    return ValueError("the schedule deadlocks: every stage waits on a task that never runs")
