"""Asynchronous, atomic, verified checkpoints on top of Orbax's CheckpointManager
(docs/checkpointing.md).

- Save: the run's ``jax.Array``s go to Orbax as they are (`layout`: three items); Orbax copies
  each device's shards to host before ``save`` returns, writes them in the background into a
  temporary directory and renames it when complete, so a killed process never leaves a
  checkpoint that looks finished. Checksums are computed on the devices (`layout.checksums`).
- Restore: each shard straight onto its device in the target's shardings (the current run's:
  another mesh or stage count reshards), checksums verified there. An unreadable or unverified
  step is moved to ``corrupt/<step>-<time>`` and the previous one used; one that does not fit
  the model is an error, never moved. Layout 1 still restores, through host memory.
- Partial saves (seed 004 §3, any row-stacked leaves, `rows.RowStacks`): K rows per stack, of
  the weights, the optimizer state or both (``content`` W / O / WO); `restore_latest`
  assembles each row's newest copy, a step stays while it holds one (`_NewestCopies`), and a
  save never leaves a row without a copy.
- Several processes (issue 15 §4, issue 13 §5): each writes its devices' shards into its
  ``ocdbt.process_<i>`` part (replicated leaves replica-parallel), process 0 the metadata; they
  agree before a step is moved aside. A pipeline over processes saves one part per process
  instead (``part``, `dynjax.checkpoint.parts`).
"""

from __future__ import annotations

import errno
import logging
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from dynjax.checkpoint import layout
from dynjax.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatch,
    NoSpaceError,
    RowsMissing,
)
from dynjax.checkpoint.handlers import part_handlers, whole_handlers
from dynjax.checkpoint.read import META, Copies, StepReader, everywhere
from dynjax.checkpoint.rows import (
    CONTENTS,
    ROW,
    ROWS_META,
    SAVED_EVENT,
    STACK,
    Rows,
    RowStacks,
    row_group,
)

log = logging.getLogger(__name__)
QUARANTINE = "corrupt"  # beside the steps; Orbax lists only integer step directories


class _NewestCopies:
    """Orbax preservation policy: keep the ``keep`` newest steps and every step holding the
    newest saved copy of some (row-stacked leaf, row), so that `Checkpointer.restore_latest`
    finds every row's newest copy (seed 004 §3: a partial step alone does not hold the model).

    Orbax asks it inside ``CheckpointManager.save``, after listing the new step, and deletes
    what it refuses once the new step is committed (a failed save deletes nothing)."""

    def __init__(self, keep: int, copies: Callable[[int], Copies]):
        self.keep, self.copies = keep, copies

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        order = sorted(range(len(checkpoints)), key=lambda i: -checkpoints[i].step)
        keep, seen = [False] * len(checkpoints), set()
        for rank, i in enumerate(order):
            held = {(k, r) for k, rows in self.copies(checkpoints[i].step).items() for r in rows}
            keep[i] = rank < self.keep or not held <= seen
            seen |= held
        return keep


