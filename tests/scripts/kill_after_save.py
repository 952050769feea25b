"""``python tests/scripts/kill_after_save.py STEP ARGS...``: the training CLI, killed (SIGKILL) by
itself right after the checkpoint of ``STEP`` is saved: a crash at the worst moment for a
re-save."""

import os
import signal
import sys

from dynjax import train
from dynjax.checkpoint import Checkpointer

STEP = int(sys.argv[1])
_save = Checkpointer.save


def save_then_die(self, step, state, meta, **partial):
    saved = _save(self, step, state, meta, **partial)
    if step == STEP:
        self.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    return saved


Checkpointer.save = save_then_die
sys.exit(train.main(sys.argv[2:]))
