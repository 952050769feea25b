"""Stop every process of a run soon after one of them dies (issue 15 §4).

A process that is killed (SIGKILL, the OOM killer, a lost node) leaves the others waiting in a
collective or a key-value read that never returns. JAX's own heartbeat notices only after its
timeout (100 s by default) and then aborts with a log line of its own. So each process beats through
the coordinator's key-value store (``dynjax/alive/<id>``: a counter, rewritten every second, or
every ``timeout / 10`` seconds for a timeout under 10 s) and a thread reads every peer's beat.
When a peer's beat has not changed for ``timeout`` seconds, the peer is dead: this process
prints an ``error:`` line naming it and exits at once with ``os._exit`` (the main thread may be
inside a collective that never returns).

Two more values tell the others that a process stopped without dying. ``done`` means it
finished: the others may still be running their last steps, and this is not a death.
``failed`` means it stopped on an error of its own. Before writing ``failed``, a process waits
until every peer has beaten after the error. That way, when a collective error was caused by a
peer that died, the message names the dead peer and not the process that saw the error.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import NoReturn, Protocol

PREFIX = "dynjax/alive/"
DONE, FAILED = "done", "failed"
RESUME = "rerun the same command to resume from the last checkpoint"


class Store(Protocol):
    """The part of JAX's distributed client the watchdog uses."""

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None: ...

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]: ...


class Peers:
    """What one process has seen of the other processes' beats. Pure (the caller passes the
    clock), so the tests can drive it with plain dicts."""

    def __init__(self, me: int, count: int, timeout: float, now: float):
        self.count, self.timeout = count, timeout
        # peer -> (last value seen, when it last changed)
        self.seen: dict[int, tuple[str | None, float]] = {
            p: (None, now) for p in range(count) if p != me
        }

    def update(self, beats: dict[int, str], now: float) -> str | None:
        """Take a new read of every process's value. Returns why this process must stop (a
        sentence naming the peer), or None while every peer is alive, finished or not yet
        overdue."""
        for p, (value, since) in self.seen.items():
            got = beats.get(p)
            if got == FAILED:
                return f"process {p} (of {self.count}) failed (see its output)"
            if got != value:
                self.seen[p] = (got, now)
            elif got != DONE and now - since > self.timeout:
                return (
                    f"process {p} (of {self.count}) stopped responding "
                    f"(no heartbeat for {self.timeout:g} s)"
                )
        return None

    def all_done(self) -> bool:
        return all(value == DONE for value, _ in self.seen.values())

    def all_beat_since(self, t: float) -> bool:
        """Every peer has finished, or its beat has changed after time ``t``."""
        return all(value == DONE or since > t for value, since in self.seen.values())


class Watchdog:
    """The beating and watching thread of one process of a run."""

    def __init__(self, store: Store, me: int, count: int, timeout: float):
        self.store, self.me, self.count = store, me, count
        self.interval = min(1.0, timeout / 10)
        self.peers = Peers(me, count, timeout, time.monotonic())
        self._lock = threading.Lock()
        self._finished = False  # this process wrote done or failed: it beats no more
        self._thread = threading.Thread(target=self._run, name="dynjax-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        beat = 0
        while True:
            try:
                with self._lock:
                    if not self._finished:
                        beat += 1
                        self._write(str(beat))
                read = self.store.key_value_dir_get(PREFIX)
            except Exception:
                if self._finished:  # the run is over: the coordinator left after the others
                    return
                # Usually JAX's own client aborts first when the coordinator dies.
                self._leave(f"process 0 (of {self.count}), the coordinator, stopped responding")
            beats = {int(key.rsplit("/", 1)[1]): value for key, value in read}
            with self._lock:
                reason = self.peers.update(beats, time.monotonic())
                if self._finished and self.peers.all_done():
                    return
            if reason:
                self._leave(reason)
            time.sleep(self.interval)

    def _write(self, value: str) -> None:
        self.store.key_value_set(f"{PREFIX}{self.me}", value, allow_overwrite=True)

    def _leave(self, reason: str) -> NoReturn:
        print(f"error: {reason}; {RESUME}", file=sys.stderr, flush=True)
        self._exit()

    def _exit(self) -> NoReturn:
        sys.stdout.flush()
        if self.me == 0:  # the others read the store process 0 hosts: let them read it first
            time.sleep(2 * self.interval)
        os._exit(1)

    def finish(self) -> None:
        """This process is done with the run. It is not dead: the others may still be running
        their last steps. Keep watching until every peer has finished too, because a peer that
        dies now would leave this process waiting in JAX's shutdown barrier. Returns once the
        watching thread has ended: a read of the store while JAX's shutdown destroys its client
        aborts the process (``terminate called after throwing``)."""
        with self._lock:
            if not self._finished:
                self._finished = True
                self._write(DONE)
        if self._thread.is_alive():
            self._thread.join()

    def fail(self) -> NoReturn:
        """Leave the run after an error in this process; its output says what the error was.
        If a peer died, the watching thread names it and exits first. Otherwise write ``failed``
        once every peer has beaten since the error, so that the others stop too."""
        # A beat the watching thread sees in its first polls after the error may have been
        # written just before a peer died with it (its connection reset is what failed here):
        # only beats seen two intervals later tell a live peer (it beats every interval).
        t = time.monotonic() + 2 * self.interval
        deadline = t + self.peers.timeout + 2 * self.interval
        while time.monotonic() < deadline:
            with self._lock:
                if self.peers.all_beat_since(t):
                    break
            time.sleep(self.interval)
        with self._lock:
            self._finished = True
            self._write(FAILED)
        self._exit()
