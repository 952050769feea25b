"""Asynchronous, atomic, verified checkpoints on top of Orbax's CheckpointManager.

A save hands the run's ``jax.Array``s to Orbax as they are (`layout`: three items whatever the
model's size): Orbax copies each device's shards to host (one replica of each) before ``save``
returns, then writes them in the background into a temporary directory and renames it when
complete, so a killed process never leaves a checkpoint that looks finished. The checksums are
computed on the devices that hold the shards (`layout.checksums`). A restore reads each shard
straight onto its device in the shardings of the target it is given (the current run's), so a
run may resume on another ``mesh.data``/``mesh.expert``/``mesh.tensor`` or stage count, and
verifies the checksums there: no host holds the whole state on save or restore.

A checkpoint that cannot be read or verified is moved aside to ``corrupt/<step>-<time>`` (kept
for a person to inspect, never deleted) and the previous one is used; moving it also frees its
step for the next save and keeps it out of ``keep``. A checkpoint that is intact but does not fit
the model (other leaves, shapes or dtypes, told by its metadata before any array is read) is an
error, never moved. A save that Orbax refuses or that fails is an event and a warning, never a
success. Checkpoints of layout 1 (one item per expert) still restore, through host memory.

Partial expert checkpoints (PEC, seed 004 §3): a save may hold only K of the E experts of each
MoE layer, for the weights, the optimizer state or both (``content`` W / O / WO). A restore then
assembles each expert from the newest step that saved it (`restore_latest`), a step is kept on
disk while it holds the newest copy of any expert (`_NewestCopies`), and a save never leaves an
expert without any copy (`Checkpointer.save` adds it).

Multi-process runs (issue 15 §4, issue 13 §5): every process calls save and restore with the
same global arrays; each writes the shards its devices hold into its own ``ocdbt.process_<i>``
part of the step, and process 0 the metadata (the checksums are replicated results of the global
arrays, so every process computes the same). A leaf replicated over data-parallel ranks is
written replica-parallel: each replica writes its slice of the leaf's first axis the replica
count divides (Orbax's ``use_replica_parallel``, which Orbax leaves off on GPUs), so the ranks
write disjoint, nearly equal byte shares instead of replica 0 writing it all. The processes
agree on whether a step restored before any of them moves it aside, and only process 0 moves
it. A restore reads into the current run's shardings, so a checkpoint written by N processes
restores on any other process count. A pipeline over processes saves one part per process
instead (``part``, `dynjax.checkpoint.parts`).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from dynjax.checkpoint import layout
from dynjax.model.attention import qkv_per_head
from jax_private import array_metadata_store

log = logging.getLogger(__name__)


@contextlib.contextmanager
def quiet_orbax() -> Iterator[None]:
    """Orbax's warnings off: for what it warns about although dynjax asks for it on purpose (a
    user's `dynjax.train` would otherwise begin with them, before any `error:`)."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl.setLevel(level)


# Replica-parallel writes on every platform (module docstring); the rest as Orbax's default.
with quiet_orbax():  # Orbax warns at every override
    ocp.type_handlers.register_type_handler(
        jax.Array,
        ocp.type_handlers.ArrayHandler(
            use_replica_parallel=True, array_metadata_store=array_metadata_store()
        ),
        override=True,
    )
META = "meta"
QUARANTINE = "corrupt"  # beside the steps; Orbax lists only integer step directories


class CheckpointError(RuntimeError):
    """No checkpoint in the directory could be restored and verified."""


class CheckpointMismatch(CheckpointError):
    """An intact checkpoint that does not fit the model: an error of the run, not of the data."""


class ExpertsMissing(CheckpointError):
    """Some expert has no usable copy in any checkpoint up to the one restored: older steps
    cannot serve it either, so no step is moved aside."""


