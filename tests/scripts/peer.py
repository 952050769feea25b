"""``python tests/scripts/peer.py PLAN WORKDIR``: one process of a multi-process run (the
``DYNJAX_*`` variables of `dynjax.launch.local.process_env`) that only joins it, for the
watchdog's tests. PLAN gives each process id's ``ACTION:SECONDS``, comma-separated
(``exit:20,die:1``): after joining and sleeping SECONDS, ``die`` kills itself (SIGKILL) and
``exit`` returns normally; ``raise`` is `dynjax.train.main` whose training raises after SECONDS."""

import os
import signal
import sys
import time

import jax

from dynjax import train
from dynjax.launch.distributed import initialize_from_env

PLAN, WORKDIR = sys.argv[1].split(","), sys.argv[2]
ACTION, SECONDS = PLAN[int(os.environ["DYNJAX_PROCESS_ID"])].split(":")


def boom(*args, **kwargs):
    time.sleep(float(SECONDS))
    raise RuntimeError("injected")


if ACTION == "raise":
    train.train = boom
    sys.exit(train.main(["--config", "tests/tiny.py", "--workdir", WORKDIR]))
initialize_from_env()
print("joined", jax.device_count(), "devices", flush=True)  # the backend: a collective too
time.sleep(float(SECONDS))
if ACTION == "die":
    os.kill(os.getpid(), signal.SIGKILL)