class Checkpointer:
    """Save and restore ``{"params": ..., "opt_state": ...}`` plus JSON metadata per step;
    ``stacks``: which leaves are row-stacked (`NO_ROWS`: none)."""

    def __init__(
        self,
        directory: Path,
        *,
        keep: int,
        stacks: RowStacks,
        async_save: bool = True,
        emit: Callable[[dict[str, Any]], None] = lambda event: None,
        part: int | None = None,
    ):
        """``part``: this process's part of a pipeline over processes (`dynjax.checkpoint.parts`),
        written by this process alone (`_lift`); `parts.Sources` reads it back."""
        self.emit, self.part, self.stacks = emit, part, stacks
        self.directory, self._async = Path(directory).absolute(), async_save
        self._copies: dict[int, Copies] = {}
        # The save being written: its checkpoint event, when it started, the copies it replaced.
        self._pending: tuple[dict[str, Any], float, Copies | None] | None = None
        extra, handlers, registry = {}, None, whole_handlers()
        if part is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)  # Orbax creates none for a subset
            if jax.process_count() > 1:
                alone = ocp.options.MultiprocessingOptions(
                    primary_host=part,
                    active_processes={part},
                    barrier_sync_key_prefix=f"part_{part}",
                )
                extra, handlers = {"multiprocessing_options": alone}, part_handlers(alone)
                # Orbax's asynchronous directory creation signals its completion under a key
                # of the save's operation id alone (`awaitable_signals_contract_<id>/...` in
                # the shared coordination service), and each process's saves count ids from
                # 1: two processes saving their parts share the keys, and the first to finish
                # deletes them while the other may still wait on them, forever (the hang of a
                # two-process run at its end). Created before the save starts, nothing waits.
                extra["async_options"] = ocp.options.AsyncOptions(
                    create_directories_asynchronously=False
                )
                registry = None
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=async_save,
            create=part is None,
            preservation_policy=_NewestCopies(keep, lambda step: self._copies.get(step, {})),
            **extra,
        )
        self._lifted = handlers is not None
        self._manager = ocp.CheckpointManager(
            Path(directory).absolute(),
            options=options,
            item_handlers=handlers,
            handler_registry=registry,
        )
        self._reader = StepReader(self._manager, stacks, emit)
        for step in self.all_steps():
            try:
                self._copies[step] = layout.held_rows(self._reader.read_meta(step))
            except Exception:  # noqa: BLE001 - unreadable: holds nothing a restore can use
                self._copies[step] = {}

    def all_steps(self) -> list[int]:
        return self._reader.all_steps()

    def save(
        self,
        step: int,
        state: Any,
        meta: dict[str, Any],
        rows: Rows | None = None,
        content: str = "WO",
    ) -> bool:
        """Start saving ``state`` (a pytree of jax.Arrays) at ``step``; returns once each
        device's shards are copied to host (the next step may donate the arrays).

        ``rows`` (stack -> rows; None: all) saves only those rows of each stack (seed 004 §3)
        for the leaves ``content`` names: ``"W"`` the rows' weights, ``"O"`` their optimizer
        state, ``"WO"`` both; the other leaves and the dense item are whole. The chosen rows
        are gathered on the devices that hold them, and a row of which no step on disk holds a
        copy (a first save, or after a quarantine) is saved too, so that every checkpoint
        restores; the ``checkpoint`` event lists the rows saved (`rows.SAVED_EVENT`).

        Returns whether the save was started. Its ``checkpoint`` event is written once the
        save is complete and listed on disk (`poll`, `wait`, the next save or `close`); a save
        Orbax refuses (the step exists, or is not newer than the latest) or that fails, now or
        while written in the background, is a ``checkpoint_failed`` event naming its own step
        and cause, and a warning: training goes on and later saves are still tried, unless the
        filesystem is full (`NoSpaceError`).
        """
        self._settle()  # the previous save's outcome is its own, not this one's
        start = time.perf_counter()
        items = layout.split(state, self.stacks)
        held = self._rows_to_save(items[layout.ROWS], rows, content)
        recorded = {
            k: {"of": int(a.shape[0]), "rows": list(held[k])} for k, a in items[layout.ROWS].items()
        }
        items[layout.ROWS] = {
            k: a if held[k] == tuple(range(a.shape[0])) else layout.take_rows(a, held[k])
            for k, a in items[layout.ROWS].items()
        }
        flat = {**items[layout.DENSE], **items[layout.ROWS]}
        meta = {
            **meta,
            "step": step,
            "layout": layout.LAYOUT,
            "qkv_columns": layout.QKV_COLUMNS,
            "checksums": layout.checksums(flat, self.stacks),
            ROWS_META: recorded,
        }
        previous, args = self._copies.get(step), {}
        self._copies[step] = held  # what the preservation policy weighs during the save
        try:
            args = self._save_args(items)
            started = self._manager.save(
                step, args=ocp.args.Composite(**args, **{META: ocp.args.JsonSave(meta)})
            )
            error = None if started else (
                f"Orbax refused it: steps {self.all_steps()} are on disk and a save must be "
                "newer than the latest"
            )
        except Exception as err:  # noqa: BLE001 - a failed save must not end the run
            started, error = False, err
        nbytes = int(sum(a.nbytes for a in flat.values()))
        if not started:
            self._failed(step, error, nbytes, previous)
            return False
        saved: dict[str, list[int]] = {}
        for key, kept in held.items():
            if row_group(key) in CONTENTS[content]:
                saved.setdefault(str(self.stacks.stack_of(key)), list(kept))
        event = {
            "event": "checkpoint",
            "step": step,
            "items": len(args) + 1,
            "bytes": nbytes,
            SAVED_EVENT: saved,
            "pec_content": content,
            "blocking_seconds": round(time.perf_counter() - start, 4),
        }
        self._pending = (event, start, previous)
        if not self._async:
            self._settle()
        return True

    def poll(self) -> None:
        """Write the ``checkpoint`` event (or ``checkpoint_failed``) of a save that has finished
        in the background; never waits for one."""
        if self._pending is not None and not self.saving():
            self._settle()

    def _settle(self) -> None:
        """Wait for the pending save and record how it ended: ``checkpoint`` once the step is
        listed on disk, else ``checkpoint_failed`` with its own error."""
        if self._pending is None:
            return
        event, start, previous = self._pending
        self._pending = None
        step, error = event["step"], None
        try:
            self._manager.wait_until_finished()
        except Exception as err:  # noqa: BLE001 - the background write's own failure
            error = err
        if error is None and not (self.directory / str(step)).is_dir():
            error = "the save did not complete: its step directory is not on disk"
        if error is not None:
            self._failed(step, error, event["bytes"], previous)
            return
        self.emit({**event, "write_seconds": round(time.perf_counter() - start, 4)})

    def _failed(
        self, step: int, error: BaseException | str, nbytes: int, previous: Copies | None
    ) -> None:
        """A save of ``step`` that did not happen: its rows are not held on disk, what it left
        half-written is removed, and a full filesystem that could not take it now either ends
        the run (`NoSpaceError`)."""
        if previous is None:
            self._copies.pop(step, None)
        else:
            self._copies[step] = previous
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        log.warning("checkpoint at step %d was not saved: %s", step, text)
        self.emit({"event": "checkpoint_failed", "step": step, "error": text})
        if not isinstance(error, str) and _no_space(error):
            good = [s for s in self.all_steps() if s != step]
            _after_no_space(self.directory, step, nbytes, good)

    def _save_args(self, items: dict[str, dict[str, jax.Array]]) -> dict[str, Any]:
        """Orbax's arguments for each non-empty item (a state without row-stacked leaves has no
        `layout.ROWS` item; a part of a process with no stage has neither)."""
        # One storage chunk per row: a later read of a few rows touches only theirs.
        per_row = ocp.SaveArgs(shard_axes=(0,))
        chunks = {layout.ROWS: layout.nest({k: per_row for k in items[layout.ROWS]})}
        save = ocp.args.StandardSave
        if self._lifted:
            others = [d for d in jax.devices() if d.process_index != jax.process_index()]
            items = {n: {k: _lift(a, others) for k, a in i.items()} for n, i in items.items()}
            save = ocp.args.PyTreeSave
        return {
            name: save(layout.nest(item), save_args=chunks.get(name))
            for name, item in items.items()
            if item
        }

    def _rows_to_save(
        self, leaves: Mapping[str, Any], rows: Rows | None, content: str
    ) -> Copies:
        """Per row-stacked leaf, the rows this save writes (see `save`)."""
        if content not in CONTENTS:
            raise ValueError(f"content={content!r}: use one of {sorted(CONTENTS)} (seed 004 §3)")
        counts = {self.stacks.stack_of(k): int(a.shape[0]) for k, a in leaves.items()}
        if rows is not None:
            if set(rows) != set(counts):
                raise ValueError(
                    f"rows names {STACK}s {sorted(rows)}, the state has {sorted(counts)}: give "
                    f"the rows to save for each {STACK} (or rows=None for all)"
                )
            for stack, chosen in rows.items():
                bad = [r for r in chosen if not 0 <= r < counts[stack]]
                if bad or not chosen or len(set(chosen)) != len(chosen):
                    raise ValueError(
                        f"{ROW}s[{stack}] = {list(chosen)}: give distinct rows in "
                        f"[0, {counts[stack]}), at least one"
                    )
        have = {(k, r) for copies in self._copies.values() for k, rs in copies.items() for r in rs}
        chosen_rows: dict[int, set[int]] = {}
        for key in leaves:
            stack = self.stacks.stack_of(key)
            if rows is None:
                chosen_rows[stack] = set(range(counts[stack]))
                continue
            picked = chosen_rows.setdefault(stack, set(rows[stack]))
            if row_group(key) in CONTENTS[content]:
                picked |= {r for r in range(counts[stack]) if (key, r) not in have}
        return {
            k: tuple(sorted(chosen_rows[self.stacks.stack_of(k)]))
            if row_group(k) in CONTENTS[content]
            else tuple(range(int(a.shape[0])))
            for k, a in leaves.items()
        }

    def restore_latest(
        self, target: Callable[[dict[str, Any]], Any]
    ) -> tuple[Any, dict[str, Any]] | None:
        """Newest checkpoint that restores and verifies, as (state, meta); None if none exist.

        ``target(meta)`` gives, for each candidate's metadata and before any array is read,
        the tree to restore into: ``jax.ShapeDtypeStruct``s whose shardings say where each
        shard goes. What it raises (e.g. a config the checkpoint cannot serve) propagates and
        moves nothing. A checkpoint whose metadata or dense part fails to read or verify is
        quarantined and the previous one is tried.

        Each row comes from the newest step up to that one that saved it (`restore`);
        ``meta[rows.SOURCES]`` says which.
        """
        steps = self.all_steps()
        for step in reversed(steps):
            try:
                meta, error = self._reader.read_meta(step), None
            except Exception as err:  # noqa: BLE001 - unreadable metadata: a broken checkpoint
                meta, error = None, err
            if not everywhere(error is None):
                self._quarantine(step, error or CheckpointError("another process cannot read it"))
                continue
            template = target(meta)
            try:
                state, error = self._reader.restore_items(step, template, meta), None
            except (CheckpointMismatch, RowsMissing):
                raise
            except Exception as err:  # noqa: BLE001 - any failure means: fall back to an older one
                state, error = None, err
            if everywhere(error is None):
                return state, meta
            self._quarantine(step, error or CheckpointError("another process cannot read it"))
        if steps:
            raise CheckpointError(
                f"none of the checkpoints {steps} in {self._manager.directory} could be restored; "
                f"they are kept in {self._manager.directory / QUARANTINE}: see the warnings "
                "above, or start from a new workdir"
            )
        return None

    def restore(self, step: int, template: Any) -> tuple[Any, dict[str, Any]]:
        """The state as of ``step`` (nothing moved), as (state, meta), placed with
        ``template``'s shardings: its dense part from ``step``, each row of a row-stacked leaf
        (weights and optimizer state separately) from the newest step up to ``step`` that holds
        a copy that reads and verifies.

        ``meta[rows.SOURCES]`` is ``{stack: {"weights": [step per row], "optimizer":
        [...]}}``. A copy of a row that fails to read or verify is a warning and a
        `rows.FALLBACK_EVENT` event, and the copy before it is used. The step that held it is
        not moved aside: its dense part and its other rows are the newest state there is, and
        the one lost row costs only its updates since its previous copy (the loss PEC accepts
        by design, seed 004 §3.1.2), where moving the step aside would roll every row back. A
        row with no usable copy is `RowsMissing`.
        """
        meta = self._reader.read_meta(step)
        return self._reader.restore_items(step, template, meta), meta

    def restore_rows(self, step: int, key: str, rows: Sequence[int]) -> np.ndarray:
        """Rows ``rows`` of the row-stacked leaf ``key`` at ``step``, verified
        (`StepReader.read_rows`)."""
        return self._reader.read_rows(step, key, rows)

    def _quarantine(self, step: int, err: Exception) -> None:
        """Move the unusable checkpoint at ``step`` aside (never delete what a run trained):
        process 0 moves it, and the others wait for it."""
        root = Path(self._manager.directory)
        target = quarantine_target(root, step)
        if jax.process_index() == 0:
            target.parent.mkdir(exist_ok=True)
            shutil.move(str(root / str(step)), str(target))
        if jax.process_count() > 1:  # the name process 0 chose, once it is moved
            name = np.zeros(256, np.uint8)
            name[: len(target.name)] = np.frombuffer(target.name.encode(), np.uint8)
            name = np.asarray(multihost_utils.broadcast_one_to_all(name))
            target = target.parent / bytes(name[name > 0]).decode()
        self._manager.reload()
        self._copies.pop(step, None)
        log.warning(
            "checkpoint at step %d is unusable (%s); moved it to %s and trying the previous one",
            step,
            err,
            target,
        )
        self.emit(
            {
                "event": "checkpoint_restore_failed",
                "step": step,
                "error": str(err),
                "moved_to": str(target),
            }
        )

    def reload(self) -> None:
        """Re-list the steps on disk after another process moved some aside (`parts`)."""
        self._manager.reload()
        steps = set(self.all_steps())
        self._copies = {s: c for s, c in self._copies.items() if s in steps}

    def wait(self) -> None:
        """Wait until the pending save is written (and its event recorded)."""
        self._settle()

    def saving(self) -> bool:
        """Whether an asynchronous save is still being written."""
        return bool(self._manager.is_saving_in_progress())

    def close(self) -> None:
        try:
            self._settle()
        finally:
            self._manager.close()


