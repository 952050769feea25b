"""``python tests/scripts/disk_full_from.py STEP ARGS...``: the training CLI on a filesystem
that fills up at step ``STEP``: every save from it on fails with ENOSPC and no space is free."""

import errno
import shutil
import sys

import orbax.checkpoint as ocp

from dynjax import train
from dynjax.checkpoint import manager

STEP = int(sys.argv[1])
_save, _usage = ocp.CheckpointManager.save, shutil.disk_usage


def save(self, step, *args, **kwargs):
    if step >= STEP:
        raise OSError(errno.ENOSPC, "No space left on device")
    return _save(self, step, *args, **kwargs)


ocp.CheckpointManager.save = save
manager.shutil.disk_usage = lambda path: _usage(path)._replace(free=0)
sys.exit(train.main(sys.argv[2:]))
