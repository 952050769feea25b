"""How a run checkpoints, behind the calls the training loop makes: whole checkpoints, partial
checkpoints of row-stacked leaves (seed 004 §3) or two-level snapshots and persists
(`snapshot`, seed 004 §5).

The edge (`dynjax.train`) picks one from the config and the `rows.PartialRows` a scheme
declares (`dynjax.dynamism.base.Plugin.checkpoint_rows`: which leaves are row-stacked, and the
`rows.RowPolicy` choosing each save's rows); the loop then calls `on_resume` once, `counted`
for each step whose metrics reach the host, `after_step` and `save` after each step (an
evaluation between them), `recover` at a fault, `finish` after the last step and `close`. The
storage below is a `Checkpointer` or, in a pipeline over processes, a `PartedCheckpointer`
(`restore_latest` reads either kind into either).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dynjax.checkpoint import layout
from dynjax.checkpoint.manager import Checkpointer
from dynjax.checkpoint.parts import PartedCheckpointer, parts_are_newer, restore_parts
from dynjax.checkpoint.rows import NO_ROWS, POLICY_META, PartialRows, RowPolicy, row_sources
from dynjax.checkpoint.snapshot import TwoLevel
from dynjax.parallel.peers import Peers, Rounds

if TYPE_CHECKING:  # the loop's objects, passed down: checkpoint sits below recompile
    from dynjax.parallel.runtime import Runtime
    from dynjax.recompile import Plan

log = logging.getLogger("dynjax")
Storage = Checkpointer | PartedCheckpointer
Emit = Callable[[dict[str, Any]], None]


def open_storage(
    root: Path,
    peers: Peers | None,
    *,
    parted: bool,
    keep: int,
    partial: PartialRows | None,
    async_save: bool,
    emit: Emit,
) -> Storage:
    """``root/checkpoints``: a pipeline over processes (``parted``) saves each process's own
    stages' part (`checkpoint.parts`); otherwise one directory every process writes its
    shards into. ``partial``: the row-stacked leaves a scheme declared (None: none)."""
    stacks = NO_ROWS if partial is None else partial.stacks
    if parted:
        return PartedCheckpointer(
            root / "checkpoints", peers, keep=keep, stacks=stacks, async_save=async_save,
            emit=emit,
        )
    return Checkpointer(
        root / "checkpoints", keep=keep, stacks=stacks, async_save=async_save, emit=emit
    )


def restore_latest(
    storage: Storage,
    directory: Path,
    target: Callable[[dict[str, Any]], Any],
    peers: Peers | None,
    emit: Emit,
) -> tuple[Any, dict[str, Any]] | None:
    """The newest checkpoint in ``directory`` (``storage``'s): a pipeline over processes reads
    its parts; a run of one program its own kind, unless a pipeline over processes saved a
    newer step in parts (then those, on this process count: `checkpoint.parts`)."""
    if isinstance(storage, PartedCheckpointer):
        return storage.restore_latest(target)
    if parts_are_newer(directory, storage.all_steps(), peers):
        return restore_parts(
            directory, target, peers, stacks=storage.stacks, emit=emit, reload=storage.reload
        )
    return storage.restore_latest(target)


class Checkpoints(Protocol):
    """The calls the training loop makes, whichever strategy the config chose."""

    storage: Storage

    def on_resume(self, meta: dict[str, Any] | None, k_changed: bool) -> None: ...

    def counted(self, done: int, metrics: dict[str, Any]) -> None: ...

    def after_step(
        self, done: int, runtime: Runtime, plan: Plan, catch_up: Callable[[], None]
    ) -> None: ...

    def save(
        self, done: int, runtime: Runtime, plan: Plan, catch_up: Callable[[], None]
    ) -> None: ...

    def recover(
        self, fault: Exception, step: int, plan: Plan, catch_up: Callable[[], None]
    ) -> tuple[int, Any] | None: ...

    def save_now(
        self, done: int, runtime: Runtime, plan: Plan, catch_up: Callable[[], None]
    ) -> bool: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...


class WholeCheckpoints:
    """Every ``every`` steps and at the last, the whole state."""

    def __init__(
        self,
        storage: Storage,
        partial: PartialRows | None,
        *,
        every: int,
        steps: int,
        content: str,
        config: dict[str, Any],
        target: Callable[[Plan], Any],
        emit: Emit,
    ) -> None:
        """``partial``: the row-stacked leaves a scheme declared, with its row policy (None:
        none); ``config``: the run's config, saved with each step; ``target(plan)``: where a
        checkpoint of ``plan``'s run restores to (`Experiment.restore_target`)."""
        self.storage, self.partial, self.emit = storage, partial, emit
        self.every, self.steps, self.content = every, steps, content
        self.config, self.target = config, target
        self.policy: RowPolicy | None = None

    def meta(self, plan: Plan) -> dict[str, Any]:
        return {"plan": plan.to_dict(), "config": self.config}

    def on_resume(self, meta: dict[str, Any] | None, k_changed: bool) -> None:
        """The run starts from ``meta``'s checkpoint (None: from scratch). One that carries a
        row policy accounts the fault first: its ``checkpoint_recovery`` event (what each
        restored row lost; even if this run saves whole checkpoints: the rows restored from
        older saves lost their updates all the same). ``k_changed``: a changed K replaces the
        one the policy carried (dynamic K's)."""
        if meta is None or POLICY_META not in meta or self.partial is None:
            return
        policy = self.partial.from_meta(meta[POLICY_META])
        recovery = policy.recover(row_sources(meta, self.partial))
        self.emit({**recovery.event(), "source": "storage"})
        log.info("partial checkpoint: %s", recovery.describe())
        if k_changed and self.partial.k:
            policy.set_k(self.partial.k)
        self.policy = policy if self.partial.k else None

    def counted(self, done: int, metrics: dict[str, Any]) -> None:
        """The metrics of the step that made ``done`` steps reached the host (in step order,
        Δ steps late); a row policy counts them and adds its own metrics to ``metrics``."""

    def after_step(
        self, done: int, runtime: Runtime, plan: Plan, catch_up: Callable[[], None]
    ) -> None:
        """What runs after every step, before its evaluation: a save finished in the
        background gets its event."""
        self.storage.poll()

    def save(self, done: int, runtime: Runtime, plan: Plan, catch_up: Callable[[], None]) -> None:
        """Save after step ``done`` if it is due; ``catch_up()`` hands the host every step's
        metrics (a row policy's metadata counts every step up to the one saved)."""
        if done % self.every == 0 or done == self.steps:
            self._save(done, runtime, plan, catch_up)

    def save_now(
        self, done: int, runtime: Runtime, plan: Plan, catch_up: Callable[[], None]
    ) -> bool:
        """Save after step ``done`` whatever the schedule, every row whole (a stop at a signal:
        nothing trained may be lost), and wait until it is written; True once storage lists it
        (saved now or before)."""
        self.storage.wait()
        if done not in self.storage.all_steps():
            self._save(done, runtime, plan, catch_up, whole=True)
            self.storage.wait()
        return done in self.storage.all_steps()

    def _save(
        self,
        done: int,
        runtime: Runtime,
        plan: Plan,
        catch_up: Callable[[], None],
        *,
        whole: bool = False,
    ) -> None:
        """Save after step ``done``: the rows a policy selects, all with ``whole``. Every
        step's metrics up to ``done`` are logged first, so a process killed right after the save
        leaves no step unlogged that the resumed run skips (and a policy's metadata counts
        every step up to this one)."""
        meta, rows = self.meta(plan), None
        catch_up()
        if self.policy is not None:
            rows = None if whole else self.policy.select()
            meta[POLICY_META] = self.policy.meta_after(done, rows)
        started = self.storage.save(
            done, runtime.checkpoint_state(), meta, rows=rows, content=self.content
        )
        if started and self.policy is not None:
            self.policy.saved(done, rows)

    def recover(
        self, fault: Exception, step: int, plan: Plan, catch_up: Callable[[], None]
    ) -> tuple[int, Any] | None:
        """The step and state to go on from after ``fault`` while running ``step``; None:
        nothing in memory (the process ends, a restart reads storage)."""
        return None

    def finish(self) -> None:
        """After the last step."""

    def close(self) -> None:
        self.storage.close()


class PartialRowCheckpoints(WholeCheckpoints):
    """`WholeCheckpoints` that save K of the rows of each stack (seed 004 §3), as the scheme's
    row policy chooses; the policy counts every step (e.g. the tokens each row computed, for
    the lost updates and a load-aware choice)."""

    def on_resume(self, meta: dict[str, Any] | None, k_changed: bool) -> None:
        super().on_resume(meta, k_changed)
        if self.policy is None and self.partial is not None and self.partial.k:
            self.policy = self.partial.fresh(0 if meta is None else meta["step"])
        if self.policy is not None:
            self.policy.pinned = set(self.storage.all_steps())

    def counted(self, done: int, metrics: dict[str, Any]) -> None:
        if self.policy is not None:
            metrics.update(self.policy.counted(done, metrics))


class TwoLevelCheckpoints(PartialRowCheckpoints):
    """Snapshots to host memory every ``snapshot_every`` steps, persisted to storage every
    ``persist_every``, and the last step saved (`snapshot.TwoLevel`); a fault restores the
    newest snapshot from memory. With a row policy a snapshot may copy K_snapshot rows per
    stack, a persist K_persist of them."""

    def __init__(
        self,
        storage: Storage,
        partial: PartialRows | None,
        *,
        snapshot_every: int,
        persist_every: int,
        rounds: Rounds,
        **kwargs: Any,
    ) -> None:
        super().__init__(storage, partial, every=0, **kwargs)
        self.snapshot_every, self.persist_every = snapshot_every, persist_every
        policed = partial is not None and bool(partial.k)
        self.twolevel = TwoLevel(
            NO_ROWS if partial is None else partial.stacks,
            partial.ids if policed else (),
            partial.rows if policed else 0,
            persist_k=partial.persist_k if policed else 0,
            emit=self.emit,
            rounds=rounds,
        )

    def on_resume(self, meta: dict[str, Any] | None, k_changed: bool) -> None:
        if meta is not None:  # what storage holds of each row: the restore's sources
            self.twolevel.persisted_step = meta["step"]
        super().on_resume(meta, k_changed)
        if meta is not None and self.policy is not None:
            self.twolevel.stored = row_sources(meta, self.partial)

    def counted(self, done: int, metrics: dict[str, Any]) -> None:
        if self.policy is not None:
            own = self.policy.counted(done, metrics)
            self.twolevel.counted(done, self.policy)
            metrics.update(own)

    def after_step(
        self, done: int, runtime: Runtime, plan: Plan, catch_up: Callable[[], None]
    ) -> None:
        twolevel, policy = self.twolevel, self.policy
        twolevel.poll()
        self.storage.poll()
        if done % self.snapshot_every == 0:
            rows = None
            if policy is not None and twolevel.partial_ok:
                rows = policy.select(ahead=twolevel.ahead())
            twolevel.snapshot(done, runtime.checkpoint_state(), rows)
        if done % self.persist_every == 0 and done != self.steps:
            twolevel.persist(self.storage, self.target(plan), self.meta(plan), catch_up=catch_up)
            if self.policy is not None:  # a restart reads these steps' records
                self.policy.pinned = {*self.storage.all_steps(), twolevel.persisted_step}

    def save(self, done: int, runtime: Runtime, plan: Plan, catch_up: Callable[[], None]) -> None:
        if done == self.steps:
            self._save(done, runtime, plan, catch_up)

    def recover(
        self, fault: Exception, step: int, plan: Plan, catch_up: Callable[[], None]
    ) -> tuple[int, Any] | None:
        """The newest snapshot every process holds, placed as ``plan``'s run places its state;
        the row policy goes back to its metadata at that step and accounts the lost steps."""
        target = self.target(plan)
        flat_target = layout.flatten(target)
        snap = self.twolevel.recovery(flat_target)
        if snap is None:  # no usable snapshot (in some process): the same
            return None
        log.warning("%s: %s; restoring the snapshot of step %d from host memory",
                    type(fault).__name__, fault, snap.step)
        catch_up()  # the steps that ran: the row policy reaches the snapshot
        state = layout.unflatten_like(target, snap.placed(flat_target))
        recovery = {"event": "checkpoint_recovery", "step": snap.step, "plt": 0.0}
        if self.policy is not None:
            self.policy = self.partial.from_meta(self.twolevel.policy_of(snap))
            self.policy.pinned = set(self.storage.all_steps())
            recovery = self.policy.recover(snap.sources).event()
        self.emit({**recovery, "source": "memory", "fault_step": step + 1})
        self.twolevel.rolled_back(snap.step)
        return snap.step, state

    def finish(self) -> None:
        self.twolevel.poll(wait=True)

    def close(self) -> None:
        self.twolevel.close()
        super().close()