def _after_no_space(directory: Path, step: int, nbytes: int, good: list[int]) -> None:
    """After a save of ``step`` ran out of space: remove what it left half-written, and raise
    `NoSpaceError` if another checkpoint of ``nbytes`` cannot fit now (``good``: the steps on
    disk, the newest of which the message names)."""
    for unfinished in directory.glob(f"{step}.orbax-checkpoint-tmp*"):
        log.warning("removing the unfinished save %s", unfinished)
        shutil.rmtree(unfinished, ignore_errors=True)
    free = shutil.disk_usage(directory).free
    if free >= nbytes:
        return
    newest = (f"the newest good checkpoint is step {good[-1]} in {directory}" if good
              else "no checkpoint was saved")
    raise NoSpaceError(
        f"the filesystem of {directory} is full: a checkpoint needs about "
        f"{nbytes / 2**20:.1f} MiB and {free / 2**20:.1f} MiB are free; {newest}. Free space "
        "there (or lower train.keep_checkpoints) and rerun to resume"
    )


def _no_space(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a full filesystem (ENOSPC)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _lift(array: jax.Array, others: Sequence[jax.Device]) -> jax.Array:
    """``array`` (on this process's devices only) as an array Orbax saves in a run of several
    processes, with no copy.

    Orbax's ``ArrayHandler`` refuses an array one process holds whole when several processes
    run (it takes it for a pmap-style host-local value), and a pipeline stage's arrays are
    such. Here the array's mesh gains a leading ``part`` axis of 2 whose second row is other
    processes' devices: the array now spans processes, this process holds replica 0 of every
    shard (what `handlers.part_handlers` writes), and the other row is never materialised or
    read."""
    sharding = array.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        raise TypeError(f"a part saves arrays on named shardings, not {sharding}")
    devices = sharding.mesh.devices
    row = np.asarray(others[: devices.size], dtype=object).reshape(devices.shape)
    mesh = jax.sharding.Mesh(np.stack([devices, row]), ("part", *sharding.mesh.axis_names))
    lifted = jax.sharding.NamedSharding(mesh, sharding.spec)
    return jax.make_array_from_single_device_arrays(
        array.shape, lifted, [shard.data for shard in array.addressable_shards]
    )


def quarantine_target(directory: Path, step: int) -> Path:
    """Where ``directory``'s unusable step goes: ``corrupt/<step>-<time>``, a free name."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    target = directory / QUARANTINE / f"{step}-{stamp}"
    n = 1
    while target.exists():
        n, target = n + 1, directory / QUARANTINE / f"{step}-{stamp}-{n}"
    return target