# Seed 004 §3's PEC_W, PEC_O and PEC_WO: the expert groups a partial save cuts to K experts.
CONTENTS = {
    "W": {layout.WEIGHTS},
    "O": {layout.OPTIMIZER},
    "WO": {layout.WEIGHTS, layout.OPTIMIZER},
}
Slot = tuple[int, str]  # (MoE layer, expert group): leaves an expert's row is saved across
Copies = dict[str, tuple[int, ...]]  # expert leaf -> rows a step holds (`layout.held_rows`)


class _NewestCopies:
    """Orbax preservation policy: keep the ``keep`` newest steps and every step holding the
    newest saved copy of some (expert leaf, row), so that `Checkpointer.restore_latest` finds
    every expert's newest copy (seed 004 §3: a PEC step alone does not hold the model).

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
    """Save and restore ``{"params": ..., "opt_state": ...}`` plus JSON metadata per step."""

    def __init__(
        self,
        directory: Path,
        *,
        keep: int,
        async_save: bool = True,
        emit: Callable[[dict[str, Any]], None] = lambda event: None,
        part: int | None = None,
    ):
        """``part``: this process's part of a pipeline over processes (`dynjax.checkpoint.parts`),
        written by this process alone (`_lift`); `parts.Sources` reads it back."""
        self.emit, self.part = emit, part
        self._copies: dict[int, Copies] = {}
        extra, handlers = {}, None
        if part is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)  # Orbax creates none for a subset
            if jax.process_count() > 1:
                alone = ocp.options.MultiprocessingOptions(
                    primary_host=part,
                    active_processes={part},
                    barrier_sync_key_prefix=f"part_{part}",
                )
                extra, handlers = {"multiprocessing_options": alone}, _part_handlers(alone)
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=async_save,
            create=part is None,
            preservation_policy=_NewestCopies(keep, lambda step: self._copies.get(step, {})),
            **extra,
        )
        self._lifted = handlers is not None
        self._manager = ocp.CheckpointManager(
            Path(directory).absolute(), options=options, item_handlers=handlers
        )
        for step in self.all_steps():
            try:
                self._copies[step] = layout.held_rows(self._read_meta(step))
            except Exception:  # noqa: BLE001 - unreadable: holds nothing a restore can use
                self._copies[step] = {}

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(
        self,
        step: int,
        state: Any,
        meta: dict[str, Any],
        experts: Mapping[int, Sequence[int]] | None = None,
        content: str = "WO",
    ) -> bool:
        """Start saving ``state`` (a pytree of jax.Arrays) at ``step``; returns once each
        device's shards are copied to host (the next step may donate the arrays).

        ``experts`` (MoE layer -> expert rows; None: all) saves only those experts of each
        MoE layer (PEC, seed 004 §3) for the leaves ``content`` names: ``"W"`` the experts'
        weights, ``"O"`` their optimizer state, ``"WO"`` both; the other leaves and the dense
        item are whole. The chosen rows are gathered on the devices that hold them, and a row
        of which no step on disk holds a copy (a first save, or after a quarantine) is saved
        too, so that every checkpoint restores; the ``checkpoint`` event lists the rows saved.

        Returns whether the save was started. A save Orbax refuses (the step exists, or is not
        newer than the latest) or that raises (including an earlier asynchronous save's error,
        which Orbax reports here) is a ``checkpoint_failed`` event and a warning: training
        goes on and later saves are still tried.
        """
        start = time.perf_counter()
        items = layout.split(state)
        rows = self._rows_to_save(items[layout.EXPERTS], experts, content)
        expert_rows = {
            k: {"of": int(a.shape[0]), "rows": list(rows[k])}
            for k, a in items[layout.EXPERTS].items()
        }
        items[layout.EXPERTS] = {
            k: a if rows[k] == tuple(range(a.shape[0])) else layout.take_rows(a, rows[k])
            for k, a in items[layout.EXPERTS].items()
        }
        flat = {**items[layout.DENSE], **items[layout.EXPERTS]}
        meta = {
            **meta,
            "step": step,
            "layout": layout.LAYOUT,
            "qkv_columns": layout.QKV_COLUMNS,
            "checksums": layout.checksums(flat),
            "expert_rows": expert_rows,
        }
        previous, args = self._copies.get(step), {}
        self._copies[step] = rows  # what the preservation policy weighs during the save
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
            started, error = False, f"{type(err).__name__}: {err}"
        if not started:
            if previous is None:
                del self._copies[step]
            else:
                self._copies[step] = previous
            log.warning("checkpoint at step %d was not saved: %s", step, error)
            self.emit({"event": "checkpoint_failed", "step": step, "error": error})
            return False
        saved: dict[str, list[int]] = {}
        for key, held in rows.items():
            if layout.expert_group(key) in CONTENTS[content]:
                saved.setdefault(str(layout.expert_layer(key)), list(held))
        self.emit(
            {
                "event": "checkpoint",
                "step": step,
                "items": len(args) + 1,
                "bytes": int(sum(a.nbytes for a in flat.values())),
                "experts_saved": saved,
                "pec_content": content,
                "blocking_seconds": round(time.perf_counter() - start, 4),
            }
        )
        return True

    def _save_args(self, items: dict[str, dict[str, jax.Array]]) -> dict[str, Any]:
        """Orbax's arguments for each non-empty item (a model without MoE layers has no
        ``experts`` item; a part of a process with no stage has neither)."""
        # One storage chunk per expert: a later read of a few experts touches only theirs.
        per_expert = ocp.SaveArgs(shard_axes=(0,))
        chunks = {layout.EXPERTS: layout.nest({k: per_expert for k in items[layout.EXPERTS]})}
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
        self,
        leaves: Mapping[str, Any],
        experts: Mapping[int, Sequence[int]] | None,
        content: str,
    ) -> Copies:
        """Per expert leaf, the rows this save writes (see `save`)."""
        if content not in CONTENTS:
            raise ValueError(f"content={content!r}: use one of {sorted(CONTENTS)} (seed 004 §3)")
        counts = {layout.expert_layer(k): int(a.shape[0]) for k, a in leaves.items()}
        if experts is not None:
            if set(experts) != set(counts):
                raise ValueError(
                    f"experts names MoE layers {sorted(experts)}, the state has {sorted(counts)}: "
                    "give the rows to save for each MoE layer (or experts=None for all)"
                )
            for moe_layer, chosen in experts.items():
                bad = [e for e in chosen if not 0 <= e < counts[moe_layer]]
                if bad or not chosen or len(set(chosen)) != len(chosen):
                    raise ValueError(
                        f"experts[{moe_layer}] = {list(chosen)}: give distinct experts in "
                        f"[0, {counts[moe_layer]}), at least one"
                    )
        have = {(k, r) for copies in self._copies.values() for k, rs in copies.items() for r in rs}
        chosen_rows: dict[int, set[int]] = {}
        for key in leaves:
            moe_layer = layout.expert_layer(key)
            if experts is None:
                chosen_rows[moe_layer] = set(range(counts[moe_layer]))
                continue
            picked = chosen_rows.setdefault(moe_layer, set(experts[moe_layer]))
            if layout.expert_group(key) in CONTENTS[content]:
                picked |= {r for r in range(counts[moe_layer]) if (key, r) not in have}
        return {
            k: tuple(sorted(chosen_rows[layout.expert_layer(k)]))
            if layout.expert_group(k) in CONTENTS[content]
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

        Each expert comes from the newest step up to that one that saved it (`restore`);
        ``meta["expert_sources"]`` says which.
        """
        steps = self.all_steps()
        for step in reversed(steps):
            try:
                meta, error = self._read_meta(step), None
            except Exception as err:  # noqa: BLE001 - unreadable metadata: a broken checkpoint
                meta, error = None, err
            if not _everywhere(error is None):
                self._quarantine(step, error or CheckpointError("another process cannot read it"))
                continue
            template = target(meta)
            try:
                state, error = self._restore_items(step, template, meta), None
            except CheckpointMismatch:
                raise
            except ExpertsMissing:
                raise
            except Exception as err:  # noqa: BLE001 - any failure means: fall back to an older one
                state, error = None, err
            if _everywhere(error is None):
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
        ``template``'s shardings: its dense part from ``step``, each expert (weights and
        optimizer state separately) from the newest step up to ``step`` that holds a copy
        that reads and verifies.

        ``meta["expert_sources"]`` is ``{layer: {"weights": [step per expert], "optimizer":
        [...]}}``. A copy of an expert that fails to read or verify is a warning and a
        ``checkpoint_expert_fallback`` event, and the copy before it is used. The step that
        held it is not moved aside: its dense part and its other experts are the newest state
        there is, and the one lost expert costs only its updates since its previous copy (the
        loss PEC accepts by design, seed 004 §3.1.2), where moving the step aside would roll
        every expert back. An expert with no usable copy is `ExpertsMissing`.
        """
        meta = self._read_meta(step)
        return self._restore_items(step, template, meta), meta

    def restore_experts(
        self, step: int, key: str, experts: Sequence[int]
    ) -> np.ndarray:
        """Rows ``experts`` of the expert leaf ``key`` (e.g. ``params/layers/1/moe/w_in``) of
        the checkpoint at ``step``, [len(experts), ...], verified: only those experts' chunks
        are read (the module docstring of `layout`). What a partial restore builds on."""
        meta = self._read_meta(step)
        held = layout.held_rows(meta).get(key)
        if held is None:
            raise CheckpointMismatch(
                f"step {step} holds no expert array {key!r} in layout {layout.LAYOUT}"
            )
        missing = sorted(set(experts) - set(held))
        if missing:
            raise CheckpointMismatch(f"step {step} {key} holds experts {list(held)}, not {missing}")
        rows = layout.read_rows(
            self._step_dir(step) / layout.EXPERTS, key, [held.index(e) for e in experts]
        )
        got = layout.checksums({key: jnp.asarray(rows)})[key]
        sums = meta["checksums"][key]
        for e, row_sum in zip(experts, got, strict=True):
            if row_sum != sums[held.index(e)]:
                raise CheckpointError(
                    f"step {step} {key} expert {e}: checksum mismatch (corrupted data)"
                )
        return rows

    def _step_dir(self, step: int) -> Path:
        return Path(self._manager.directory) / str(step)

    def _read_meta(self, step: int) -> dict[str, Any]:
        meta = self._manager.restore(
            step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()})
        )[META]
        if not isinstance(meta, dict):
            raise CheckpointError(f"step {step}: metadata is {type(meta).__name__}, not a dict")
        return meta

    def _restore_items(self, step: int, template: Any, meta: dict[str, Any]) -> Any:
        start = time.perf_counter()
        read = self._read_layout2 if meta.get("layout") == layout.LAYOUT else self._read_layout1
        state = read(step, template, meta)
        flat = layout.flatten(state)
        upgraded = qkv_columns_per_head(flat, meta, step)
        if upgraded is not flat:
            state = layout.unflatten_like(template, upgraded)
        self.emit(
            {
                "event": "checkpoint_restore",
                "step": step,
                "seconds": round(time.perf_counter() - start, 4),
            }
        )
        return state

    def _read_layout2(self, step: int, template: Any, meta: dict[str, Any]) -> Any:
        """The dense item read straight onto its devices in ``template``'s sharding and
        verified there (a failure raises: the step is unusable); then each expert assembled
        from its newest usable copy (`_assemble_experts`). Adds ``meta["expert_sources"]``."""
        expected = layout.split(template)
        saved_sums = meta.get("checksums", {})
        want = {**expected[layout.DENSE], **expected[layout.EXPERTS]}
        check_fits(step, saved_sums, layout.shapes(want))
        for key, leaf in expected[layout.EXPERTS].items():
            if layout.expert_count(meta, key) != leaf.shape[0]:
                raise CheckpointMismatch(
                    f"step {step} does not fit the model ({key}: saved "
                    f"{layout.expert_count(meta, key)} experts, model {leaf.shape[0]}): the "
                    "checkpoint is from a different model configuration; train it with that "
                    "configuration or start from a new workdir"
                )
        args = {layout.DENSE: ocp.args.StandardRestore(layout.nest(expected[layout.DENSE]))}
        try:
            restored, error = self._manager.restore(step, args=ocp.args.Composite(**args)), None
        except Exception as err:  # noqa: BLE001 - raised below, in every process alike
            restored, error = None, err
        if not _everywhere(error is None):  # before the checksums, a collective of all processes
            raise error or CheckpointError(f"step {step}: another process cannot read it")
        flat = layout.denest(restored[layout.DENSE])
        _check_shapes(step, flat, expected[layout.DENSE])
        for key, got in layout.checksums(flat).items():
            if got != saved_sums[key]:
                raise CheckpointError(f"step {step} {key}: checksum mismatch (corrupted data)")
        if expected[layout.EXPERTS]:
            experts, meta["expert_sources"] = self._assemble_experts(
                step, meta, expected[layout.EXPERTS]
            )
            flat.update(experts)
        return layout.unflatten_like(template, flat)

    def _assemble_experts(
        self, step: int, meta: dict[str, Any], want: dict[str, Any]
    ) -> tuple[dict[str, jax.Array], dict[int, dict[str, list[int]]]]:
        """Each expert leaf of ``want`` (ShapeDtypeStructs) as of ``step``, and per MoE layer
        and expert group the step each expert's row comes from.

        The experts item of ``step`` is read through Orbax straight into the target shardings
        (its partial arrays replicated) and verified per row on the devices; a leaf whose rows
        all come from there is used as read (a full save restores exactly as it was written).
        The other rows are read from older steps with `layout.read_rows` (only those rows'
        chunks) one slot (layer, group) at a time, verified, and each assembled leaf placed
        with its target sharding: the host holds one slot's leaves at most."""
        metas = {step: meta}
        for s in (s for s in reversed(self.all_steps()) if s < step):
            try:
                metas[s] = self._read_meta(s)
            except Exception as err:  # noqa: BLE001 - a source less; never moved from here
                log.warning(
                    "checkpoint at step %d: unreadable metadata (%s); its experts are not used",
                    s,
                    err,
                )
        copies = {s: layout.held_rows(m) for s, m in metas.items()}
        here = self._read_experts_item(step, want, copies[step])
        here_sums = layout.checksums(here) if here else {}
        slots: dict[Slot, list[str]] = {}
        for key in want:
            slots.setdefault((layout.expert_layer(key), layout.expert_group(key)), []).append(key)
        out: dict[str, jax.Array] = {}
        sources: dict[int, dict[str, list[int]]] = {}
        for (moe_layer, group), keys in sorted(slots.items()):
            n = want[keys[0]].shape[0]
            rows: dict[str, list[Any]] = {k: [None] * n for k in keys}
            chosen = resolve_slot(
                (moe_layer, group), keys, n, metas, copies, here_sums, rows,
                item_of=lambda s: self._step_dir(s) / layout.EXPERTS, emit=self.emit,
            )
            sources.setdefault(moe_layer, {})[group] = chosen
            for key in keys:
                if key in here and chosen == [step] * n and len(copies[step][key]) == n:
                    out[key] = here[key]
                    continue
                local = np.asarray(here[key]) if key in here else None
                host = np.stack([local[r] if isinstance(r, int) else r for r in rows[key]])
                out[key] = jax.make_array_from_callback(
                    host.shape, want[key].sharding, lambda index, h=host: h[index]
                )
        return out, sources

    def _read_experts_item(
        self, step: int, want: dict[str, Any], held: Copies
    ) -> dict[str, jax.Array]:
        """The experts item of ``step`` on the devices (full arrays in the target's shardings,
        partial ones replicated over the target's mesh), or {} if it does not read: its rows
        are then tried one by one from storage."""
        target = {}
        for key, leaf in want.items():
            k = len(held[key])
            sharding = leaf.sharding if k == leaf.shape[0] else _replicated(leaf.sharding)
            target[key] = jax.ShapeDtypeStruct((k, *leaf.shape[1:]), leaf.dtype, sharding=sharding)
        try:
            args = {layout.EXPERTS: ocp.args.StandardRestore(layout.nest(target))}
            restored = self._manager.restore(step, args=ocp.args.Composite(**args))
            arrays, error = layout.denest(restored[layout.EXPERTS]), None
            _check_shapes(step, arrays, target)
        except Exception as err:  # noqa: BLE001 - read its rows one by one instead
            error = err
        if not _everywhere(error is None):  # every process takes the same path
            log.warning(
                "checkpoint at step %d: experts item unreadable as a whole (%s)",
                step,
                error or "in another process",
            )
            return {}
        return arrays

    def _read_layout1(self, step: int, template: Any, meta: dict[str, Any]) -> Any:
        """A checkpoint written before layout 2 (one item per expert): read to host, verified
        there, and placed with ``template``'s shardings."""
        expected = layout.v1_items(template)
        saved_sums = meta.get("checksums", {})
        # Layout 1 recorded a scalar's shape as [1]: its shapes are checked once read.
        check_fits(
            step,
            {f"{name}/{k}": v for name, sums in saved_sums.items() for k, v in sums.items()},
            {f"{name}/{k}": None for name, item in expected.items() for k in item},
        )
        args = {
            name: ocp.args.StandardRestore(layout.nest(item)) for name, item in expected.items()
        }
        restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        items = {name: layout.denest(restored[name]) for name in expected}
        for name, item in items.items():
            _check_shapes(step, item, expected[name])
            for key, arr in item.items():
                if layout.v1_checksum(arr) != saved_sums[name].get(key):
                    raise CheckpointError(
                        f"step {step} {name}/{key}: checksum mismatch (corrupted data)"
                    )
        flat = layout.v1_join(items)
        shardings = layout.flatten(jax.tree.map(lambda a: a.sharding, template))
        placed = {k: jax.device_put(a, shardings[k]) for k, a in flat.items()}
        return layout.unflatten_like(template, placed)

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
        self._manager.wait_until_finished()

    def saving(self) -> bool:
        """Whether an asynchronous save is still being written."""
        return bool(self._manager.is_saving_in_progress())

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def resolve_slot(
    slot: Slot,
    keys: list[str],
    n: int,
    metas: dict[int, dict[str, Any]],
    copies: dict[int, Copies],
    here_sums: dict[str, Any],
    rows: dict[str, list[Any]],
    *,
    item_of: Callable[[int], Path],
    emit: Callable[[dict[str, Any]], None],
) -> list[int]:
    """For each expert of ``slot``, the newest step of ``metas`` whose copy of its rows of
    all ``keys`` reads and verifies; fills ``rows[key][expert]`` with the row (a host
    array, or its position in the newest step's device array). A bad copy is a warning
    and a ``checkpoint_expert_fallback`` event, and the copy before it is tried; none
    left is `ExpertsMissing`. ``item_of(step)``: the experts item holding the step's copies
    (`Checkpointer`'s own, or the part that saved the slot's layer: `parts.Sources`)."""
    newest = max(metas)
    holders = [
        [s for s in sorted(metas, reverse=True) if all(e in copies[s].get(k, ()) for k in keys)]
        for e in range(n)
    ]
    tried, chosen = [0] * n, [-1] * n
    pending = set(range(n))
    while pending:
        by_step: dict[int, list[int]] = {}
        for e in sorted(pending):
            if tried[e] == len(holders[e]):
                raise ExpertsMissing(
                    f"expert {e} of layer {slot[0]} ({slot[1]}) has no usable copy in the "
                    f"checkpoints up to step {newest} (held by steps {holders[e]}): restore "
                    "an older workdir, or train from scratch"
                )
            by_step.setdefault(holders[e][tried[e]], []).append(e)
        for s, experts in by_step.items():
            verified = here_sums if s == newest else {}
            got, bad = _read_copies(item_of(s), keys, experts, metas[s], copies[s], verified)
            for e in experts:
                if e in bad:
                    tried[e] += 1
                    fallback = holders[e][tried[e]] if tried[e] < len(holders[e]) else None
                    log.warning(
                        "checkpoint at step %d: %s of expert %d of layer %d unusable (%s); "
                        "using the copy at step %s",
                        s, slot[1], e, slot[0], bad[e], fallback,
                    )
                    emit(
                        {
                            "event": "checkpoint_expert_fallback",
                            "step": s,
                            "layer": slot[0],
                            "expert": e,
                            "group": slot[1],
                            "error": bad[e],
                            "fallback_step": fallback,
                        }
                    )
                    continue
                for key in keys:
                    rows[key][e] = got[key][e]
                chosen[e] = s
                pending.discard(e)
    return chosen


