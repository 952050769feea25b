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
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from dynjax.checkpoint import layout

log = logging.getLogger(__name__)
META = "meta"
QUARANTINE = "corrupt"  # beside the steps; Orbax lists only integer step directories


class CheckpointError(RuntimeError):
    """No checkpoint in the directory could be restored and verified."""


class CheckpointMismatch(CheckpointError):
    """An intact checkpoint that does not fit the model: an error of the run, not of the data."""


class Checkpointer:
    """Save and restore ``{"params": ..., "opt_state": ...}`` plus JSON metadata per step."""

    def __init__(
        self,
        directory: Path,
        *,
        keep: int,
        async_save: bool = True,
        emit: Callable[[dict[str, Any]], None] = lambda event: None,
    ):
        self.emit = emit
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True
        )
        self._manager = ocp.CheckpointManager(Path(directory).absolute(), options=options)

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> bool:
        """Start saving ``state`` (a pytree of jax.Arrays) at ``step``; returns once each
        device's shards are copied to host (the next step may donate the arrays).

        Returns whether the save was started. A save Orbax refuses (the step exists, or is not
        newer than the latest) or that raises (including an earlier asynchronous save's error,
        which Orbax reports here) is a ``checkpoint_failed`` event and a warning: training
        goes on and later saves are still tried.
        """
        start = time.perf_counter()
        items = layout.split(state)
        flat = {**items[layout.DENSE], **items[layout.EXPERTS]}
        meta = {**meta, "step": step, "layout": layout.LAYOUT, "checksums": layout.checksums(flat)}
        # One storage chunk per expert: a later read of a few experts touches only theirs.
        per_expert = ocp.SaveArgs(shard_axes=(0,))
        chunks = {layout.EXPERTS: layout.nest({k: per_expert for k in items[layout.EXPERTS]})}
        args = {
            name: ocp.args.StandardSave(layout.nest(item), save_args=chunks.get(name))
            for name, item in items.items()
            if item  # a model without MoE layers has no ``experts`` item
        }
        try:
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
            log.warning("checkpoint at step %d was not saved: %s", step, error)
            self.emit({"event": "checkpoint_failed", "step": step, "error": error})
            return False
        self.emit(
            {
                "event": "checkpoint",
                "step": step,
                "items": len(args) + 1,
                "bytes": int(sum(a.nbytes for a in flat.values())),
                "blocking_seconds": round(time.perf_counter() - start, 4),
            }
        )
        return True

    def restore_latest(
        self, target: Callable[[dict[str, Any]], Any]
    ) -> tuple[Any, dict[str, Any]] | None:
        """Newest checkpoint that restores and verifies, as (state, meta); None if none exist.

        ``target(meta)`` gives, for each candidate's metadata and before any array is read,
        the tree to restore into: ``jax.ShapeDtypeStruct``s whose shardings say where each
        shard goes. What it raises (e.g. a config the checkpoint cannot serve) propagates and
        moves nothing. A checkpoint that fails to read or verify is quarantined and the
        previous one is tried.
        """
        steps = self.all_steps()
        for step in reversed(steps):
            try:
                meta = self._read_meta(step)
            except Exception as err:  # noqa: BLE001 - unreadable metadata: a broken checkpoint
                self._quarantine(step, err)
                continue
            template = target(meta)
            try:
                return self._restore_items(step, template, meta), meta
            except CheckpointMismatch:
                raise
            except Exception as err:  # noqa: BLE001 - any failure means: fall back to an older one
                self._quarantine(step, err)
        if steps:
            raise CheckpointError(
                f"none of the checkpoints {steps} in {self._manager.directory} could be restored; "
                f"they are kept in {self._manager.directory / QUARANTINE}: see the warnings "
                "above, or start from a new workdir"
            )
        return None

    def restore(self, step: int, template: Any) -> tuple[Any, dict[str, Any]]:
        """The checkpoint at ``step`` (no fallback, nothing moved), as (state, meta), placed
        with ``template``'s shardings."""
        meta = self._read_meta(step)
        return self._restore_items(step, template, meta), meta

    def restore_experts(
        self, step: int, key: str, experts: Sequence[int]
    ) -> np.ndarray:
        """Rows ``experts`` of the expert leaf ``key`` (e.g. ``params/layers/1/moe/w_in``) of
        the checkpoint at ``step``, [len(experts), ...], verified: only those experts' chunks
        are read (the module docstring of `layout`). What a partial restore builds on."""
        meta = self._read_meta(step)
        sums = meta.get("checksums", {}).get(key)
        if meta.get("layout") != layout.LAYOUT or not isinstance(sums, list):
            raise CheckpointMismatch(
                f"step {step} holds no expert array {key!r} in layout {layout.LAYOUT}"
            )
        rows = layout.read_rows(self._step_dir(step) / layout.EXPERTS, key, experts)
        got = layout.checksums({key: jnp.asarray(rows)})[key]
        for e, row_sum in zip(experts, got, strict=True):
            if row_sum != sums[e]:
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
        self.emit(
            {
                "event": "checkpoint_restore",
                "step": step,
                "seconds": round(time.perf_counter() - start, 4),
            }
        )
        return state

    def _read_layout2(self, step: int, template: Any, meta: dict[str, Any]) -> Any:
        """Each shard read straight onto its device in ``template``'s sharding; the checksums
        computed there and compared with the saved ones."""
        expected = layout.split(template)
        saved_sums = meta.get("checksums", {})
        want = {**expected[layout.DENSE], **expected[layout.EXPERTS]}
        _check_fits(step, saved_sums, layout.shapes(want))
        args = {
            name: ocp.args.StandardRestore(layout.nest(item))
            for name, item in expected.items()
            if item
        }
        restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        flat = {k: v for name in args for k, v in layout.denest(restored[name]).items()}
        _check_shapes(step, flat, want)
        for key, got in layout.checksums(flat).items():
            if got != saved_sums[key]:
                raise CheckpointError(f"step {step} {key}: checksum mismatch (corrupted data)")
        return layout.unflatten_like(template, flat)

    def _read_layout1(self, step: int, template: Any, meta: dict[str, Any]) -> Any:
        """A checkpoint written before layout 2 (one item per expert): read to host, verified
        there, and placed with ``template``'s shardings."""
        expected = layout.v1_items(template)
        saved_sums = meta.get("checksums", {})
        # Layout 1 recorded a scalar's shape as [1]: its shapes are checked once read.
        _check_fits(
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
        """Move the unusable checkpoint at ``step`` aside (never delete what a run trained)."""
        root = Path(self._manager.directory)
        stamp = time.strftime("%Y%m%dT%H%M%S")
        target = root / QUARANTINE / f"{step}-{stamp}"
        n = 1
        while target.exists():
            n, target = n + 1, root / QUARANTINE / f"{step}-{stamp}-{n}"
        target.parent.mkdir(exist_ok=True)
        shutil.move(str(root / str(step)), str(target))
        self._manager.reload()
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

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _check_fits(step: int, saved: dict[str, Any], expected: dict[str, str | None]) -> None:
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
