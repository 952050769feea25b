"""Timed pipeline steps: each stage's timeline of tasks, taken by one watcher thread per stage.

The tasks are dispatched exactly as an untimed step dispatches them (`StepRunner`), so timing
costs the step none of its overlap (seed 000 §3.3.1); the watchers note when each task's
results are ready, and `PendingTimeline.result` turns that into `TaskTime`s.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from dynjax.parallel.executable import PipelineExecutable
from dynjax.parallel.profile import TaskTime
from dynjax.parallel.step_inputs import BatchInputs
from dynjax.parallel.step_run import Run, StepRunner, present

_MARK = jax.jit(lambda leaf: leaf.reshape(-1)[0] * 0)  # `TimedSteps._ready_marks`: one program
_READY = "ready"  # `TimedSteps.start`'s watchers: not a task, the stage's state arriving
_TRANSFER = "transfer"  # nor this: a transfer across processes holding the stage's device
_BEGIN, _END = object(), object()  # a watcher's markers of a timed step's first and last items
WATCHER = "dynjax-watch-stage-"  # a watcher thread's name, before its stage's index
# What a watcher notes of one task: (task, its dispatch, its input's arrival, its results' being
# ready, whether the watcher saw them become ready), times from `time.perf_counter`.
Seen = tuple[Any, float, float, float, bool]


def _watch(tasks: queue.SimpleQueue) -> None:
    """One stage's watcher (`TimedSteps.start`), for the pipeline's life: for each
    (task, its dispatch, what it waits for from before the step, what it computed) of a step,
    in order, notes in the step's records when the former arrived (-inf: nothing to wait for),
    when the results are ready and whether it saw them become ready (False: they already were
    when it looked, so their time is only an upper bound). A step's items come between
    (`_BEGIN`, its records, its errors) and (`_END`, the event to set once they are noted)."""
    seen: list[Seen] = []
    errors: list[BaseException] = []
    while (item := tasks.get()) is not None:
        task, dispatched, needs, computed = item
        if task is _BEGIN:
            seen, errors = dispatched, needs
            continue
        if task is _END:
            dispatched.set()
            continue
        if errors:
            continue  # drain: the step failed
        try:
            arrived = -math.inf
            if needs:
                jax.block_until_ready(needs)
                arrived = time.perf_counter()
            waited = not all(leaf.is_ready() for leaf in jax.tree.leaves(computed))
            jax.block_until_ready(computed)
            end = time.perf_counter() if computed else dispatched
        except BaseException as e:  # re-raised by `PendingTimeline.result`
            errors.append(e)
            continue
        seen.append((task, dispatched, arrived, end, waited))


def _stop_watchers(watchers: dict[int, queue.SimpleQueue]) -> None:
    """End a discarded pipeline's watcher threads (after the items already queued)."""
    for tasks in watchers.values():
        tasks.put(None)


class PendingTimeline:
    """The timeline of a dispatched step, which its stages' watcher threads are still taking."""

    def __init__(
        self, done: list[threading.Event], seen: dict[int, list[Seen]],
        errors: list[BaseException], start: float,
    ) -> None:
        self._done, self._seen, self._errors, self._start = done, seen, errors, start

    def result(self) -> dict[int, tuple[TaskTime, ...]]:
        """The `TaskTime`s of each of this process's stages; waits for the step's tasks."""
        for event in self._done:
            event.wait()
        if self._errors:
            raise self._errors[0]
        return _timeline(self._seen, self._start)

    def watched(self) -> set[int]:
        """The stages whose timeline measured something: their watcher saw at least one task's
        results become ready. A watcher that a loaded CPU wakes only after its stage's tasks
        all ended notes them all ending then, a timeline near zero that says nothing of the
        stage's speed. Call after `result`."""
        return {s for s, row in self._seen.items() if any(entry[4] for entry in row)}


def _timeline(seen: Mapping[int, list[Seen]], start: float) -> dict[int, tuple[TaskTime, ...]]:
    """Each watched stage's `TaskTime`s from what `TimedSteps.start`'s watchers saw:
    (task, its dispatch, -inf, its results ready) per task, in order; a `_READY` entry first,
    whose arrival is when the stage's state from before the step is, and a `_TRANSFER` entry
    after each transfer across processes the stage's device took part in: the device's next
    task starts after it (its wait for the other process is idle time). A task starts after the
    task that computed its input ended, where a watcher of this process saw that one end (on
    the neighbour stage) no later than this task's own end: a later note is that watcher's late
    wake-up (a task cannot end before its input exists), which would cut this task to nothing,
    and is left out."""
    ends = {(task.kind, s, task.microbatch): end
            for s, row in seen.items() for task, _, _, end, _ in row
            if task not in (_READY, _TRANSFER)}
    out = {}
    for s, row in seen.items():
        times, free, held = [], start, start
        for task, dispatched, arrived, end, waited in row:
            if task == _READY:  # the stage idles until what it needs from before the step is in
                free = max(free, arrived)
                continue
            if task == _TRANSFER:  # the device waits for the other process, idle, until then
                held = max(held, end) if waited else held  # else: done before its task's end
                continue
            m = task.microbatch
            # W reads its own stage's B, which ended before it on the same device
            source = {"F": ("F", s - 1, m), "B": ("B", s + 1, m)}.get(task.kind)
            computed = ends.get(source, start)
            begin = max(dispatched, free, arrived, computed if computed <= end else start,
                        held if held <= end else start)
            free = max(end, begin)
            times.append(TaskTime(task.kind, m, begin - start, free - start))
        out[s] = tuple(times)
    return out


