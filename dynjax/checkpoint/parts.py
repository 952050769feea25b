"""Checkpoints of a pipeline over processes: one part per process (issue 15 §4).

Across processes Orbax saves only global arrays (its ``ArrayHandler`` refuses an array that one
process holds whole), and a pipeline stage's arrays live on its own process's devices only. So
each process writes the leaves of its own stages, shard by shard from its devices, into its own
part, ``checkpoints/process_<p>/`` (a `Checkpointer` in part mode: an Orbax manager of that
process alone, with the same atomic commit, checksums and ``keep``), and records ``parts`` (the
process count) in the step's metadata. A step is complete when every part holds it; no process waits
for another to save.

A restore (`Sources`) reads each leaf it needs from whichever source of a step holds it: a part
of a complete step, or a whole checkpoint written by one program (``checkpoints/<step>``,
`Checkpointer`), so a run resumes on another process, stage or device count; each leaf is
verified against the checksum its writer recorded. The processes agree on every step they try
(`Peers`); an unusable step, and the parts of a step some process never finished, are moved
aside to ``corrupt/`` (never deleted), which also frees their step numbers for later saves.

Partial saves of row-stacked leaves (seed 004 §3): every process's row policy chooses the same
rows per stack and each part saves those of its own stages' stacks (a part that has never saved
a stack, e.g. after a migration brought its layer there, saves all its rows once). A restore
takes each row from the newest complete step up to the restored one whose source holding the
stack then has a copy that verifies, which may be another process's part than the newest
step's when the layer has moved between processes since.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from dynjax.checkpoint import layout
from dynjax.checkpoint.errors import CheckpointError, CheckpointMismatch, RowsMissing
from dynjax.checkpoint.manager import Checkpointer, quarantine_target
from dynjax.checkpoint.read import META, Slot, check_fits, qkv_columns_per_head, resolve_slot
from dynjax.checkpoint.rows import SOURCES, Rows, RowStacks, row_group
from dynjax.parallel.peers import Peers, Rounds

log = logging.getLogger(__name__)
PART = "process_{}"


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
    """Orbax's warnings off: for what it warns about although dynjax asks for it on purpose (a
    user's `dynjax.train` would otherwise begin with them, before any `error:`)."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl.setLevel(level)



def part_dir(root: Path, process: int) -> Path:
    return Path(root) / PART.format(process)


