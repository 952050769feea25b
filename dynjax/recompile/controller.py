"""The controller: runs policies on a host thread and swaps in new Plans at step boundaries.

Seed 001 §3 (requirements 2 and 3) and appendix B: the recompile trigger runs on the host while
the device trains with the current graph, and a new graph takes effect at the launch frontier.
Here `observe` feeds host metrics (already Δ steps old, see `Monitor`) to a policy thread; an
accepted proposal is lowered there and compiled on the `Compiler`'s worker; the training loop's
`poll` returns a `Swap` at the first step boundary where the executable is ready, and training
never waits for a decision (unless ``blocking``: then each boundary waits for the policies and a
pending compile, so a Plan swaps in at the same step on any machine). In a multi-process run
(``peers``) only the leader's policies decide, and a Plan swaps in at the first boundary where
every process holds its executable (`dynjax.recompile.agreement`). Events (dicts, one JSON line
each) record every decision:

- `recompile`: step (training step when proposed), metrics_step, swap_step, reason, policy,
  plan_diff, plan, lower_seconds, compile_seconds, cache_hit, steps_during_compile,
  swap_stall_seconds;
- `recompile_rejected`: step, metrics_step, reason (the `PlanError`, or "budget"), policy,
  plan_diff; once per refused Plan: a policy (or the budget) that keeps refusing the same Plan
  is not logged again until it refuses another one or a recompile goes through;
- `recompile_failed`: lowering or compiling raised (in a multi-process run on any process, which
  `process` names: every process drops the Plan); `policy_error`: a policy raised;
- a policy's own decision records (`Proposal.records`, e.g. `rebalance`), with step,
  metrics_step and policy added.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

from dynjax.parallel.peers import Peers
from dynjax.recompile.agreement import LEADER, Announcement, Status, verdict
from dynjax.recompile.compiler import Compiler, CompileResult
from dynjax.recompile.plan import Plan
from dynjax.recompile.policy import History, Metrics, Policy
from dynjax.recompile.rounds import Budget, Event, PolicyRounds


@dataclass(frozen=True)
class Swap:
    """A ready executable for `plan`, handed to the training loop by `Controller.poll`."""

    plan: Plan
    previous: Plan
    executable: Any  # jax.stages.Compiled
    step: int  # training step when proposed
    metrics_step: int | None  # newest metrics the policies had seen
    swap_step: int  # first step to run with `executable`
    reason: str
    policy: str
    compile: CompileResult
    found_at: float = field(repr=False)  # time.perf_counter() when poll found it

    def event(self, stall: float) -> Event:
        """The ``recompile`` event, once the training loop runs it ``stall`` s after `poll`."""
        return {
            "event": "recompile",
            "step": self.step,
            "metrics_step": self.metrics_step,
            "swap_step": self.swap_step,
            "reason": self.reason,
            "policy": self.policy,
            "plan_diff": self.previous.diff(self.plan),
            "plan": self.plan.to_dict(),
            "lower_seconds": self.compile.lower_seconds,
            "compile_seconds": self.compile.compile_seconds,
            "cache_hit": self.compile.cache_hit,
            "steps_during_compile": self.swap_step - self.step,
            "swap_stall_seconds": stall,
        }


@dataclass(frozen=True)
class _Pending:
    plan: Plan
    future: Future[CompileResult]
    step: int
    metrics_step: int | None
    reason: str
    policy: str
    number: int = 0  # in a multi-process run, the leader's `Announcement.number`

    def announcement(self) -> Announcement:
        return Announcement(
            self.number, self.plan, self.step, self.metrics_step, self.reason, self.policy
        )


class Controller:
    """Runs `policies` on a host thread and hands ready Plans to the training loop.

    Each round of the policies (`PolicyRounds`: in order, validated, within the `budget`) runs
    on the policy thread; policies do not run while a compile is pending. `emit` is called from
    both the policy thread and the training thread: it must be thread-safe (`EventLog` is).
    Errors of the controller itself (not of a policy) are re-raised on the training thread by
    the next `poll`, `wait_idle` or `stop`.

    With ``peers`` (a multi-process run), every `poll` publishes this process's `Status` and
    reads every process's of ``lag`` boundaries before: process 0 runs the policies and
    announces what it accepts, the others compile the announced Plan on their own thread, and
    all swap at the same boundary.

    With ``blocking``, `poll` first waits until the policies have seen every observation, an
    announced Plan is submitted and a pending compile has finished: which steps a Plan is
    decided and swapped at no longer depends on the machine's speed (reproducible runs, and
    tests that need a swap within a few steps); each recompile stalls training by its compile.
    """

    def __init__(
        self,
        plan: Plan,
        compiler: Compiler,
        policies: Sequence[Policy],
        *,
        emit: Callable[[Event], None],
        validate: Callable[[Plan], None],
        budget: Budget,
        history_size: int = 1000,
        peers: Peers | None = None,
        lag: int = 1,
        blocking: bool = False,
    ) -> None:
        self._plan = plan
        self._compiler = compiler
        self._emit = emit
        self._rounds = PolicyRounds(
            policies,
            emit=emit,
            validate=validate,
            budget=budget,
            same_program=compiler.same_program,
        )
        self._entries: deque[tuple[int, Metrics]] = deque(maxlen=history_size)
        self._cond = threading.Condition()
        self._pending: _Pending | None = None
        self._observed = 0
        self._processed = 0
        self._busy = False  # the policy thread is running a round or submitting a compile
        self._blocking = blocking
        self._stopping = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._launch_step = 0
        self._unfinished: Swap | None = None
        if lag < 1:
            raise ValueError(f"lag = {lag} must be >= 1")
        self._peers, self._lag = peers, lag
        self._leader = peers is None or peers.index == LEADER
        self._numbered = 0  # the leader: Plans accepted so far
        self._announced = 0  # the leader: the newest Plan number it announced
        self._adopt: Announcement | None = None  # a follower: the leader's Plan to compile
        # Plans up to this number were swapped in or dropped by every process: the statuses of
        # the `lag` boundaries before that verdict still speak of them, and are ignored.
        self._settled = 0
        # Boundaries polled so far: the agreement's keys (a step repeats after an in-memory
        # recovery rolls the run back; the boundaries every process polls do not).
        self._boundaries = 0
        # The signal of a stop every process agreed on (`poll`): the loop stops and saves.
        self.preempted_by: str | None = None

    @property
    def plan(self) -> Plan:
        """The Plan the training loop runs now."""
        with self._cond:
            return self._plan

    @property
    def pending(self) -> Plan | None:
        """The Plan being compiled, if any."""
        with self._cond:
            return self._pending.plan if self._pending else None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dynjax-controller", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Finish the current round and join the policy thread (a pending compile is dropped)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        self._raise_error()

    def observe(self, step: int, host_metrics: Metrics) -> None:
        """Record the host metrics of `step` and wake the policy thread; never blocks on it."""
        with self._cond:
            self._entries.append((step, host_metrics))
            self._observed += 1
            self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the policies have seen every observation so far (for tests, end of run).

        Returns False on timeout.
        """
        with self._cond:
            done = self._cond.wait_for(
                lambda: self._processed >= self._observed or self._error is not None, timeout
            )
        self._raise_error()
        return done

    def poll(self, step: int, stop: str | None = None) -> Swap | None:
        """At the boundary before `step`: a `Swap` if a pending executable is ready, else None.

        Never blocks on a compile unless ``blocking`` (in a multi-process run it waits for the
        other processes to reach this boundary). After a Swap, the caller migrates state,
        switches to `swap.executable` and calls `swap_done(swap)`, which emits the `recompile`
        event with the stall measured from this call.

        ``stop``: the signal that asked this process to stop (`StopRequest`). Once every
        process is to stop at this boundary, `preempted_by` names it: at once in one process,
        and in a multi-process run at the boundary whose verdict first carries it (``lag``
        boundaries later), the same boundary on every process.
        """
        found_at = time.perf_counter()
        self._raise_error()
        if self._unfinished is not None:
            raise RuntimeError("poll() before swap_done() of the previous Swap")
        if self._blocking:  # before the launch step moves on: the round proposes at step - 1
            self._wait_for_work()
        self._launch_step = step
        with self._cond:
            pending = self._pending
        if self._peers is not None:
            return self._agree(step, pending, found_at, stop)
        self.preempted_by = self.preempted_by or stop
        if pending is None or not pending.future.done():
            return None
        return self._take(pending, step, found_at)

    def _wait_for_work(self) -> None:
        """``blocking``: wait for the policies to see every observation (and submit what they
        accept) or for an announced Plan's submission, then for a pending compile to end."""
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or (
                self._processed >= self._observed and self._adopt is None and not self._busy))
            pending = self._pending
        self._raise_error()
        if pending is not None:
            wait([pending.future])  # its error, if any, is reported where it is taken

    def _agree(
        self, step: int, pending: _Pending | None, found_at: float, stop: str | None
    ) -> Swap | None:
        """`poll` of a multi-process run: the boundary's `Verdict` from every process's status."""
        announce = None
        if self._leader and pending is not None and pending.number > self._announced:
            announce = pending.announcement()
            self._announced = pending.number
        status = Status(announce, stop=stop)
        if pending is not None and pending.future.done():
            error = pending.future.exception()
            status = Status(
                announce,
                ready=pending.number if error is None else None,
                failed=None if error is None else (pending.number, _describe(error)),
                stop=stop,
            )
        peers, lag = self._peers, self._lag
        assert peers is not None
        boundary, self._boundaries = self._boundaries, self._boundaries + 1
        peers.publish(f"control/{boundary}", status)
        if boundary < lag:
            return None
        found = verdict(peers.collect(f"control/{boundary - lag}"))
        # Every process has published boundary - lag, so it has read every key up to
        # boundary - 2 * lag - 1 (at the boundaries before that one).
        peers.forget(f"control/{boundary - 2 * lag - 1}")
        self.preempted_by = self.preempted_by or found.stop
        if found.failed is not None and found.failed[0] > self._settled:
            number, process, error = found.failed
            with self._cond:
                if self._pending is not None and self._pending.number == number:
                    self._pending = None
                self._settled = number
                self._cond.notify_all()
            where = pending if pending is not None and pending.number == number else None
            self._emit(_failed(
                where.step if where else step,
                where.metrics_step if where else None,
                where.reason if where else "",
                where.policy if where else "",
                self.plan.diff(where.plan) if where else {},
                error,
                process=process,
            ))
            return None
        if found.failed is not None:
            return None
        announced = found.announced
        if announced is not None and announced.number > self._settled and not self._leader:
            with self._cond:
                self._adopt = announced
                self._cond.notify_all()
        if found.swap is None or found.swap <= self._settled:
            return None
        assert pending is not None and pending.number == found.swap, "all reported it ready"
        self._settled = found.swap
        return self._take(pending, step, found_at)

    def _take(self, pending: _Pending, step: int, found_at: float) -> Swap | None:
        """Swap to `pending` (its compile has finished), or report that it failed."""
        with self._cond:
            error = pending.future.exception()
            previous = self._plan
            if error is None:
                self._plan = pending.plan
            self._pending = None
            self._cond.notify_all()
        if error is not None:
            self._emit(_failed(
                pending.step,
                pending.metrics_step,
                pending.reason,
                pending.policy,
                previous.diff(pending.plan),
                _describe(error),
            ))
            return None
        result = pending.future.result()
        self._unfinished = Swap(
            plan=pending.plan,
            previous=previous,
            executable=result.executable,
            step=pending.step,
            metrics_step=pending.metrics_step,
            swap_step=step,
            reason=pending.reason,
            policy=pending.policy,
            compile=result,
            found_at=found_at,
        )
        return self._unfinished

    def swap_done(self, swap: Swap) -> None:
        """Report that the training loop now runs `swap.executable`; emits `recompile`."""
        if swap is not self._unfinished:
            raise RuntimeError("swap_done() for a Swap that poll() did not just return")
        stall = time.perf_counter() - swap.found_at
        self._unfinished = None
        self._emit(swap.event(stall))

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError("the recompile controller thread failed") from self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        self._stopping
                        or self._processed < self._observed
                        or self._adopt is not None
                    )
                )
                if self._stopping:
                    return
                target = self._observed
                history = History(tuple(self._entries))
                idle = self._pending is None
                plan = self._plan
                adopt, self._adopt = self._adopt, None
                self._busy = True
            try:
                if adopt is not None:
                    self._compile_announced(adopt)
                elif idle and self._leader:
                    self._round(history, plan)
            except BaseException as e:  # surfaced on the training thread by poll()
                with self._cond:
                    self._error = e
                    self._busy = False
                    self._cond.notify_all()
                return
            with self._cond:
                self._processed = max(self._processed, target)
                self._busy = False
                self._cond.notify_all()

    def _compile_announced(self, announced: Announcement) -> None:
        """A follower builds the Plan the leader announced, as the leader did (in the
        background); a failure is reported at the next boundary, where every process drops it."""
        try:
            future = self._compiler.submit(announced.plan)
        except Exception as e:
            future = Future()
            future.set_exception(e)
        with self._cond:
            if announced.number > self._settled:
                self._pending = _Pending(
                    announced.plan,
                    future,
                    announced.step,
                    announced.metrics_step,
                    announced.reason,
                    announced.policy,
                    announced.number,
                )

    def _round(self, history: History, base: Plan) -> None:
        """Run the policies (`PolicyRounds`) and submit the Plan they accept."""
        step, metrics_step = self._launch_step, history.latest_step
        accepted = self._rounds.run(history, base, step)
        if accepted is None:
            return
        try:
            future = self._compiler.submit(accepted.plan)  # lowers here, compiles on the worker
        except Exception as e:
            if self._peers is None:
                diff = base.diff(accepted.plan)
                self._emit(_failed(
                    step, metrics_step, accepted.reason, accepted.policy, diff, _describe(e)
                ))
                return
            future = Future()  # announced all the same: every process drops it together
            future.set_exception(e)
        self._rounds.submitted(accepted, step)
        self._numbered += 1
        with self._cond:
            self._pending = _Pending(
                accepted.plan,
                future,
                step,
                metrics_step,
                accepted.reason,
                accepted.policy,
                self._numbered,
            )


def _failed(
    step: int,
    metrics_step: int | None,
    reason: str,
    policy: str,
    diff: dict[str, Any],
    error: str,
    process: int | None = None,
) -> Event:
    """The ``recompile_failed`` event (``process``: the one that failed, over several)."""
    event = {
        "event": "recompile_failed",
        "step": step,
        "metrics_step": metrics_step,
        "reason": reason,
        "policy": policy,
        "plan_diff": diff,
        "error": error,
    }
    if process is not None:
        event["process"] = process
    return event


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
