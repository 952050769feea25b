"""Two-level checkpoints (MoC-System, seed 004 §5.1-§5.2; docs/checkpointing.md "Two levels"):
in-memory snapshots every few steps, persisted to storage every few snapshots, with triple
buffering.

- Snapshot (`TwoLevel.snapshot`, right after a step is dispatched): one jitted program copies
  the dense leaves and the row policy's K_snapshot rows per stack on the device, and
  ``copy_to_host_async`` starts their transfer. Dispatched before the next step, which donates
  the state, the copy needs no wait (seed 004 §2.3.1's "before the update" holds by stream
  order); a background thread fills a host buffer, taking the rows it did not copy from the
  newest complete snapshot (`Snapshot.sources`: each row's step).
- Triple buffering (§5.2, Fig. 13; `TripleBuffer`): a fill never takes the persist or the
  recovery buffer, and a buffer being filled is never handed out.
- Persist (every ``checkpoint.persist_every`` steps): the recovery buffer through
  `Checkpointer.save`, its K_persist rows whose storage copy is the oldest.
- Recovery: a process whose step raised (`InjectedFault`) restores the recovery buffer, newer
  than storage (lower PLT, §5.1); a restarted process reads storage.
- Several processes: each snapshots what it holds (`HostShards` for one program's shards), and
  persists and recoveries agree on one step (`TwoLevel.rounds`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dynjax.checkpoint import layout
from dynjax.checkpoint.rows import COPIED_EVENT, POLICY_META, RowPolicy, Rows, RowStacks
from dynjax.parallel.peers import ALONE, Rounds

FREE, SNAPSHOT, PERSIST, RECOVERY = "free", "snapshot", "persist", "recovery"


class InjectedFault(RuntimeError):
    """A fault raised by the training loop at ``checkpoint.inject_fault_at`` (once): stands in
    for a transient error of a step that the process survives (a device error, a NaN
    rollback), which recovers from its in-memory snapshot."""


Bounds = tuple[tuple[int, int], ...]  # a shard's [start, stop) along each axis


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> Bounds:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


@dataclasses.dataclass
class HostShards:
    """A global array of one program over several processes as this process holds it: a host
    copy of each distinct shard on its devices, by bounds. No host can hold such an array
    whole, so each process snapshots, restores and persists its own shards, as Orbax saves
    them."""

    shape: tuple[int, ...]
    dtype: np.dtype
    pieces: dict[Bounds, np.ndarray]

    @classmethod
    def of(cls, a: jax.Array) -> HostShards:
        pieces: dict[Bounds, np.ndarray] = {}
        for shard in a.addressable_shards:
            bounds = _bounds(shard.index, a.shape)
            if bounds not in pieces:  # a replica of one already copied
                pieces[bounds] = np.asarray(shard.data)
        return cls(tuple(a.shape), np.dtype(a.dtype), pieces)

    def with_rows(self, rows: Sequence[int], values: np.ndarray) -> HostShards:
        """A copy whose rows ``rows`` (axis 0) are ``values`` ([len(rows), ...], whole rows)."""
        pieces = {}
        for bounds, piece in self.pieces.items():
            piece = piece.copy()
            (start, stop), rest = bounds[0], tuple(slice(a, b) for a, b in bounds[1:])
            for value, row in zip(values, rows, strict=True):
                if start <= row < stop:
                    piece[row - start] = value[rest]
            pieces[bounds] = piece
        return HostShards(self.shape, self.dtype, pieces)

    def placed(self, sharding: jax.sharding.Sharding) -> jax.Array:
        """The global array, this process's shards placed as ``sharding`` (the snapshot's)."""
        return jax.make_array_from_callback(
            self.shape, sharding, lambda index: self.pieces[_bounds(index, self.shape)]
        )


def _on_host(a: jax.Array) -> np.ndarray | HostShards:
    """The host copy of a snapshot's device copy: whole where this process holds all of it."""
    return np.asarray(a) if a.is_fully_addressable else HostShards.of(a)


