"""A process of a multi-process run that dies stops the others (issue 15 §4). Covered here: the
watchdog's judgement, its thread in two real processes (started directly, without a launcher),
and what ``dynjax.launch.local`` reports."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynjax.launch import local
from dynjax.launch.watchdog import DONE, FAILED, RESUME, Peers

from ..helpers import ROOT


def test_a_peer_whose_beat_stops_is_named_after_the_timeout_not_before():
    peers = Peers(me=0, count=3, timeout=10, now=0)
    for t in range(1, 10):
        assert peers.update({0: str(t), 1: str(t), 2: "1"}, now=t) is None  # 2 beat once
    assert peers.update({0: "10", 1: "10", 2: "1"}, now=10.5) is None
    assert peers.update({0: "11", 1: "11", 2: "1"}, now=11.5) == (
        "process 2 (of 3) stopped responding (no heartbeat for 10 s)"
    )
    # One that never beat at all is dead too, counted from the watchdog's start.
    assert Peers(me=1, count=2, timeout=10, now=0).update({}, now=10.5) == (
        "process 0 (of 2) stopped responding (no heartbeat for 10 s)"
    )


def test_a_finished_peer_is_not_dead_and_a_failed_one_is_named():
    peers = Peers(me=1, count=3, timeout=10, now=0)
    assert peers.update({0: DONE, 2: "1"}, now=1) is None
    assert not peers.all_done() and not peers.all_beat_since(1)
    assert peers.update({0: DONE, 2: "2"}, now=100) is None  # 0 finished long ago: not dead
    assert peers.all_beat_since(1)  # both have shown they are alive (or done) since t = 1
    assert peers.update({0: DONE, 2: FAILED}, now=101) == "process 2 (of 3) failed (see its output)"
    assert peers.update({0: DONE, 2: DONE}, now=102) is None and peers.all_done()


def start(plan: str, tmp_path: Path, heartbeat: str = "2") -> list[subprocess.Popen]:
    """The two processes of tests/scripts/peer.py, each started on its own (no launcher)."""
    port = local.free_port()
    return [
        subprocess.Popen(
            [sys.executable, "tests/scripts/peer.py", plan, str(tmp_path / f"w{rank}")],
            cwd=ROOT,
            env={**local.process_env(rank, 2, 1, port), "PYTHONPATH": str(ROOT),
                 "DYNJAX_HEARTBEAT_SECONDS": heartbeat},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]


def ended(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """Exit status and stderr; a process still running after ``timeout`` s fails the test."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running after {timeout} s:\n{proc.communicate()[1][-3000:]}")
    return proc.returncode, err


def test_a_killed_process_stops_the_other_naming_it(tmp_path):
    survivor, victim = start("exit:600,die:1", tmp_path)
    assert ended(victim, 120)[0] == -9
    dead = time.monotonic()
    code, err = ended(survivor, 30)
    print(f"process 0 stopped {time.monotonic() - dead:.1f} s after process 1 died (timeout 2 s)")
    assert code == 1
    assert f"error: process 1 (of 2) stopped responding (no heartbeat for 2 s); {RESUME}" in err


def test_an_error_in_one_process_stops_the_other_without_waiting_for_a_timeout(tmp_path):
    survivor, failing = start("exit:600,raise:1", tmp_path, heartbeat="600")
    code, err = ended(failing, 120)
    assert code == 1 and "RuntimeError: injected" in err
    code, err = ended(survivor, 30)
    assert code == 1
    assert f"error: process 1 (of 2) failed (see its output); {RESUME}" in err


def test_processes_that_finish_apart_are_not_dead(tmp_path):
    """Process 1 ends 2.5 heartbeat timeouts after process 0: both succeed, nothing reported."""
    procs = start("exit:0,exit:5", tmp_path)
    for proc in procs:
        code, err = ended(proc, 120)
        assert code == 0, err[-3000:]
        assert "error:" not in err


def test_launch_local_names_the_dead_process_and_returns_its_status(capsys):
    dies = "import os, signal, time\n" \
        "if os.environ['DYNJAX_PROCESS_ID'] == '1': os.kill(os.getpid(), signal.SIGKILL)\n" \
        "time.sleep(600)"
    start = time.monotonic()
    assert local.launch(2, 1, [sys.executable, "-c", dies]) == 128 + 9  # as a shell reports it
    assert time.monotonic() - start < 60  # process 0 was stopped, not waited for
    assert capsys.readouterr().err == f"error: process 1 (of 2) was killed by SIGKILL; {RESUME}\n"
    # Both exit with 3; whichever the launcher sees first is named (a loaded machine may start
    # process 0 last).
    assert local.launch(2, 1, [sys.executable, "-c", "import sys; sys.exit(3)"]) == 3
    assert re.match(r"error: process [01] \(of 2\) exited with status 3;", capsys.readouterr().err)
