"""Orbax checkpoints with every expert of every MoE layer addressable as its own item."""

from dynjax.checkpoint.manager import Checkpointer, CheckpointError, CheckpointMismatch

__all__ = ["CheckpointError", "CheckpointMismatch", "Checkpointer"]