class Sources:
    """The checkpoints under ``root`` that a restore can read: whole ones (``root/<step>``) and
    complete steps of parts (``root/process_<p>/<step>``), newest first, read leaf by leaf."""

    def __init__(self, root: Path, process: int = 0):
        self.root, self.process = Path(root), process
        self._metas: dict[Path, dict[int, dict[str, Any]]] = {}

    def _reader(self, directory: Path) -> ocp.CheckpointManager:
        """A read-only Orbax manager of one directory, of this process alone (no barriers).
        Orbax warns on stderr that it is read-only, as asked: quiet while it is made."""
        alone = ocp.options.MultiprocessingOptions(
            primary_host=self.process,
            active_processes={self.process},
            barrier_sync_key_prefix=f"read_{self.process}",
        )
        with _quiet_orbax():
            options = ocp.CheckpointManagerOptions(read_only=True, multiprocessing_options=alone)
            return ocp.CheckpointManager(directory.absolute(), options=options)

    def _listing(self, directory: Path) -> list[int]:
        if not directory.is_dir():
            return []
        reader = self._reader(directory)
        try:
            return sorted(reader.all_steps())
        finally:
            reader.close()

    def meta(self, directory: Path, step: int) -> dict[str, Any]:
        """The metadata a source wrote for ``step`` (read once)."""
        known = self._metas.setdefault(directory, {})
        if step not in known:
            reader = self._reader(directory)
            try:
                meta = reader.restore(
                    step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()})
                )[META]
            finally:
                reader.close()
            if not isinstance(meta, dict):
                raise CheckpointError(f"{directory / str(step)}: metadata is not a dict")
            known[step] = meta
        return known[step]

    def parts(self) -> list[Path]:
        out = []
        while part_dir(self.root, len(out)).is_dir():
            out.append(part_dir(self.root, len(out)))
        return out

    def part_steps(self) -> dict[int, list[Path]]:
        """Every step some part holds -> the part directories holding it."""
        out: dict[int, list[Path]] = {}
        for directory in self.parts():
            for step in self._listing(directory):
                out.setdefault(step, []).append(directory)
        return out

    def complete(self) -> dict[int, list[Path]]:
        """Step -> its sources: the parts of steps every part of which is there (as many as
        part 0's metadata says), and whole checkpoints (a step of both: its parts, then the
        whole one). A step whose part 0 holds unreadable metadata is listed with the parts
        holding it: trying it fails, and it is set aside as unusable, not as incomplete."""
        out = {step: [self.root] for step in self._listing(self.root)}
        for step, held in self.part_steps().items():
            first = part_dir(self.root, 0)
            if first not in held:
                continue
            try:
                count = int(self.meta(first, step).get("parts", 0))
            except Exception:  # noqa: BLE001 - tried (and set aside) with what holds it
                out[step] = held + out.get(step, [])
                continue
            wanted = [part_dir(self.root, p) for p in range(count)]
            if count and all(p in held for p in wanted):
                out[step] = wanted + out.get(step, [])
        return out

    def newest_in_parts(self) -> int | None:
        """The newest complete step of parts, if any."""
        steps = [s for s, held in self.complete().items() if held != [self.root]]
        return max(steps, default=None)

    def read(
        self,
        step: int,
        sources: list[Path],
        template: dict[str, Any],
        stacks: RowStacks,
        emit: Callable[[dict[str, Any]], None] = lambda event: None,
        complete: dict[int, list[Path]] | None = None,
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The leaves ``template`` names (key -> ShapeDtypeStruct) as of ``step``, host arrays
        each verified against its writer's checksum, and the step's metadata (the first
        source's). A leaf no source holds, or holds in another shape, is `CheckpointMismatch`;
        an unreadable or corrupted one raises (the step is unusable). A row-stacked leaf
        (``stacks``) the step saved in part is assembled (`_assemble`) from the steps of
        ``complete`` (the listing every process agreed on; None: this process's); the
        metadata's `rows.SOURCES` says where each of this process's rows came from."""
        metas = [self.meta(directory, step) for directory in sources]
        holder: dict[str, tuple[Path, dict[str, Any]]] = {}
        for directory, meta in zip(sources, metas, strict=True):
            if meta.get("layout") != layout.LAYOUT:
                raise CheckpointMismatch(
                    f"step {step} in {directory} is of layout {meta.get('layout', 1)}: resume it "
                    "in a run whose pipeline stages are in one process"
                )
            for key in meta.get("checksums", {}):
                # This process's own part first, the others in process order.
                if key not in holder or directory == part_dir(self.root, self.process):
                    holder[key] = (directory, meta)
        check_fits(
            step,
            {k: holder[k][1]["checksums"][k] for k in template if k in holder},
            layout.shapes(template, stacks),
        )
        out, partial, sources_of = {}, {}, {}
        for key, leaf in template.items():
            directory, meta = holder[key]
            saved = meta["checksums"][key]
            stacked = isinstance(saved, list)
            if stacked:
                held = layout.held_rows(meta).get(key, ())
                if len(held) != leaf.shape[0]:
                    partial[key] = leaf
                    continue
                slot = (stacks.stack_of(key), row_group(key))
                sources_of.setdefault(slot[0], {})[slot[1]] = [step] * leaf.shape[0]
            item = layout.ROWS if stacked else layout.DENSE
            array = layout.read_array(directory / str(step) / item, key)
            if layout.checksums({key: jnp.asarray(array)}, stacks)[key] != saved:
                raise CheckpointError(f"step {step} {key}: checksum mismatch (corrupted data)")
            out[key] = qkv_columns_per_head({key: array}, meta, step)[key]
        if partial:
            listing = self.complete() if complete is None else complete
            assembled, chosen = self._assemble(step, partial, stacks, emit, listing)
            out.update(assembled)
            for stack, groups in chosen.items():
                sources_of.setdefault(stack, {}).update(groups)
        return out, {**metas[0], SOURCES: sources_of}

    def _assemble(
        self,
        step: int,
        want: dict[str, Any],
        stacks: RowStacks,
        emit: Callable[[dict[str, Any]], None],
        complete: dict[int, list[Path]],
    ) -> tuple[dict[str, np.ndarray], dict[int, dict[str, list[int]]]]:
        """The row-stacked leaves ``want`` (key -> ShapeDtypeStruct) as of ``step``, of which
        it saved only some rows (seed 004 §3): each row from the newest complete step up to
        ``step`` whose source holding the stack (the part of the process that held its stage
        then, or a whole checkpoint) has a copy that reads and verifies (`read.resolve_slot`);
        and per stack and row group the step each row came from."""
        older = sorted((s for s in complete if s <= step), reverse=True)
        slots: dict[Slot, list[str]] = {}
        for key in want:
            slots.setdefault((stacks.stack_of(key), row_group(key)), []).append(key)
        out: dict[str, np.ndarray] = {}
        sources: dict[int, dict[str, list[int]]] = {}
        for slot, keys in sorted(slots.items()):
            metas, items = {}, {}
            for s in older:
                for directory in complete[s]:
                    try:
                        meta = self.meta(directory, s)
                    except Exception as err:  # noqa: BLE001 - a source less; never moved here
                        log.warning("%s: unreadable metadata (%s); its rows are not used",
                                    directory / str(s), err)
                        continue
                    if keys[0] in meta.get("checksums", {}):
                        metas[s], items[s] = meta, directory / str(s) / layout.ROWS
                        break
            n = want[keys[0]].shape[0]
            rows: dict[str, list[Any]] = {k: [None] * n for k in keys}
            copies = {s: layout.held_rows(m) for s, m in metas.items()}
            sources.setdefault(slot[0], {})[slot[1]] = resolve_slot(
                slot, keys, n, metas, copies, {}, rows, stacks,
                item_of=items.__getitem__, emit=emit,
            )
            out.update({key: np.stack(rows[key]) for key in keys})
        return out, sources

    def set_aside(self, step: int, directories: list[Path]) -> list[Path]:
        """Move ``step`` of each directory to its ``corrupt/<step>-<time>`` (kept for a person,
        never deleted); returns where. One process calls it."""
        moved = []
        for directory in directories:
            target = quarantine_target(directory, step)
            if (directory / str(step)).exists():
                target.parent.mkdir(exist_ok=True)
                shutil.move(str(directory / str(step)), str(target))
                moved.append(target)
            self._metas.get(directory, {}).pop(step, None)
        return moved


def restore_parts(
    root: Path,
    target: Callable[[dict[str, Any]], Any],
    peers: Peers | None,
    *,
    stacks: RowStacks,
    emit: Callable[[dict[str, Any]], None] = lambda event: None,
    reload: Callable[[], None] = lambda: None,
) -> tuple[Any, dict[str, Any]] | None:
    """Newest step under ``root`` (whole, or complete in parts) that every process restores and
    verifies, as (state, meta); None if there is none. ``stacks``: which leaves are
    row-stacked.

    ``target(meta)`` gives the tree to restore: ShapeDtypeStructs where this process needs a
    leaf, None elsewhere (`Experiment.restore_target`); the state holds host arrays there. What
    it raises propagates and moves nothing. A step that does not read or verify in some
    process is moved aside and the previous one tried; the parts of steps newer than the one
    restored (never completed) are moved aside too. ``reload`` re-lists the caller's own
    checkpoints once steps moved. The processes agree through ``peers`` (None: one process).
    """
    sources = Sources(root, peers.index if peers else 0)
    agreed = Rounds(peers, "checkpoint/restore")  # every process makes the same calls
    # Process 0's listing: every process tries the same steps in the same order, and a step
    # another host's view of shared storage lists late is not taken for a broken one.
    complete = agreed.first(sources.complete())
    steps = sorted(complete)
    restored = None
    for step in reversed(steps):
        held = complete[step]
        whole = [d for d in held if d == root]
        template = flat = mismatch = None
        try:
            meta, error = sources.meta(held[0], step), None
        except Exception as err:  # noqa: BLE001 - unreadable metadata: a broken step
            meta, error = None, err
        if error is None:
            template = target(meta)  # what it raises (the config's errors) moves nothing
            try:
                parts = [d for d in held if d != root] or whole
                flat, meta = sources.read(
                    step, parts, layout.flatten(template), stacks, emit, complete=complete
                )
            except (CheckpointMismatch, RowsMissing) as err:  # not this step's data alone:
                error, mismatch = err, (type(err).__name__, str(err))  # raised everywhere
            except Exception as err:  # noqa: BLE001 - any failure: try an older step
                error = err
        mismatches = [m for m in agreed.all(mismatch) if m is not None]
        if mismatches:
            kind, message = mismatches[0]
            raise (RowsMissing if kind == RowsMissing.__name__ else CheckpointMismatch)(
                message
            )
        failed = agreed.all(None if error is None else f"{type(error).__name__}: {error}")
        if all(f is None for f in failed):
            # Each process assembled the rows of its own stages: every process's row policy
            # accounts for all of them (`rows.RowPolicy.recover`).
            every: dict[int, dict[str, list[int]]] = {}
            for part in agreed.all(meta[SOURCES]):
                for stack, groups in part.items():
                    every.setdefault(stack, {}).update(groups)
            meta = {**meta, SOURCES: every}
            restored = step, (layout.unflatten_like(template, flat), meta)
            break
        reason = next(
            f if peers is None else f"in process {p}: {f}" for p, f in enumerate(failed) if f
        )
        _set_aside(sources, agreed, step, held, reason, emit, reload)
    newer = [s for s in sources.part_steps() if restored is None or s > restored[0]]
    incomplete = agreed.first(sorted(newer))
    for step in incomplete:
        _set_aside(sources, agreed, step, sources.parts(), None, emit, reload)
    if restored is not None:
        return restored[1]
    if steps or incomplete:
        raise CheckpointError(
            f"no checkpoint in {root} could be restored (unusable: {steps}, not saved by every "
            f"process: {incomplete}); they are kept in its corrupt/ directories: see the "
            "warnings above, or start from a new workdir"
        )
    return None


def parts_are_newer(root: Path, whole: list[int], peers: Peers | None) -> bool:
    """Whether, as process 0 sees ``root``, a step complete in parts is newer than every whole
    checkpoint (steps ``whole``): then a run of one program restores from the parts. Every
    process takes process 0's answer, so all restore the same way."""
    newest = Sources(root, peers.index if peers else 0).newest_in_parts()
    newer = newest is not None and newest > max(whole, default=-1)
    return bool(Rounds(peers, "checkpoint/parts_newer").first(newer))


def _set_aside(
    sources: Sources,
    agreed: Rounds,
    step: int,
    directories: list[Path],
    failure: str | None,
    emit: Callable[[dict[str, Any]], None],
    reload: Callable[[], None],
) -> None:
    """Process 0 moves ``step`` of ``directories`` aside (``failure`` None: a step some process
    never finished saving); every process waits for it and re-lists its own checkpoints."""
    first = sources.process == 0
    moved = [str(m) for m in sources.set_aside(step, directories)] if first else []
    moved = agreed.first(moved)  # where process 0 moved it, in every process's event
    reload()
    reason = failure or "not every process finished saving it"
    if first:
        log.warning("checkpoint at step %d: %s; moved it to %s", step, reason, moved)
    emit(
        {
            "event": "checkpoint_incomplete" if failure is None else "checkpoint_restore_failed",
            "step": step,
            "error": reason,
            "moved_to": moved,
        }
    )


class PartedCheckpointer:
    """The checkpointer of a pipeline over processes: saves this process's part, restores from
    every source (module docstring). The training loop's interface of `Checkpointer`."""

    def __init__(
        self,
        root: Path,
        peers: Peers,
        *,
        keep: int,
        stacks: RowStacks,
        async_save: bool = True,
        emit: Callable[[dict[str, Any]], None] = lambda event: None,
    ):
        self.root, self.peers, self.emit = Path(root), peers, emit
        self.stacks = stacks
        self.own = Checkpointer(
            part_dir(self.root, peers.index),
            keep=keep,
            stacks=stacks,
            async_save=async_save,
            emit=emit,
            part=peers.index,
        )

    def all_steps(self) -> list[int]:
        """This process's saved steps (the other parts are their processes' to list)."""
        return self.own.all_steps()

    def save(
        self,
        step: int,
        state: Any,
        meta: dict[str, Any],
        rows: Rows | None = None,
        content: str = "WO",
    ) -> bool:
        """Start saving this process's leaves of ``state`` (None elsewhere) at ``step``;
        `Checkpointer.save`, with ``rows`` (every stack's rows to save, the same in every
        process) narrowed to the stacks of this process's stages."""
        if rows is not None:
            split = layout.split(state, self.stacks)[layout.ROWS]
            mine = {self.stacks.stack_of(k) for k in split}
            rows = {stack: held for stack, held in rows.items() if stack in mine}
        parts = {"parts": self.peers.count, "part": self.peers.index}
        return self.own.save(step, state, {**meta, **parts}, rows=rows, content=content)

    def restore_latest(
        self, target: Callable[[dict[str, Any]], Any]
    ) -> tuple[Any, dict[str, Any]] | None:
        return restore_parts(
            self.root, target, self.peers, stacks=self.stacks, emit=self.emit,
            reload=self.own.reload,
        )

    def wait(self) -> None:
        self.own.wait()

    def poll(self) -> None:
        self.own.poll()

    def saving(self) -> bool:
        return self.own.saving()

    def close(self) -> None:
        self.own.close()
