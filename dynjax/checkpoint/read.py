"""Reading one checkpoint step back onto the devices, verified (`manager` module docstring): its
metadata, its dense item, each row of a row-stacked leaf from the newest step that holds a
usable copy of it (seed 004 §3), and checkpoints of layout 1 through host memory.
`Checkpointer` restores through it; `parts.Sources` shares its row resolution (`resolve_slot`)
and checks."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from dynjax.checkpoint import layout
from dynjax.checkpoint.errors import CheckpointError, CheckpointMismatch, RowsMissing
from dynjax.checkpoint.rows import FALLBACK_EVENT, ROW, SOURCES, STACK, RowStacks, row_group
from dynjax.model.attention import qkv_per_head

log = logging.getLogger(__name__)
META = "meta"
Slot = tuple[int, str]  # (stack, row group): the leaves a row is saved across
Copies = dict[str, tuple[int, ...]]  # row-stacked leaf -> rows a step holds (`layout.held_rows`)


class OrbaxReadTaskErrors(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" records of Orbax's array reads.

    Why: reading a damaged step fails in several of Orbax's concurrent read tasks; the first
    error reaches `StepReader`, which reports it in one line and sets the step aside, while the
    others' tasks are garbage-collected later and asyncio logs each with a traceback (seen in a
    CI run of tests/test_faults.py): a traceback in the user's log for a failure handled."""

    _ORBAX_READ = re.compile(r"coro=<\w*(deserializ|restore|read)\w*\(\).*/orbax/checkpoint/")

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (text.startswith("Task exception was never retrieved")
                    and self._ORBAX_READ.search(text) is not None)


logging.getLogger("asyncio").addFilter(OrbaxReadTaskErrors())


