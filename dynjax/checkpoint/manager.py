"""Asynchronous, atomic, verified checkpoints on top of Orbax's CheckpointManager.

A save copies the state to host, computes per-array checksums, and hands the arrays to Orbax,
which writes them in the background into a temporary directory and renames it when complete, so
a killed process never leaves a checkpoint that looks finished. A restore checks every item's
structure, shapes and checksums against what was saved; a corrupt or half-written checkpoint is
reported and the previous one is used. State is restored to host and then placed with the
*current* shardings, so a run may resume on a different ``mesh.data``/``mesh.expert``.
"""

from __future__ import annotations

import logging
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


class CheckpointError(RuntimeError):
    """No checkpoint in the directory could be restored and verified."""


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

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Start saving ``state`` (a pytree) at ``step``; returns once it is copied to host."""
        start = time.perf_counter()
        items = layout.split_items(jax.device_get(state))
        meta = {**meta, "step": step, "checksums": layout.checksums(items)}
        args = {name: ocp.args.StandardSave(layout.nest(item)) for name, item in items.items()}
        self._manager.save(step, args=ocp.args.Composite(**args, **{META: ocp.args.JsonSave(meta)}))
        self.emit(
            {
                "event": "checkpoint",
                "step": step,
                "items": len(items),
                "bytes": int(sum(a.nbytes for item in items.values() for a in item.values())),
                "blocking_seconds": round(time.perf_counter() - start, 4),
            }
        )

    def restore_latest(self, template: Any) -> tuple[Any, dict[str, Any]] | None:
        """Newest checkpoint that restores and verifies, as (host state, meta); None if none exist.

        ``template`` gives the expected tree, shapes and dtypes (arrays or ShapeDtypeStructs).
        """
        steps = self.all_steps()
        for step in reversed(steps):
            try:
                return self.restore(step, template)
            except Exception as err:  # noqa: BLE001 - any failure means: fall back to an older one
                log.warning(
                    "checkpoint at step %d is unusable (%s); trying the previous one", step, err
                )
                self.emit({"event": "checkpoint_restore_failed", "step": step, "error": str(err)})
        if steps:
            raise CheckpointError(
                f"none of the checkpoints {steps} in {self._manager.directory} could be restored; "
                "see the warnings above, or start from a new workdir"
            )
        return None

    def restore(self, step: int, template: Any) -> tuple[Any, dict[str, Any]]:
        start = time.perf_counter()
        expected = layout.split_items(jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), template))
        meta = self._manager.restore(
            step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()})
        )[META]
        saved_sums = meta.get("checksums", {})
        if set(saved_sums) != set(expected):
            raise CheckpointError(
                f"step {step} holds items {sorted(saved_sums)}, the model expects "
                f"{sorted(expected)}: the checkpoint is from a different model configuration"
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
        return state, meta

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
