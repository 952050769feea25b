"""The order in which the host dispatches a schedule's tasks: pure data, no JAX.

A schedule gives each stage an ordered task list (``dynjax.balance.schedule_tasks``). Devices run
what they are sent in the order they are sent it, and a task can only be dispatched once the
arrays it consumes exist (as not-yet-computed futures), so the host merges the per-stage lists
into one global order that respects every dependency: F(s, m) after F(s-1, m), B(s, m) after
B(s+1, m), each stage's own list in order. Every process of a multi-process run walks the same
global order, so the transfers both neighbours take part in are issued in the same order on
both sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# The schedules of `dynjax.balance.SCHEDULES` the pipeline runtime executes: one chunk of layers
# per stage, one backward task. The balancer's simulator also runs interleaved 1F1B and ZB-H1;
# the runtime does not run them yet (docs/parallelism.md, "Schedules").
RUNTIME_SCHEDULES = ("gpipe", "1f1b")


class TaskLike(Protocol):
    kind: str  # "F" or "B"
    microbatch: int


def dispatch_order(tasks: Sequence[Sequence[TaskLike]]) -> tuple[tuple[int, TaskLike], ...]:
    """A global ``(stage, task)`` order: sweep the stages, dispatching each one's ready tasks.

    >>> from collections import namedtuple
    >>> T = namedtuple("T", "kind microbatch")
    >>> one_f_one_b = [[T("F", 0), T("F", 1), T("B", 0), T("B", 1)],  # stage 0
    ...                [T("F", 0), T("B", 0), T("F", 1), T("B", 1)]]  # stage 1
    >>> [f"{s}{t.kind}{t.microbatch}" for s, t in dispatch_order(one_f_one_b)]
    ['0F0', '0F1', '1F0', '1B0', '1F1', '1B1', '0B0', '0B1']
    """
    stages = len(tasks)
    done: set[tuple[str, int, int]] = set()
    nxt, order = [0] * stages, []
    while any(n < len(t) for n, t in zip(nxt, tasks, strict=True)):
        progressed = False
        for s in range(stages):
            while nxt[s] < len(tasks[s]):
                task = tasks[s][nxt[s]]
                if task.kind == "F":
                    needs = ("F", s - 1, task.microbatch) if s > 0 else None
                elif task.kind == "B":
                    needs = ("B", s + 1, task.microbatch) if s < stages - 1 else None
                    if ("F", s, task.microbatch) not in done:
                        raise ValueError(f"stage {s} runs B{task.microbatch} before its forward")
                else:
                    raise ValueError(f"unknown task kind {task.kind!r} on stage {s}")
                if needs is not None and needs not in done:
                    break
                done.add((task.kind, s, task.microbatch))
                order.append((s, task))
                nxt[s] += 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule deadlocks: every stage waits on a task that never runs")
    return tuple(order)