class TimedSteps:
    """Steps of a `StepRunner` with their timelines, and the watcher threads that take them."""

    def __init__(self, runner: StepRunner) -> None:
        self.runner = runner
        self.stages = runner.stages
        # One watcher thread per stage, kept across timed steps (`start`): starting threads
        # every step cost more CPU than the step's waits.
        self._watchers: dict[int, queue.SimpleQueue] = {}
        weakref.finalize(self, _stop_watchers, self._watchers)  # they end with the pipeline

    def start(
        self,
        exe: PipelineExecutable,
        inputs: np.ndarray,
        targets: np.ndarray,
        batch_in: BatchInputs | None,
        rows: np.ndarray | None,
    ) -> tuple[dict[str, Any], PendingTimeline]:
        """`Pipeline.step`, timed: returns once the step is dispatched, as `Pipeline.step` does,
        with the timeline of this process's stages still being taken (`PendingTimeline.result`).

        The tasks are dispatched exactly as `Pipeline.step` dispatches them, so timing costs the
        step none of its overlap, nor the next steps theirs (a profile every step stays cheap;
        seed 000 §3.3.1); one watcher thread per stage waits for that stage's results in order (one
        thread for all would note a task that ends before an earlier-dispatched one on another
        stage only when that one ends). The watchers live as long as the pipeline: starting
        them every step cost the training thread 0.7 ms each. A stage runs its programs in
        order, so a task ends when its results are ready and starts at the latest of its
        dispatch, the end of the stage's previous task and the end of the task that computed
        its input (when that stage is this process's). Each wait is a thread wake-up, most of
        what a profile every step costs in CPU, so the watchers wait for nothing else but the
        transfers across processes: such a transfer holds both devices until both processes
        take part, and without its end the stage's next task would count that wait as its
        work (a stage paced by a slower neighbour then looks as busy as the neighbour, and a
        periodic profile rescaled by busy time, `rescaled_units`, would say so). Copies
        inside a process are not watched: they block neither device. The watched arrays are
        none that a later program donates, so later steps may be dispatched before the
        watchers are done.
        """
        run = self.runner.start(exe, inputs, targets, batch_in, rows)
        local = [s.index for s in self.stages.local(exe.spec)]
        queues = {s: self._watcher(s) for s in local}
        seen: dict[int, list[Seen]] = {s: [] for s in local}
        errors: list[BaseException] = []
        done = {s: threading.Event() for s in local}
        start = time.perf_counter()
        try:
            for s in local:  # this step's records, then what its first task waits for
                queues[s].put((_BEGIN, seen[s], errors, ()))
                queues[s].put((_READY, start, self._ready_marks(run, s), ()))
            for s, task, action in exe.order:
                dispatched = time.perf_counter()
                computed = self.runner.dispatch(run, s, task, action, watch=True)
                if s in queues and action == "run":
                    queues[s].put((task, dispatched, (), computed))
                elif computed:  # a transfer across processes: on the local side's device
                    side = s if s in queues else s + 1 if task.kind == "F" else s - 1
                    queues[side].put((_TRANSFER, dispatched, (), computed))
            metrics = self.runner.finish(run)
        finally:
            for s, q in queues.items():
                q.put((_END, done[s], None, ()))  # the step's last task is noted
        return metrics, PendingTimeline(list(done.values()), seen, errors, start)

    def _watcher(self, s: int) -> queue.SimpleQueue:
        """The task queue of stage ``s``'s watcher thread (started on first use)."""
        if s not in self._watchers:
            self._watchers[s] = queue.SimpleQueue()
            threading.Thread(
                target=_watch, args=(self._watchers[s],), name=f"{WATCHER}{s}", daemon=True
            ).start()
        return self._watchers[s]

    def _ready_marks(self, run: Run, s: int) -> tuple:
        """Arrays ready when stage ``s`` may start the step: its parameters from the previous
        update (which waits for the global norm, so for every stage's previous backward) and
        the readout sent to it. The timeline counts waiting for them as idle, not as the first
        task's time (a profile of a step dispatched while the previous one still runs). The
        step's update donates the parameters, so what is watched is a metric of the update
        that wrote them (ready with them), or, for parameters no update here wrote (placed,
        migrated, changed by a plugin), a scalar derived from them (one small program)."""
        leaves = jax.tree.leaves(self.stages.state[s]["params"])
        updated = self.stages.updated.get(s)
        if not leaves:
            marks = []
        elif updated is not None and updated[0] is leaves[0]:
            marks = [updated[1]]
        else:
            marks = [_MARK(leaves[0])]
        return present(marks, run.readout.get(s))
