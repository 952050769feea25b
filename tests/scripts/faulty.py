"""``python tests/scripts/faulty.py KIND STEP ARGS...``: the training CLI with one fault at step
``STEP`` (1-based), for the fault-injection soak test (tests/test_faults.py):

- ``kill``: SIGKILL once the step is dispatched (its computation in flight);
- ``term``: SIGTERM once it is dispatched (a scheduler's notice: the run saves and exits 75);
- ``kill_after_save``: SIGKILL right after the save of the step is complete;
- ``enospc``: the save of the step fails with a full disk (space is free again after), and the
  process is killed (SIGKILL) once the next step is dispatched.
"""

import errno
import os
import signal
import sys

import orbax.checkpoint as ocp

from dynjax import train
from dynjax.checkpoint import Checkpointer
from dynjax.recompile import Monitor

KIND, STEP = sys.argv[1], int(sys.argv[2])
_push, _save, _manager_save = Monitor.push, Checkpointer.save, ocp.CheckpointManager.save


def push(self, step, metrics):
    _push(self, step, metrics)
    due = {"kill": STEP, "term": STEP, "enospc": STEP + 1}.get(KIND)
    if step + 1 == due:
        os.kill(os.getpid(), signal.SIGTERM if KIND == "term" else signal.SIGKILL)


def save(self, step, state, meta, **rows):
    saved = _save(self, step, state, meta, **rows)
    if KIND == "kill_after_save" and step == STEP:
        self.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    return saved


def manager_save(self, step, *args, **kwargs):
    if KIND == "enospc" and step == STEP:
        raise OSError(errno.ENOSPC, "No space left on device")
    return _manager_save(self, step, *args, **kwargs)


Monitor.push, Checkpointer.save, ocp.CheckpointManager.save = push, save, manager_save
sys.exit(train.main(sys.argv[3:]))
