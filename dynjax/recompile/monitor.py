"""A queue of per-step metric futures, read Δ steps late so reading never stalls the device.

Seed 001 appendix B: metrics are futures pushed when a step is launched; the controller reads
those of step t - Δ (`delta_launch`), which have normally finished executing, so the launch
frontier stays Δ steps ahead of the execution frontier and a policy's decision overlaps with the
steps already queued. Δ can be changed at any time.

Each step's completion time is stamped by a thread that waits on its metrics in launch order
(`completed_at`): the host reads a step Δ steps late and, at a checkpoint or the end of a run,
several at once, so the times of those reads are not when the steps finished (the last step of
a run logged at every step measured 1e5-1e6 tokens/s from them).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


class Monitor:
    """Holds the metrics of launched steps until they are Δ steps old, then hands them to the host.

    `pop_ready(t)` converts the steps <= t - Δ (oldest first) with one `jax.device_get` and never
    touches a younger step, so with Δ >= 1 it never waits for the newest step. If the device
    lags more than Δ steps behind, converting step t - Δ waits for it: this caps how far the
    host runs ahead, as the future queue of appendix B does. Δ = 0 reads synchronously.
    """

    def __init__(self, delta: int = 2) -> None:
        self.delta = delta
        self._queue: deque[tuple[int, Any]] = deque()
        self._to_watch: queue.SimpleQueue[tuple[int, list[Any]] | None] = queue.SimpleQueue()
        self._completed: dict[int, float] = {}
        self._stamped = threading.Condition()
        self._watcher = threading.Thread(target=self._watch, name="dynjax-step-watcher",
                                         daemon=True)
        self._watcher.start()

    @property
    def delta(self) -> int:
        return self._delta

    @delta.setter
    def delta(self, value: int) -> None:
        if value < 0:
            raise ValueError(f"delta_launch = {value} must be >= 0")
        self._delta = value

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, step: int, metrics: Any) -> None:
        """Queue the (device, not yet computed) metrics of a just-launched step."""
        if self._queue and step <= self._queue[-1][0]:
            raise ValueError(f"step {step} pushed after step {self._queue[-1][0]}")
        self._queue.append((step, metrics))
        self._to_watch.put((step, jax.tree.leaves(metrics)))

    def completed_at(self, step: int) -> float:
        """The `time.perf_counter` at which ``step``'s metrics were ready (once per step: call it
        after `pop_ready` or `drain` handed the step over)."""
        with self._stamped:
            self._stamped.wait_for(lambda: step in self._completed)
            return self._completed.pop(step)

    def close(self) -> None:
        """End the watcher thread once it has stamped every pushed step."""
        self._to_watch.put(None)
        self._watcher.join()

    def _watch(self) -> None:
        while (item := self._to_watch.get()) is not None:
            step, leaves = item
            try:
                jax.block_until_ready(leaves)
            except Exception:  # noqa: BLE001 (the host's own read of the step raises it)
                pass
            with self._stamped:
                self._completed[step] = time.perf_counter()
                self._stamped.notify_all()

    def pop_ready(self, current_step: int) -> list[tuple[int, dict[str, np.ndarray]]]:
        """The queued steps <= current_step - Δ, in order, as host NumPy metrics."""
        ready = []
        while self._queue and self._queue[0][0] <= current_step - self._delta:
            ready.append(self._queue.popleft())
        return _to_host(ready)

    def drain(self) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """All queued steps (end of training), each yielded once it is done: one fetch per
        step, so a consumer that times them sees each step's completion, not the last one's."""
        while self._queue:
            yield from _to_host([self._queue.popleft()])


def _to_host(entries: list[tuple[int, Any]]) -> list[tuple[int, dict[str, np.ndarray]]]:
    if not entries:
        return []
    metrics = [jax.tree.map(_gathered, m) for _, m in entries]
    host = jax.device_get(metrics)  # one call: copies start in parallel
    return [(s, jax.tree.map(np.asarray, m)) for (s, _), m in zip(entries, host, strict=True)]


def _gathered(x: Any) -> Any:
    """A metric split over several processes' devices (e.g. an MoE layer's per-expert loads in
    a data-parallel program over processes), gathered whole into every process; every process
    pops the same steps in the same order, so each takes part in the gather."""
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        return multihost_utils.process_allgather(x, tiled=True)
    return x