@dataclasses.dataclass
class Snapshot:
    """One host buffer: the whole state at ``step`` as host arrays (this process's shards of
    the global arrays of a program over several processes), flat by `layout` key."""

    step: int = -1
    arrays: dict[str, np.ndarray | HostShards] = dataclasses.field(default_factory=dict)
    sources: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # stack -> [rows] steps
    fresh: dict[int, list[int]] | None = None  # rows copied at ``step`` (None: all)

    def placed(self, target: Any, copy: bool = True) -> dict[str, Any]:
        """Its arrays by key, placed as ``target`` (flat ShapeDtypeStructs) says, or kept as
        host copies (``copy``; the buffer stays as it is) for the runtime to place; a
        process's shards are always placed (no host has them whole)."""
        out, host = {}, []
        for key, a in self.arrays.items():
            if isinstance(a, HostShards):
                out[key] = a.placed(target[key].sharding)
            elif copy:
                out[key] = np.array(a)
            else:
                host.append(key)
        shardings = [target[k].sharding for k in host]
        out.update(zip(host, jax.device_put([self.arrays[k] for k in host], shardings),
                       strict=True))
        return out


class TripleBuffer:
    """Three `Snapshot` buffers and their roles (module docstring). Thread-safe: a writer thread
    fills, the training loop persists and recovers."""

    def __init__(self) -> None:
        self.buffers = [Snapshot() for _ in range(3)]
        self.roles: list[set[str]] = [set() for _ in range(3)]
        self._lock = threading.Lock()

    def begin_fill(self) -> Snapshot:
        """A buffer to fill: one that is neither being filled, persisted nor the recovery one."""
        with self._lock:
            if any(SNAPSHOT in r for r in self.roles):
                raise RuntimeError("a snapshot is being filled: complete it first")
            i = next(i for i, r in enumerate(self.roles) if not r & {PERSIST, RECOVERY})
            self.roles[i] = {SNAPSHOT}
            return self.buffers[i]

    def complete(self, buffer: Snapshot) -> None:
        """``buffer`` is filled: it becomes the recovery buffer."""
        with self._lock:
            i = self._index(buffer)
            if SNAPSHOT not in self.roles[i]:
                raise RuntimeError("complete() of a buffer that is not being filled")
            for r in self.roles:
                r.discard(RECOVERY)
            self.roles[i] = {RECOVERY}

    def abandon(self, buffer: Snapshot) -> None:
        """A fill that failed: the buffer is free again (its contents are never handed out)."""
        with self._lock:
            self.roles[self._index(buffer)] = set()

    def recovery(self) -> Snapshot | None:
        """The newest complete snapshot, or None before the first."""
        with self._lock:
            return self._with(RECOVERY)

    def begin_persist(self) -> Snapshot | None:
        """The recovery buffer, marked persist until `end_persist` (None: none complete, or a
        persist is in progress)."""
        with self._lock:
            if any(PERSIST in r for r in self.roles):
                return None
            for b, r in zip(self.buffers, self.roles, strict=True):
                if RECOVERY in r:
                    r.add(PERSIST)
                    return b
            return None

    def persisting(self) -> Snapshot | None:
        with self._lock:
            return self._with(PERSIST)

    def end_persist(self, buffer: Snapshot) -> None:
        with self._lock:
            self.roles[self._index(buffer)].discard(PERSIST)

    def _with(self, role: str) -> Snapshot | None:
        pairs = zip(self.buffers, self.roles, strict=True)
        return next((b for b, r in pairs if role in r), None)

    def _index(self, buffer: Snapshot) -> int:
        return next(i for i, b in enumerate(self.buffers) if b is buffer)