def _read_copies(
    item: Path,
    keys: list[str],
    experts: list[int],
    meta: dict[str, Any],
    held: Copies,
    here_sums: dict[str, Any],
) -> tuple[dict[str, dict[int, Any]], dict[int, str]]:
    """Rows ``experts`` of ``keys`` in the experts ``item`` of a step (``{key: {expert:
    row}}``; a row already on the devices, verified by ``here_sums``, is its position there)
    and the experts whose copy failed, with why. One read per key; a read that raises is
    retried row by row."""
    got: dict[str, dict[int, Any]] = {k: {} for k in keys}
    bad: dict[int, str] = {}
    for key in keys:
        positions = [held[key].index(e) for e in experts]
        saved = meta["checksums"][key]
        if key in here_sums:
            for e, pos in zip(experts, positions, strict=True):
                got[key][e] = pos
                if here_sums[key][pos] != saved[pos]:
                    bad.setdefault(e, f"{key}: checksum mismatch (corrupted data)")
            continue
        try:
            parts = [(experts, positions, layout.read_rows(item, key, positions))]
        except Exception:  # noqa: BLE001 - find which rows do not read
            parts = []
            for e, pos in zip(experts, positions, strict=True):
                try:
                    parts.append(([e], [pos], layout.read_rows(item, key, [pos])))
                except Exception as err:  # noqa: BLE001 - this row falls back
                    bad.setdefault(e, f"{key}: {type(err).__name__}: {err}")
        for es, ps, data in parts:
            sums = layout.checksums({key: jnp.asarray(data)})[key]
            for i, (e, pos) in enumerate(zip(es, ps, strict=True)):
                got[key][e] = data[i]
                if sums[i] != saved[pos]:
                    bad.setdefault(e, f"{key}: checksum mismatch (corrupted data)")
    return got, bad


