"""The local launcher's output: every process's lines in ``<workdir>/launch.log``, the
collectives' connection lines kept off the console (issue 32 §7); ``--pin-cores`` (issue 33 §1)."""

import io
import json
import os
import re
import sys
from pathlib import Path

import pytest

from dynjax.errors import ConfigError
from dynjax.launch.local import (
    PIN_XLA_FLAG,
    _relay,
    cores_for,
    launch,
    main,
    process_env,
    workdir_of,
)


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


REPORT = "import os; print(sorted(os.sched_getaffinity(0)), os.environ.get('XLA_FLAGS', ''))"


def _children_report(pin_cores: bool) -> dict[int, tuple[list[int], str]]:
    """What each of 2 launched children says of its cores and XLA flags, by rank."""
    log = io.StringIO()
    status = launch(2, 1, [sys.executable, "-c", REPORT], log, pin_cores=pin_cores)
    assert status == 0, log.getvalue()
    said = {}
    for line in log.getvalue().splitlines():
        rank, cores, flags = re.fullmatch(r"\[(\d)\] (\[[\d, ]*\]) ?(.*)", line).groups()
        said[int(rank)] = (json.loads(cores), flags)
    return said


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_pinned_children_each_run_on_their_own_core_single_threaded():
    mine = sorted(os.sched_getaffinity(0))
    said = _children_report(pin_cores=True)
    assert [said[r][0] for r in (0, 1)] == [[mine[0]], [mine[1]]]
    assert all(PIN_XLA_FLAG in said[r][1].split() for r in (0, 1))
    assert sorted(os.sched_getaffinity(0)) == mine  # the launcher's own cores are put back


def test_unpinned_children_keep_every_core():
    mine = sorted(os.sched_getaffinity(0))
    said = _children_report(pin_cores=False)
    assert [said[r][0] for r in (0, 1)] == [mine, mine]
    assert all(PIN_XLA_FLAG not in said[r][1] for r in (0, 1))


def test_a_user_eigen_flag_gives_way_to_the_pinned_one(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true --xla_dump_to=/tmp/x")
    flags = process_env(0, 2, 1, 1234, pinned=True)["XLA_FLAGS"].split()
    assert flags == ["--xla_dump_to=/tmp/x", PIN_XLA_FLAG]


def test_more_processes_than_cores_is_refused(capsys):
    too_many = len(os.sched_getaffinity(0)) + 1
    with pytest.raises(ConfigError, match="--pin-cores needs a core per process"):
        cores_for(too_many)
    status = main(["--processes", str(too_many), "--pin-cores", "--", "--config", "x.py"])
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --pin-cores needs a core per process") and "--processes <=" in err