class StepReader:
    """Reads the steps of one Orbax ``manager``'s directory; ``stacks``: which leaves are
    row-stacked; ``emit`` writes the restore and fallback events."""

    def __init__(
        self,
        manager: ocp.CheckpointManager,
        stacks: RowStacks,
        emit: Callable[[dict[str, Any]], None],
    ) -> None:
        self._manager, self.stacks, self.emit = manager, stacks, emit

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def step_dir(self, step: int) -> Path:
        return Path(self._manager.directory) / str(step)

    def read_meta(self, step: int) -> dict[str, Any]:
        meta = self._manager.restore(
            step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()})
        )[META]
        if not isinstance(meta, dict):
            raise CheckpointError(f"step {step}: metadata is {type(meta).__name__}, not a dict")
        return meta

    def read_rows(self, step: int, key: str, rows: Sequence[int]) -> np.ndarray:
        """Rows ``rows`` of the row-stacked leaf ``key`` of the checkpoint at ``step``,
        [len(rows), ...], verified: only those rows' chunks are read (the module docstring of
        `layout`). What a partial restore builds on."""
        meta = self.read_meta(step)
        held = layout.held_rows(meta).get(key)
        if held is None:
            raise CheckpointMismatch(
                f"step {step} holds no row-stacked array {key!r} in layout {layout.LAYOUT}"
            )
        missing = sorted(set(rows) - set(held))
        if missing:
            raise CheckpointMismatch(f"step {step} {key} holds rows {list(held)}, not {missing}")
        got = layout.read_rows(
            self.step_dir(step) / layout.ROWS, key, [held.index(r) for r in rows]
        )
        sums = layout.checksums({key: jnp.asarray(got)}, self.stacks)[key]
        saved = meta["checksums"][key]
        for r, row_sum in zip(rows, sums, strict=True):
            if row_sum != saved[held.index(r)]:
                raise CheckpointError(
                    f"step {step} {key} {ROW} {r}: checksum mismatch (corrupted data)"
                )
        return got

    def restore_items(self, step: int, template: Any, meta: dict[str, Any]) -> Any:
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
        verified there (a failure raises: the step is unusable); then each row assembled from
        its newest usable copy (`_assemble_rows`). Adds ``meta[rows.SOURCES]``."""
        expected = layout.split(template, self.stacks)
        saved_sums = meta.get("checksums", {})
        want = {**expected[layout.DENSE], **expected[layout.ROWS]}
        check_fits(step, saved_sums, layout.shapes(want, self.stacks))
        for key, leaf in expected[layout.ROWS].items():
            if layout.row_count(meta, key) != leaf.shape[0]:
                raise CheckpointMismatch(
                    f"step {step} does not fit the model ({key}: saved "
                    f"{layout.row_count(meta, key)} {ROW}s, model {leaf.shape[0]}): the "
                    "checkpoint is from a different model configuration; train it with that "
                    "configuration or start from a new workdir"
                )
        args = {layout.DENSE: ocp.args.StandardRestore(layout.nest(expected[layout.DENSE]))}
        try:
            restored, error = self._manager.restore(step, args=ocp.args.Composite(**args)), None
        except Exception as err:  # noqa: BLE001 - raised below, in every process alike
            restored, error = None, err
        if not everywhere(error is None):  # before the checksums, a collective of all processes
            raise error or CheckpointError(f"step {step}: another process cannot read it")
        flat = layout.denest(restored[layout.DENSE])
        _check_shapes(step, flat, expected[layout.DENSE])
        for key, got in layout.checksums(flat, self.stacks).items():
            if got != saved_sums[key]:
                raise CheckpointError(f"step {step} {key}: checksum mismatch (corrupted data)")
        if expected[layout.ROWS]:
            stacked, meta[SOURCES] = self._assemble_rows(step, meta, expected[layout.ROWS])
            flat.update(stacked)
        return layout.unflatten_like(template, flat)

    def _assemble_rows(
        self, step: int, meta: dict[str, Any], want: dict[str, Any]
    ) -> tuple[dict[str, jax.Array], dict[int, dict[str, list[int]]]]:
        """Each row-stacked leaf of ``want`` (ShapeDtypeStructs) as of ``step``, and per stack
        and row group the step each row comes from.

        The rows item of ``step`` is read through Orbax straight into the target shardings
        (its partial arrays replicated) and verified per row on the devices; a leaf whose rows
        all come from there is used as read (a full save restores exactly as it was written).
        The other rows are read from older steps with `layout.read_rows` (only those rows'
        chunks) one slot (layer, group) at a time, verified, and each assembled leaf placed
        with its target sharding: the host holds one slot's leaves at most."""
        metas = {step: meta}
        for s in (s for s in reversed(self.all_steps()) if s < step):
            try:
                metas[s] = self.read_meta(s)
            except Exception as err:  # noqa: BLE001 - a source less; never moved from here
                log.warning(
                    "checkpoint at step %d: unreadable metadata (%s); its rows are not used",
                    s,
                    err,
                )
        copies = {s: layout.held_rows(m) for s, m in metas.items()}
        here = self._read_rows_item(step, want, copies[step])
        here_sums = layout.checksums(here, self.stacks) if here else {}
        slots: dict[Slot, list[str]] = {}
        for key in want:
            slots.setdefault((self.stacks.stack_of(key), row_group(key)), []).append(key)
        out: dict[str, jax.Array] = {}
        sources: dict[int, dict[str, list[int]]] = {}
        for (stack, group), keys in sorted(slots.items()):
            n = want[keys[0]].shape[0]
            rows: dict[str, list[Any]] = {k: [None] * n for k in keys}
            chosen = resolve_slot(
                (stack, group), keys, n, metas, copies, here_sums, rows, self.stacks,
                item_of=lambda s: self.step_dir(s) / layout.ROWS, emit=self.emit,
            )
            sources.setdefault(stack, {})[group] = chosen
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

    def _read_rows_item(
        self, step: int, want: dict[str, Any], held: Copies
    ) -> dict[str, jax.Array]:
        """The rows item of ``step`` on the devices (full arrays in the target's shardings,
        partial ones replicated over the target's mesh), or {} if it does not read: its rows
        are then tried one by one from storage."""
        target = {}
        for key, leaf in want.items():
            k = len(held[key])
            sharding = leaf.sharding if k == leaf.shape[0] else _replicated(leaf.sharding)
            target[key] = jax.ShapeDtypeStruct((k, *leaf.shape[1:]), leaf.dtype, sharding=sharding)
        try:
            args = {layout.ROWS: ocp.args.StandardRestore(layout.nest(target))}
            restored = self._manager.restore(step, args=ocp.args.Composite(**args))
            arrays, error = layout.denest(restored[layout.ROWS]), None
            _check_shapes(step, arrays, target)
        except Exception as err:  # noqa: BLE001 - read its rows one by one instead
            error = err
        if not everywhere(error is None):  # every process takes the same path
            log.warning(
                "checkpoint at step %d: rows item unreadable as a whole (%s)",
                step,
                error or "in another process",
            )
            return {}
        return arrays

    def _read_layout1(self, step: int, template: Any, meta: dict[str, Any]) -> Any:
        """A checkpoint written before layout 2 (one item per row): read to host, verified
        there, and placed with ``template``'s shardings."""
        expected = layout.v1_items(template, self.stacks)
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


