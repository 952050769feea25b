"""Stopping a run on a scheduler's notice without losing a step (issue 32 §1).

Kubernetes and SLURM send SIGTERM before they kill a job, SLURM sends its warning signal
(``--signal=USR1@300`` in ``launch/slurm.sbatch``) minutes ahead, and a user presses Ctrl-C
(SIGINT). `StopRequest` turns the first of these into a request the training loop reads at its
next step boundary: the loop finishes the steps in flight, saves their checkpoint, writes a
``preempted`` event and the run exits with `PREEMPTED_EXIT`, on which the launchers requeue or
restart it. A second signal aborts at once, as the signal would have without dynjax.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType, TracebackType

log = logging.getLogger("dynjax")

# The exit status of a run that stopped at a signal after saving its checkpoint: sysexits.h's
# EX_TEMPFAIL ("try again later"), apart from 0 (done), 1 (a failure) and 2 (a config error).
PREEMPTED_EXIT = 75
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopRequest:
    """The first of `SIGNALS` since `__enter__`, as a request to stop at a step boundary.

    Handlers are installed only where Python allows them (the main thread); elsewhere (a
    training thread of a notebook or a test) the request is never set by a signal, and
    `request` sets it by hand. On leaving, the handlers that were there before come back."""

    def __init__(self) -> None:
        self.signal: str | None = None  # the name of the signal that asked, once one did
        self.at: float | None = None  # when it asked (`time.perf_counter`)
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def request(self, name: str) -> None:
        """Ask the loop to stop at its next step boundary (what a signal does)."""
        if self.signal is None:
            self.signal, self.at = name, time.perf_counter()

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal is None:
            self.request(name)
            log.warning(
                "%s: finishing the steps in flight and saving a checkpoint; send it again to "
                "stop at once without saving", name,
            )
            return
        # A second signal: what it would have done without dynjax (SIGINT raises
        # KeyboardInterrupt, SIGTERM and SIGUSR1 end the process).
        self.__exit__(None, None, None)
        signal.raise_signal(signum)
