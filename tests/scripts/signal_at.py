"""``python tests/scripts/signal_at.py STEP SIGNAL COUNT ARGS...``: the training CLI, sent
``SIGNAL`` (e.g. SIGTERM) ``COUNT`` times by itself once step ``STEP`` (1-based) is dispatched,
as a scheduler's notice arrives while a step is in flight."""

import os
import signal
import sys

from dynjax import train
from dynjax.recompile import Monitor

STEP, SIGNAL, COUNT = int(sys.argv[1]), signal.Signals[sys.argv[2]], int(sys.argv[3])
_push = Monitor.push


def push_then_signal(self, step, metrics):
    _push(self, step, metrics)
    if step + 1 == STEP:
        for _ in range(COUNT):
            os.kill(os.getpid(), SIGNAL)


Monitor.push = push_then_signal
sys.exit(train.main(sys.argv[4:]))