def resolve_slot(
    slot: Slot,
    keys: list[str],
    n: int,
    metas: dict[int, dict[str, Any]],
    copies: dict[int, Copies],
    here_sums: dict[str, Any],
    rows: dict[str, list[Any]],
    stacks: RowStacks,
    *,
    item_of: Callable[[int], Path],
    emit: Callable[[dict[str, Any]], None],
) -> list[int]:
    """For each row of ``slot``, the newest step of ``metas`` whose copy of it in all ``keys``
    reads and verifies; fills ``rows[key][row]`` with it (a host array, or its position in
    the newest step's device array). A bad copy is a warning and a `rows.FALLBACK_EVENT`
    event, and the copy before it is tried; none left is `RowsMissing`. ``item_of(step)``:
    the rows item holding the step's copies (`Checkpointer`'s own, or the part that saved the
    slot's stack: `parts.Sources`)."""
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
                raise RowsMissing(
                    f"{ROW} {e} of {STACK} {slot[0]} ({slot[1]}) has no usable copy in the "
                    f"checkpoints up to step {newest} (held by steps {holders[e]}): restore "
                    "an older workdir, or train from scratch"
                )
            by_step.setdefault(holders[e][tried[e]], []).append(e)
        for s, wanted in by_step.items():
            verified = here_sums if s == newest else {}
            got, bad = _read_copies(
                item_of(s), keys, wanted, metas[s], copies[s], verified, stacks
            )
            for e in wanted:
                if e in bad:
                    tried[e] += 1
                    fallback = holders[e][tried[e]] if tried[e] < len(holders[e]) else None
                    log.warning(
                        "checkpoint at step %d: %s of %s %d of %s %d unusable (%s); "
                        "using the copy at step %s",
                        s, slot[1], ROW, e, STACK, slot[0], bad[e], fallback,
                    )
                    emit(
                        {
                            "event": FALLBACK_EVENT,
                            "step": s,
                            STACK: slot[0],
                            ROW: e,
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
    wanted: list[int],
    meta: dict[str, Any],
    held: Copies,
    here_sums: dict[str, Any],
    stacks: RowStacks,
) -> tuple[dict[str, dict[int, Any]], dict[int, str]]:
    """Rows ``wanted`` of ``keys`` in the rows ``item`` of a step (``{key: {row: data}}``; a
    row already on the devices, verified by ``here_sums``, is its position there) and the rows
    whose copy failed, with why. One read per key; a read that raises is retried row by
    row."""
    got: dict[str, dict[int, Any]] = {k: {} for k in keys}
    bad: dict[int, str] = {}
    for key in keys:
        positions = [held[key].index(e) for e in wanted]
        saved = meta["checksums"][key]
        if key in here_sums:
            for e, pos in zip(wanted, positions, strict=True):
                got[key][e] = pos
                if here_sums[key][pos] != saved[pos]:
                    bad.setdefault(e, f"{key}: checksum mismatch (corrupted data)")
            continue
        try:
            parts = [(wanted, positions, layout.read_rows(item, key, positions))]
        except Exception:  # noqa: BLE001 - find which rows do not read
            parts = []
            for e, pos in zip(wanted, positions, strict=True):
                try:
                    parts.append(([e], [pos], layout.read_rows(item, key, [pos])))
                except Exception as err:  # noqa: BLE001 - this row falls back
                    bad.setdefault(e, f"{key}: {type(err).__name__}: {err}")
        for es, ps, data in parts:
            sums = layout.checksums({key: jnp.asarray(data)}, stacks)[key]
            for i, (e, pos) in enumerate(zip(es, ps, strict=True)):
                got[key][e] = data[i]
                if sums[i] != saved[pos]:
                    bad.setdefault(e, f"{key}: checksum mismatch (corrupted data)")
    return got, bad


def everywhere(ok: bool) -> bool:
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
