"""``python tests/scripts/kill_at.py STEP WHEN ARGS...``: the training CLI, killed (SIGKILL) by
itself at step ``STEP`` (1-based): ``WHEN`` = ``step`` once that step is dispatched (its
computation in flight), ``mid_save`` as soon as the save of that step has started (with
asynchronous saves, while Orbax still writes it), ``after_save`` once that save is complete.
Fault injection for the partial expert checkpoint tests."""

import os
import signal
import sys

from dynjax import train
from dynjax.checkpoint import Checkpointer
from dynjax.recompile import Monitor

STEP, WHEN = int(sys.argv[1]), sys.argv[2]
_save, _push = Checkpointer.save, Monitor.push


def save_then_die(self, step, state, meta, **partial):
    saved = _save(self, step, state, meta, **partial)
    if step == STEP and WHEN in ("mid_save", "after_save"):
        if WHEN == "after_save":
            self.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    return saved


def push_then_die(self, step, metrics):
    _push(self, step, metrics)
    if step + 1 == STEP and WHEN == "step":
        os.kill(os.getpid(), signal.SIGKILL)


Checkpointer.save, Monitor.push = save_then_die, push_then_die
sys.exit(train.main(sys.argv[3:]))
