"""``python tests/scripts/die_once.py STEP MARKER ARGS...``: the training CLI; process 1 of a
multi-process run kills itself (SIGKILL) right after saving step ``STEP``, once: it leaves
``MARKER`` behind, so that a restarted run trains on (a host lost for good)."""

import os
import signal
import sys
import time
from pathlib import Path

from dynjax import train
from dynjax.checkpoint import Checkpointer

STEP, MARKER = int(sys.argv[1]), Path(sys.argv[2])
_save = Checkpointer.save


def save_then_die(self, step, state, meta, **partial):
    saved = _save(self, step, state, meta, **partial)
    if step == STEP and os.environ.get("DYNJAX_PROCESS_ID") == "1" and not MARKER.exists():
        self.wait()
        MARKER.write_text(str(time.time()))  # when it died
        os.kill(os.getpid(), signal.SIGKILL)
    return saved


Checkpointer.save = save_then_die
sys.exit(train.main(sys.argv[3:]))