def _part_handlers(alone: ocp.options.MultiprocessingOptions) -> dict[str, Any]:
    """Orbax handlers of a part: its process is the primary host and writes every shard of
    replica 0 itself (no replica-parallel split with processes that take no part)."""
    arrays = ocp.type_handlers.create_type_handler_registry(
        (
            jax.Array,
            ocp.type_handlers.ArrayHandler(
                primary_host=alone.primary_host, replica_id=0, use_replica_parallel=False
            ),
        )
    )
    tree = lambda: ocp.PyTreeCheckpointHandler(
        multiprocessing_options=alone, type_handler_registry=arrays
    )
    return {
        layout.DENSE: tree(),
        layout.EXPERTS: tree(),
        META: ocp.JsonCheckpointHandler(multiprocessing_options=alone),
    }


def _lift(array: jax.Array, others: Sequence[jax.Device]) -> jax.Array:
    """``array`` (on this process's devices only) as an array Orbax saves in a run of several
    processes, with no copy.

    Orbax's ``ArrayHandler`` refuses an array one process holds whole when several processes
    run (it takes it for a pmap-style host-local value), and a pipeline stage's arrays are
    such. Here the array's mesh gains a leading ``part`` axis of 2 whose second row is other
    processes' devices: the array now spans processes, this process holds replica 0 of every
    shard (what `_part_handlers` writes), and the other row is never materialised or read."""
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


