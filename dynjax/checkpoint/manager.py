"""Asynchronous, atomic, verified checkpoints on top of Orbax's CheckpointManager.

A save copies the state to host, computes per-array checksums, and hands the arrays to Orbax,
which writes them in the background into a temporary directory and renames it when complete, so
a killed process never leaves a checkpoint that looks finished. A restore checks every item's
structure, shapes and checksums against what was saved. A checkpoint that cannot be read or
verified is moved aside to ``corrupt/<step>-<time>`` (kept for a person to inspect, never
deleted) and the previous one is used; moving it also frees its step for the next save and keeps
it out of ``keep``. A checkpoint that is intact but does not fit the model is an error, never
moved. A save that Orbax refuses or that fails is an event and a warning, never a success.
State is restored to host and then placed with the *current* shardings, so a run may resume on a
different ``mesh.data``/``mesh.expert``.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
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
        """Start saving ``state`` (a pytree) at ``step``; returns once it is copied to host.

        Returns whether the save was started. A save Orbax refuses (the step exists, or is not
        newer than the latest) or that raises (including an earlier asynchronous save's error,
        which Orbax reports here) is a ``checkpoint_failed`` event and a warning: training
        goes on and later saves are still tried.
        """
        start = time.perf_counter()
        items = layout.split_items(jax.device_get(state))
        meta = {**meta, "step": step, "checksums": layout.checksums(items)}
        args = {name: ocp.args.StandardSave(layout.nest(item)) for name, item in items.items()}
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
                "items": len(items),
                "bytes": int(sum(a.nbytes for item in items.values() for a in item.values())),
                "blocking_seconds": round(time.perf_counter() - start, 4),
            }
        )
        return True

    def restore_latest(
        self, template: Any, check: Callable[[dict[str, Any]], None] = lambda meta: None
    ) -> tuple[Any, dict[str, Any]] | None:
        """Newest checkpoint that restores and verifies, as (host state, meta); None if none exist.

        ``template`` gives the expected tree, shapes and dtypes (arrays or ShapeDtypeStructs).
        ``check`` sees each candidate's metadata before its arrays are read; what it raises
        (e.g. a config the checkpoint cannot serve) propagates and moves nothing. A checkpoint
        that fails to read or verify is quarantined and the previous one is tried.
        """
        steps = self.all_steps()
        for step in reversed(steps):
            try:
                meta = self._read_meta(step)
            except Exception as err:  # noqa: BLE001 - unreadable metadata: a broken checkpoint
                self._quarantine(step, err)
                continue
            check(meta)
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
        """The checkpoint at ``step`` (no fallback, nothing moved), as (host state, meta)."""
        meta = self._read_meta(step)
        return self._restore_items(step, template, meta), meta

    def _read_meta(self, step: int) -> dict[str, Any]:
        meta = self._manager.restore(
            step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()})
        )[META]
        if not isinstance(meta, dict):
            raise CheckpointError(f"step {step}: metadata is {type(meta).__name__}, not a dict")
        return meta

    def _restore_items(self, step: int, template: Any, meta: dict[str, Any]) -> Any:
        start = time.perf_counter()
        expected = layout.split_items(jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), template))
        saved_sums = meta.get("checksums", {})
        if set(saved_sums) != set(expected):
            raise CheckpointMismatch(
                f"step {step} holds items {sorted(saved_sums)}, the model expects "
                f"{sorted(expected)}: the checkpoint is from a different model configuration; "
                "train it with that configuration or start from a new workdir"
            )
        args = {
            name: ocp.args.StandardRestore(layout.nest(item)) for name, item in expected.items()
        }
        restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        items = {name: layout.denest(restored[name]) for name in expected}
        for name, item in items.items():
            _verify(step, name, item, expected[name], saved_sums[name])
        state = layout.join_items(template, items)
        self.emit(
            {
                "event": "checkpoint_restore",
                "step": step,
                "seconds": round(time.perf_counter() - start, 4),
            }
        )
        return state

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


def _verify(step: int, name: str, got: dict, want: dict, sums: dict[str, str]) -> None:
    if set(got) != set(want):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        raise CheckpointError(f"step {step} item {name!r}: missing {missing}, unexpected {extra}")
    for key, arr in got.items():
        if arr.shape != want[key].shape or arr.dtype != want[key].dtype:
            raise CheckpointError(
                f"step {step} {name}/{key}: saved {arr.dtype}{list(arr.shape)}, model expects "
                f"{want[key].dtype}{list(want[key].shape)}"
            )
        if layout.checksum(arr) != sums.get(key):
            raise CheckpointError(f"step {step} {name}/{key}: checksum mismatch (corrupted data)")
