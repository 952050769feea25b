"""How a run checkpoints, behind the calls the training loop makes: whole checkpoints, partial
expert checkpoints (PEC, `pec`) or two-level snapshots and persists (`snapshot`).

The edge (`dynjax.train`) picks one from the config; the loop then calls `on_resume` once,
`counted` for each step whose metrics reach the host, `after_step` and `save` after each step
(an evaluation between them), `recover` at a fault, `finish` after the last step and `close`.
The storage below is a `Checkpointer` or, in a pipeline over processes, a `PartedCheckpointer`
(`restore_latest` reads either kind into either).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dynjax.checkpoint import layout
from dynjax.checkpoint.manager import Checkpointer
from dynjax.checkpoint.parts import PartedCheckpointer, parts_are_newer, restore_parts
from dynjax.checkpoint.pec import ExpertLedger
from dynjax.checkpoint.snapshot import TwoLevel
from dynjax.parallel.peers import Peers, Rounds

if TYPE_CHECKING:  # the loop's objects, passed down: checkpoint sits below recompile
    from dynjax.parallel.runtime import Runtime
    from dynjax.recompile import Plan

log = logging.getLogger("dynjax")
PLT = "checkpoint/plt"  # eq. 7 of seed 004 so far: lost over processed routed tokens
Storage = Checkpointer | PartedCheckpointer
Emit = Callable[[dict[str, Any]], None]


def open_storage(
    root: Path, peers: Peers | None, *, parted: bool, keep: int, async_save: bool, emit: Emit
) -> Storage:
    """``root/checkpoints``: a pipeline over processes (``parted``) saves each process's own
    stages' part (`checkpoint.parts`); otherwise one directory every process writes its
    shards into."""
    if parted:
        return PartedCheckpointer(
            root / "checkpoints", peers, keep=keep, async_save=async_save, emit=emit
        )
    return Checkpointer(root / "checkpoints", keep=keep, async_save=async_save, emit=emit)


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
        return restore_parts(directory, target, peers, emit=emit, reload=storage.reload)
    return storage.restore_latest(target)


@dataclasses.dataclass(frozen=True)
class LedgerSettings:
    """The expert ledger's numbers, unpacked from the config at the edge."""

    layers: tuple[int, ...]  # the MoE layers (model indices)
    num_experts: int
    ranks: int  # mesh.expert
    k: int  # experts per save (K_snapshot with two-level checkpoints); 0 = no ledger
    selection: str
    plt_limit: float
    dynamic_k: bool
    history: int  # train.keep_checkpoints

    def _options(self) -> dict[str, Any]:
        return {
            "selection": self.selection,
            "plt_limit": self.plt_limit,
            "dynamic_k": self.dynamic_k,
            "history": self.history,
        }

    def fresh(self, step: int) -> ExpertLedger:
        ledger = ExpertLedger(self.layers, self.num_experts, self.ranks, self.k, **self._options())
        ledger.step = step  # a full checkpoint's run: counts from it
        return ledger

    def from_meta(self, meta: dict[str, Any]) -> ExpertLedger:
        """The ledger of `ExpertLedger.to_meta` ``meta``, with the current config's settings."""
        return ExpertLedger.from_meta(meta, ranks=self.ranks, **self._options())