@jax.jit
def _device_copy(
    dense: dict[str, jax.Array], stacked: dict[str, jax.Array], rows: dict[str, jax.Array]
) -> dict[str, jax.Array]:
    """New buffers holding ``dense`` and rows ``rows[key]`` of each ``stacked[key]``: one
    program, so a snapshot dispatches once per device set."""
    out = {k: jnp.copy(a) for k, a in dense.items()}
    out.update({k: a[rows[k]] for k, a in stacked.items()})
    return out


@dataclasses.dataclass
class _Pending:
    step: int
    fresh: dict[int, list[int]] | None
    filled: Future
    stall: float


class TwoLevel:
    """The snapshot and persist levels of one training process (module docstring).

    ``stacks``: which leaves are row-stacked; ``ids``/``rows``: the stacks a row policy
    selects in and their rows per stack (none: snapshots copy every row, e.g. a dense model,
    whose snapshots hold the dense state only); ``persist_k``: rows per stack per persist (0:
    all its snapshot copied). ``emit`` writes events. ``rounds``: the run's other processes,
    each snapshotting the arrays (or shards) it holds.
    """

    def __init__(
        self,
        stacks: RowStacks,
        ids: Sequence[int],
        rows: int,
        *,
        persist_k: int,
        emit: Callable[[dict[str, Any]], None],
        rounds: Rounds = ALONE,
    ):
        self.stacks, self.ids, self.rows = stacks, tuple(ids), rows
        self.rounds = rounds  # the run's processes: they persist and recover the same step
        self.persist_k = persist_k
        self.emit = emit
        self.buffers = TripleBuffer()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="snapshot")
        self._pending: list[_Pending] = []  # fills started, their events not yet written
        self._uncounted: dict[int, dict[int, list[int]] | None] = {}  # step -> fresh rows
        self._policies: dict[int, dict[str, Any]] = {}  # snapshot step -> policy metadata
        # Per stack, the step of each row's newest copy in storage (-1: none).
        self.stored = {stack: [-1] * rows for stack in self.ids}
        self.persisted_step = -1
        self.stalls: list[float] = []  # seconds the loop spent in each `snapshot`

    @property
    def partial_ok(self) -> bool:
        """Whether the next snapshot may copy only some rows: once every row has a copy
        in storage (so a persist writes only what its snapshot copied at its step) and one in
        memory (a full snapshot taken: the others come from it)."""
        in_memory = bool(self._pending) or self.buffers.recovery() is not None
        return in_memory and all(s >= 0 for v in self.stored.values() for s in v)

    # -- snapshot level -----------------------------------------------------------------------

    def snapshot(self, step: int, state: Any, chosen_rows: Rows | None) -> None:
        """Start the snapshot of ``state`` (the step's output, about to be donated by the next
        step) at ``step``: device copies, then their asynchronous transfer to host. Blocks only
        if the previous snapshot is still being filled (that wait is the stall counted)."""
        start = time.perf_counter()
        if self._pending:  # one fill at a time: wait for the previous transfer
            self._pending[-1].filled.result()
        items = layout.split(state, self.stacks)
        fresh = None if chosen_rows is None else {int(k): sorted(v) for k, v in chosen_rows.items()}
        groups: dict[frozenset, tuple[dict, dict, dict]] = {}  # one program per device set
        copies = {}
        for name, leaves in items.items():  # (a pipeline stage's sub-mesh)
            for key, a in leaves.items():
                dense, stacked, rows = groups.setdefault(
                    frozenset(a.sharding.device_set), ({}, {}, {})
                )
                if name == layout.DENSE:
                    dense[key] = a
                    continue
                chosen = range(a.shape[0]) if fresh is None else fresh[self.stacks.stack_of(key)]
                if fresh is not None and not a.is_fully_addressable:
                    # Over processes: the rows replicated, so that every process has them whole.
                    copies[key] = layout.take_rows(a, chosen, everywhere=True)
                    continue
                stacked[key] = a
                rows[key] = np.asarray(list(chosen), np.int32)
        copies.update({k: c for g in groups.values() for k, c in _device_copy(*g).items()})
        for a in copies.values():
            a.copy_to_host_async()
        buffer = self.buffers.begin_fill()
        filled = self._worker.submit(self._fill, buffer, step, copies, fresh)
        if self.ids:
            self._uncounted[step] = fresh
        stall = time.perf_counter() - start
        self.stalls.append(stall)
        self._pending.append(_Pending(step, fresh, filled, stall))

    def _fill(
        self, buffer: Snapshot, step: int, copies: dict[str, jax.Array], fresh: Any
    ) -> float:
        """Writer thread: the host copies into ``buffer``, the rows not copied taken from
        the newest complete snapshot (the recovery buffer: never overwritten meanwhile); then
        ``buffer`` becomes the recovery buffer."""
        start = time.perf_counter()
        try:
            base = self.buffers.recovery()
            for key, a in copies.items():
                stack = self.stacks.stack_of(key)
                if stack is None or fresh is None:
                    host = _on_host(a)
                    if isinstance(host, HostShards):
                        buffer.arrays[key] = host
                        continue
                    out = buffer.arrays.get(key)
                    reusable = isinstance(out, np.ndarray) and out.shape == host.shape
                    if not reusable or out.dtype != host.dtype:
                        buffer.arrays[key] = out = np.empty_like(host)
                    np.copyto(out, host)
                    continue
                if base is None or key not in base.arrays:
                    raise RuntimeError(f"partial snapshot of {key} without a full one before it")
                host = np.asarray(a)  # the rows, whole in every process (`snapshot`)
                if isinstance(base.arrays[key], HostShards):
                    buffer.arrays[key] = base.arrays[key].with_rows(fresh[stack], host)
                    continue
                out = buffer.arrays.get(key)
                if out is None or out.shape != base.arrays[key].shape:
                    buffer.arrays[key] = out = np.empty_like(base.arrays[key])
                np.copyto(out, base.arrays[key])
                out[fresh[stack]] = host
            buffer.step, buffer.fresh = step, fresh
            buffer.sources = {}
            for stack in self.ids:
                old = base.sources[stack] if base is not None and fresh is not None else None
                rows = set(range(self.rows)) if fresh is None else set(fresh[stack])
                buffer.sources[stack] = [step if r in rows else old[r] for r in range(self.rows)]
        except BaseException:
            self.buffers.abandon(buffer)
            raise
        self.buffers.complete(buffer)
        return time.perf_counter() - start

    def counted(self, step: int, policy: RowPolicy) -> None:
        """The row policy has counted ``step``: if a snapshot was taken there, record it in the
        policy (a copy of its rows in memory) and keep the policy's metadata for it."""
        if step in self._uncounted:
            policy.saved(step, self._uncounted.pop(step))
            self._policies[step] = policy.to_meta()
            held = {b.step for b in self.buffers.buffers} | {p.step for p in self._pending}
            self._policies = {s: m for s, m in self._policies.items() if s in held}

    def ahead(self) -> int:
        """Partial snapshots whose step the policy has not counted yet (`RowPolicy.select`)."""
        return sum(fresh is not None for fresh in self._uncounted.values())

    def policy_of(self, snap: Snapshot) -> dict[str, Any] | None:
        """The row policy's metadata as of ``snap``'s step (None: not counted yet, or no
        policy)."""
        return self._policies.get(snap.step)

    def poll(self, wait: bool = False) -> None:
        """Write a ``snapshot`` event for each fill done (``wait``: wait for them all)."""
        while self._pending and (wait or self._pending[0].filled.done()):
            p = self._pending.pop(0)
            fill_seconds = p.filled.result()
            copied = None if p.fresh is None else {str(k): v for k, v in p.fresh.items()}
            self.emit(
                {
                    "event": "snapshot",
                    "step": p.step,
                    COPIED_EVENT: copied,
                    "stall_seconds": round(p.stall, 6),
                    "fill_seconds": round(fill_seconds, 6),
                }
            )

    def _settle(self) -> None:
        """Wait for every fill started (one that failed abandoned its buffer)."""
        for p in self._pending:
            try:
                p.filled.result()
            except Exception:  # noqa: BLE001 - its buffer was abandoned: not handed out
                pass

    def recovery(self, keys: Collection[str]) -> Snapshot | None:
        """The newest complete snapshot, once every fill started has ended (a fault's
        recovery), if it holds exactly ``keys`` (the leaves this process now holds: a layer
        may have moved to another process's stage since). Over several processes, None unless
        every process's is usable and of the same step (they then restart from storage)."""
        self._settle()
        self._pending.clear()
        snap = self.buffers.recovery()
        usable = snap is not None and set(snap.arrays) == set(keys)
        steps = self.rounds.all(snap.step if usable else None)
        return snap if usable and len(set(steps)) == 1 else None

    def rolled_back(self, step: int) -> None:
        """After recovering to ``step``: forget the snapshots of the later steps."""
        self._uncounted = {s: f for s, f in self._uncounted.items() if s <= step}

    # -- persist level ------------------------------------------------------------------------

    def persist_rows(self, snap: Snapshot) -> dict[int, list[int]] | None:
        """The rows the persist of ``snap`` writes per stack: K_persist of those it copied at
        its step, the ones whose storage copy is the oldest first (None: all)."""
        if not self.ids or snap.fresh is None and not self.persist_k:
            return None
        out = {}
        for stack in self.ids:
            rows = list(range(self.rows)) if snap.fresh is None else snap.fresh[stack]
            k = self.persist_k or len(rows)
            out[stack] = sorted(sorted(rows, key=lambda r: (self.stored[stack][r], r))[:k])
        return out

    def persist(
        self,
        checkpointer: Any,
        target: Any,
        meta: dict[str, Any],
        catch_up: Callable[[], None],
    ) -> bool:
        """Write the recovery buffer to storage through ``checkpointer`` (if it is newer than
        the last persist and no persist is in progress), placed as ``target`` (the restore
        target's ShapeDtypeStructs) says; ``catch_up()`` makes the row policy count the steps
        through the snapshot's if it has not yet. Returns whether a save was started.

        Over several processes every process must write the same step (one collective save,
        or the parts of one step), so a persist first waits for the fills in flight and the
        previous save, and is skipped by all unless all hold the same newest snapshot."""
        if self.rounds.count > 1:
            self._settle()
            checkpointer.wait()
        self._finish_persist(checkpointer)
        snap = self.buffers.begin_persist()
        steps = self.rounds.all(None if snap is None else snap.step)
        if snap is None:
            return False
        if snap.step <= self.persisted_step or len(set(steps)) > 1:
            self.buffers.end_persist(snap)
            return False
        if self.ids and snap.step not in self._policies:
            catch_up()
        placed = snap.placed(layout.flatten(target), copy=False)
        rows = self.persist_rows(snap)
        meta = dict(meta)
        if self.ids:
            meta[POLICY_META] = self._policies[snap.step]
        started = checkpointer.save(
            snap.step,
            layout.unflatten_like(target, placed),
            meta,
            rows=rows,
        )
        # What storage holds must be alike in every process: they choose the next partial
        # snapshots from it.
        started = all(self.rounds.all(started))
        if not started:
            self.buffers.end_persist(snap)
            return False
        self.persisted_step = snap.step
        for stack in self.ids:
            for r in range(self.rows) if rows is None else rows[stack]:
                self.stored[stack][r] = snap.sources[stack][r]
        self._finish_persist(checkpointer)
        return True

    def _finish_persist(self, checkpointer: Any) -> None:
        snap = self.buffers.persisting()
        if snap is not None and not checkpointer.saving():
            self.buffers.end_persist(snap)

    def close(self) -> None:
        self._worker.shutdown(wait=True)
