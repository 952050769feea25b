"""Why a checkpoint does not restore."""


class CheckpointError(RuntimeError):
    """No checkpoint in the directory could be restored and verified."""


class CheckpointMismatch(CheckpointError):
    """An intact checkpoint that does not fit the model: an error of the run, not of the data."""


class RowsMissing(CheckpointError):
    """Some row of a row-stacked leaf has no usable copy in any checkpoint up to the one
    restored: older steps cannot serve it either, so no step is moved aside."""


class NoSpaceError(CheckpointError):
    """The checkpoint directory's filesystem cannot hold another checkpoint: no later save can
    succeed, so the run stops with the newest good checkpoint named."""
