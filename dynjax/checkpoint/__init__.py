"""Orbax checkpoints in a fixed number of items, saved and restored shard by shard, with any
subset of rows of any row-stacked leaf readable alone (`layout`, `rows`)."""

from dynjax.checkpoint.errors import CheckpointError, CheckpointMismatch, RowsMissing
from dynjax.checkpoint.manager import Checkpointer
from dynjax.checkpoint.rows import NO_ROWS, RowStacks

__all__ = [
    "NO_ROWS",
    "CheckpointError",
    "CheckpointMismatch",
    "Checkpointer",
    "RowStacks",
    "RowsMissing",
]
