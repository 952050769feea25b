"""The Orbax handlers dynjax's checkpoint managers are given, scoped to those managers (nothing
registered globally, so importing dynjax changes no other Orbax user's writes): replica-parallel
array writes for a checkpoint every process writes into, and a part's process writing alone.

Replica-parallel (`manager` module docstring): a leaf replicated over data-parallel ranks is
written by every replica, each its slice of the leaf's first axis; Orbax's default leaves it off
on GPUs, dynjax turns it on everywhere. It only changes how a save writes: a manager that only
reads (`parts.Sources`) keeps Orbax's defaults.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from dynjax.checkpoint import layout
from dynjax.checkpoint.read import META
from jax_private import array_metadata_store


def _replica_parallel_types() -> Any:
    """Orbax's default type handlers, with jax.Arrays written replica-parallel."""
    th = ocp.type_handlers
    arrays = th.ArrayHandler(
        use_replica_parallel=True, array_metadata_store=array_metadata_store()
    )
    return th.create_type_handler_registry(
        (int, th.ScalarHandler()),
        (float, th.ScalarHandler()),
        (bytes, th.ScalarHandler()),
        (np.number, th.ScalarHandler()),
        (np.ndarray, th.NumpyHandler()),
        (jax.Array, arrays),
        (str, th.StringHandler()),
    )


class _ReplicaParallel(ocp.StandardCheckpointHandler):
    """Orbax's `StandardCheckpointHandler` (the same arguments, files and defaults) over a
    pytree handler of its own type registry. Orbax takes no registry for it, so its inner
    handler (``_impl``, Orbax 0.12) is replaced: the one fragile line of this module."""

    def __init__(self) -> None:
        super().__init__()
        self._impl = ocp.PyTreeCheckpointHandler(
            save_concurrent_gb=96,  # StandardCheckpointHandler's defaults
            restore_concurrent_gb=96,
            type_handler_registry=_replica_parallel_types(),
        )


def whole_handlers() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """A manager's handlers for the dense and rows items of a checkpoint every process
    writes its shards into (the metadata item keeps Orbax's JSON handler)."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item in (layout.DENSE, layout.ROWS):
        handler = _ReplicaParallel()
        registry.add(item, ocp.args.StandardSave, handler)
        registry.add(item, ocp.args.StandardRestore, handler)
    return registry


def part_handlers(alone: ocp.options.MultiprocessingOptions) -> dict[str, Any]:
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
        layout.ROWS: tree(),
        META: ocp.JsonCheckpointHandler(multiprocessing_options=alone),
    }
