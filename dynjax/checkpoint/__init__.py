"""Orbax checkpoints in a fixed number of items, saved and restored shard by shard, with any
subset of experts of any MoE layer readable alone (`layout`)."""

from dynjax.checkpoint.errors import CheckpointError, CheckpointMismatch, ExpertsMissing
from dynjax.checkpoint.manager import Checkpointer

__all__ = ["CheckpointError", "CheckpointMismatch", "Checkpointer", "ExpertsMissing"]
