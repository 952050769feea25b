"""The local launcher's output: every process's lines in ``<workdir>/launch.log``, the
collectives' connection lines kept off the console (issue 32 §7)."""

import io
from pathlib import Path

from dynjax.launch.local import _relay, workdir_of


def test_connection_lines_go_to_the_log_only(capsys):
    out = b"[Gloo] Rank 1 is connected to 1 peer ranks.\nstep 1 loss 5.0\n[Gloo] Rank 0 ...\n"
    log = io.StringIO()
    _relay(1, io.BytesIO(out), log)
    assert capsys.readouterr().out == "[1] step 1 loss 5.0\n"
    assert log.getvalue().splitlines() == [
        "[1] [Gloo] Rank 1 is connected to 1 peer ranks.", "[1] step 1 loss 5.0",
        "[1] [Gloo] Rank 0 ...",
    ]


def test_the_workdir_is_the_one_train_takes():
    assert workdir_of(["--config", "configs/moe.py", "--workdir=/runs/a"]) == Path("/runs/a")
    assert workdir_of(["--config=configs/moe.py", "--config.train.steps=3"]) == Path(
        "workdirs/moe"
    )