def _everywhere(ok: bool) -> bool:
    """Whether ``ok`` holds in every process, so that all take the same branch: a read may fail
    in one process only, and the others must not go on to a collective it skips."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


def _replicated(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return sharding


def check_fits(step: int, saved: dict[str, Any], expected: dict[str, str | None]) -> None:
    """Raise CheckpointMismatch unless the saved leaves (key -> checksums) are the expected
    ones (key -> ``"<dtype>[shape]"`` as the checksums begin, or None: any)."""
    shapes = {k: (v[0] if isinstance(v, list) and v else v) for k, v in saved.items()}
    differ = sorted(
        k
        for k in set(shapes) | set(expected)
        if k not in shapes
        or k not in expected
        or expected[k] not in (None, str(shapes[k]).split(":")[0])
    )
    if differ:
        listed = ", ".join(
            f"{k}: saved {str(shapes.get(k, '-')).split(':')[0]}, model {expected.get(k, '-')}"
            for k in differ[:4]
        )
        raise CheckpointMismatch(
            f"step {step} does not fit the model ({listed}{' ...' if len(differ) > 4 else ''}): "
            "the checkpoint is from a different model configuration; train it with that "
            "configuration or start from a new workdir"
        )


def qkv_columns_per_head(
    flat: dict[str, Any], meta: Mapping[str, Any], step: int
) -> dict[str, Any]:
    """``flat`` (key -> restored array, on devices or host) as the model now stores it: a
    checkpoint written before the fused attention projection's columns were per head (no
    ``qkv_columns`` in its metadata) has them reordered (`qkv_per_head`), with every leaf of
    the same path (Adam moments, pruning masks), so the restored model computes what the saved
    one did. ``flat`` itself when there is nothing to reorder."""
    keys = [k for k in flat if k.endswith(layout.QKV_LEAVES)]
    if meta.get("qkv_columns") == layout.QKV_COLUMNS or not keys:
        return flat
    config = meta.get("config") or {}
    model, pruning = config.get("model", {}), config.get("pruning", {})
    if "num_heads" not in model or "d_model" not in model:
        raise CheckpointMismatch(
            f"step {step} was written before the attention projection's columns were stored "
            "per head, and its metadata has no model.num_heads and model.d_model to reorder "
            "them by: resume it with the dynjax that wrote it, or start from a new workdir"
        )
    heads = model["num_heads"]
    head_dim, block = model["d_model"] // heads, pruning.get("block_size", 0)
    if pruning.get("enabled") and pruning.get("granularity") == "block" and head_dim % block:
        raise CheckpointMismatch(
            f"step {step} was written before the attention projection's columns were stored "
            f"per head, and its attn/qkv is pruned in {block} x {block} blocks, which columns "
            f"per head (head_dim {head_dim}) would split: resume it with the dynjax that "
            "wrote it, or start from a new workdir"
        )
    return {**flat, **{k: _per_head(flat[k], heads) for k in keys}}


def _per_head(x: Any, heads: int) -> Any:
    if isinstance(x, jax.Array):  # reordered where it is, in its own sharding
        return jax.jit(qkv_per_head, static_argnums=1, out_shardings=x.sharding)(x, heads)
    return np.ascontiguousarray(qkv_per_head(np.asarray(x), heads))


def _check_shapes(step: int, got: dict[str, Any], want: dict[str, Any]) -> None:
    if set(got) != set(want):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        raise CheckpointError(f"step {step}: missing {missing}, unexpected {extra}")
    for key, arr in got.items():
        if arr.shape != want[key].shape or arr.dtype != want[key].dtype:
            raise CheckpointError(
                f"step {step} {key}: saved {arr.dtype}{list(arr.shape)}, model expects "
                f"{want[key].dtype}{list(want[key].shape)}"
            )