def expert_sources(meta: dict[str, Any], ledger: ExpertLedger) -> dict[int, list[int]]:
    """Per MoE layer, the step each expert's restored state comes from: the older of its
    weights' and its optimizer state's (the storage's ``expert_sources``), so that with
    ``checkpoint.pec_content="O"`` the tokens whose moment updates were lost count."""
    sources = meta.get("expert_sources") or {}
    out = {layer: [meta["step"]] * ledger.num_experts for layer in ledger.layers}
    for layer, parts in sources.items():
        out[int(layer)] = np.min([list(p) for p in parts.values()], axis=0).tolist()
    return out


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
        settings: LedgerSettings,
        *,
        every: int,
        steps: int,
        content: str,
        config: dict[str, Any],
        target: Callable[[Plan], Any],
        emit: Emit,
    ) -> None:
        """``config``: the run's config, saved with each step; ``target(plan)``: where a
        checkpoint of ``plan``'s run restores to (`Experiment.restore_target`)."""
        self.storage, self.settings, self.emit = storage, settings, emit
        self.every, self.steps, self.content = every, steps, content
        self.config, self.target = config, target
        self.ledger: ExpertLedger | None = None

    def meta(self, plan: Plan) -> dict[str, Any]:
        return {"plan": plan.to_dict(), "config": self.config}

    def on_resume(self, meta: dict[str, Any] | None, k_changed: bool) -> None:
        """The run starts from ``meta``'s checkpoint (None: from scratch). One that carries a
        ledger accounts the fault first: the ``checkpoint_recovery`` event with each expert's
        lost steps and tokens and the PLT (even if this run saves full checkpoints: the
        restored experts lost their updates all the same). ``k_changed``: a changed
        ``checkpoint.experts_per_save`` replaces the K the ledger carried (dynamic K's)."""
        if meta is None or "pec" not in meta:
            return
        ledger = self.settings.from_meta(meta["pec"])
        recovery = ledger.recover(expert_sources(meta, ledger))
        self.emit({**recovery.event(), "source": "storage"})
        log.info(
            "partial expert checkpoint: step %d lost %d of %d routed tokens (PLT %.4f, total "
            "%.4f)", recovery.step, recovery.event()["lost_tokens"], recovery.tokens,
            recovery.plt, recovery.total_plt,
        )
        if k_changed and self.settings.k:
            ledger.set_k(self.settings.k)
        self.ledger = ledger if self.settings.k else None

    def counted(self, done: int, metrics: dict[str, Any]) -> None:
        """The metrics of the step that made ``done`` steps reached the host (in step order,
        Δ steps late); a ledger counts its routed tokens and adds the PLT to ``metrics``."""

    def after_step(
        self, done: int, runtime: Runtime, plan: Plan, catch_up: Callable[[], None]
    ) -> None:
        """What runs after every step, before its evaluation."""

    def save(self, done: int, runtime: Runtime, plan: Plan, catch_up: Callable[[], None]) -> None:
        """Save after step ``done`` if it is due; ``catch_up()`` hands the host every step's
        metrics (a ledger's metadata counts every step up to the one saved)."""
        if done % self.every == 0 or done == self.steps:
            self._save(done, runtime, plan, catch_up)

    def save_now(
        self, done: int, runtime: Runtime, plan: Plan, catch_up: Callable[[], None]
    ) -> bool:
        """Save after step ``done`` whatever the schedule, every expert whole (a stop at a
        signal: nothing trained may be lost), and wait until it is written; True once storage
        lists it (saved now or before)."""
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
        """Save after step ``done``: K experts per MoE layer where a ledger selects them, all
        with ``whole``. Every step's metrics up to ``done`` are logged first, so a process
        killed right after the save leaves no step unlogged that the resumed run skips (and a
        ledger's metadata counts every step up to this one)."""
        meta, experts = self.meta(plan), None
        catch_up()
        if self.ledger is not None:
            experts = None if whole else self.ledger.select()
            meta["pec"] = self.ledger.meta_after(done, experts)
        started = self.storage.save(
            done, runtime.checkpoint_state(), meta, experts=experts, content=self.content
        )
        if started and self.ledger is not None:
            self.ledger.saved(done, experts)

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


class PartialExpertCheckpoints(WholeCheckpoints):
    """`WholeCheckpoints` that save K of the E experts of each MoE layer (seed 004 §3): the
    ledger counts every step's routed tokens, for the PLT and load-aware selection."""

    def on_resume(self, meta: dict[str, Any] | None, k_changed: bool) -> None:
        super().on_resume(meta, k_changed)
        if self.ledger is None and self.settings.k:
            self.ledger = self.settings.fresh(0 if meta is None else meta["step"])
        if self.ledger is not None:
            self.ledger.pinned = set(self.storage.all_steps())

    def counted(self, done: int, metrics: dict[str, Any]) -> None:
        if self.ledger is not None:  # every step's routed tokens, for PLT and load-aware saves
            self.ledger.count(done, metrics["moe/tokens_per_expert"])
            metrics[PLT] = self.ledger.plt


class TwoLevelCheckpoints(PartialExpertCheckpoints):
    """Snapshots to host memory every ``snapshot_every`` steps, persisted to storage every
    ``persist_every``, and the last step saved (`snapshot.TwoLevel`); a fault restores the
    newest snapshot from memory. With MoE layers a snapshot may copy K_snapshot experts."""

    def __init__(
        self,
        storage: Storage,
        settings: LedgerSettings,
        *,
        snapshot_every: int,
        persist_every: int,
        persist_experts: int,
        rounds: Rounds,
        **kwargs: Any,
    ) -> None:
        super().__init__(storage, settings, every=0, **kwargs)
        self.snapshot_every, self.persist_every = snapshot_every, persist_every
        self.twolevel = TwoLevel(
            settings.layers if settings.k else (),
            settings.num_experts,
            persist_experts=persist_experts,
            emit=self.emit,
            rounds=rounds,
        )

    def on_resume(self, meta: dict[str, Any] | None, k_changed: bool) -> None:
        if meta is not None:  # what storage holds of each expert: the restore's sources
            self.twolevel.persisted_step = meta["step"]
        super().on_resume(meta, k_changed)
        if meta is not None and self.ledger is not None:
            self.twolevel.stored = expert_sources(meta, self.ledger)

    def counted(self, done: int, metrics: dict[str, Any]) -> None:
        if self.ledger is not None:
            self.ledger.count(done, metrics["moe/tokens_per_expert"])
            self.twolevel.counted(done, self.ledger)
            metrics[PLT] = self.ledger.plt

    def after_step(
        self, done: int, runtime: Runtime, plan: Plan, catch_up: Callable[[], None]
    ) -> None:
        twolevel, ledger = self.twolevel, self.ledger
        twolevel.poll()
        if done % self.snapshot_every == 0:
            experts = None
            if ledger is not None and twolevel.partial_ok:
                experts = ledger.select(ahead=twolevel.ahead())
            twolevel.snapshot(done, runtime.checkpoint_state(), experts)
        if done % self.persist_every == 0 and done != self.steps:
            twolevel.persist(self.storage, self.target(plan), self.meta(plan), catch_up=catch_up)
            if self.ledger is not None:  # a restart reads these steps' rows
                self.ledger.pinned = {*self.storage.all_steps(), twolevel.persisted_step}

    def save(self, done: int, runtime: Runtime, plan: Plan, catch_up: Callable[[], None]) -> None:
        if done == self.steps:
            self._save(done, runtime, plan, catch_up)

    def recover(
        self, fault: Exception, step: int, plan: Plan, catch_up: Callable[[], None]
    ) -> tuple[int, Any] | None:
        """The newest snapshot every process holds, placed as ``plan``'s run places its state;
        the ledger goes back to its metadata at that step and accounts the lost steps."""
        target = self.target(plan)
        flat_target = layout.flatten(target)
        snap = self.twolevel.recovery(flat_target)
        if snap is None:  # no usable snapshot (in some process): the same
            return None
        log.warning("%s: %s; restoring the snapshot of step %d from host memory",
                    type(fault).__name__, fault, snap.step)
        catch_up()  # the steps that ran: the ledger reaches the snapshot
        state = layout.unflatten_like(target, snap.placed(flat_target))
        recovery = {"event": "checkpoint_recovery", "step": snap.step, "plt": 0.0}
        if self.ledger is not None:
            self.ledger = self.settings.from_meta(self.twolevel.ledger_of(snap))
            self.ledger.pinned = set(self.storage.all_steps())
            recovery = self.ledger.recover(snap.sources).event()
        self.emit({**recovery, "source": "memory", "fault_step": step + 1})
        self.twolevel.rolled_back(snap.step)
        return snap.step, state

    def finish(self) -> None:
        self.twolevel.poll(wait=True)

    def close(self) -> None:
        self.twolevel.close()
        super().close()
