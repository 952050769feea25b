"""A run stopped by a scheduler's notice (SIGTERM, SIGINT, SIGUSR1) saves the step in flight,
says where, exits with `PREEMPTED_EXIT`, and resumes to the losses of an uninterrupted run; a
second signal aborts at once; over processes every process stops and saves at the same step."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dynjax.launch.preemption import PREEMPTED_EXIT, StopRequest
from dynjax.recompile.agreement import Status, verdict
from dynjax.train import train

from ..helpers import (
    ROOT,
    TWO_PROCESS_BASE,
    TWO_PROCESS_LAYOUTS,
    events_of,
    losses,
    two_processes,
)
from ..tiny import tiny_config

RUN = {"train__steps": 12, "train__checkpoint_every": 100, "train__eval_every": 1000}


def signalled(workdir: Path, step: int, sig: str, count: int = 1) -> subprocess.CompletedProcess:
    """The training CLI on `RUN`, sent ``sig`` ``count`` times when step ``step`` is dispatched."""
    cmd = [
        sys.executable, "tests/scripts/signal_at.py", str(step), sig, str(count),
        "--config=tests/tiny.py", f"--workdir={workdir}",
        *(f"--config.{k.replace('__', '.')}={v}" for k, v in RUN.items()),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGUSR1"])
def test_a_signal_saves_the_step_in_flight_and_the_rerun_trains_as_if_uninterrupted(
    tmp_path, sig
):
    reference = tmp_path / "reference"
    train(tiny_config(**RUN), reference, progress=False)
    run = tmp_path / "run"
    done = signalled(run, 5, sig)
    assert done.returncode == PREEMPTED_EXIT, done.stdout[-2000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    [preempted] = events_of(run, "preempted")
    assert preempted["step"] == 5 and preempted["signal"] == sig and preempted["saved"]
    assert f"preempted by {sig}: saved step 5 in {run / 'checkpoints'}" in done.stdout
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [5]
    # Every step trained before the stop is logged (none lost Δ steps late).
    assert set(losses(run)) == set(range(1, 6))

    summary = train(tiny_config(**RUN), run, progress=False)
    assert summary.start_step == 5 and summary.preempted_by is None
    got, want = losses(run), losses(reference)
    assert got == want  # every step, bit for bit


def test_a_second_signal_aborts_at_once_without_saving(tmp_path):
    done = signalled(tmp_path, 3, "SIGTERM", count=2)
    assert done.returncode == -signal.SIGTERM
    assert not events_of(tmp_path, "preempted")
    assert not (tmp_path / "checkpoints").exists() or not any(
        p.name.isdigit() for p in (tmp_path / "checkpoints").iterdir()
    )


def test_a_stop_asked_by_one_process_holds_for_every_process():
    """The boundary's verdict carries a stop any process asked for, so all stop there."""
    assert verdict([Status(), Status()]).stop is None
    assert verdict([Status(), Status(stop="SIGTERM")]).stop == "SIGTERM"
    assert verdict([Status(stop="SIGUSR1"), Status(stop="SIGTERM")]).stop == "SIGUSR1"
    assert verdict([Status(failed=(1, "boom")), Status(stop="SIGTERM")]).stop == "SIGTERM"


def test_the_handlers_come_back_and_the_first_request_wins():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        assert not stop.requested
        stop.request("SIGTERM")
        stop.request("SIGINT")
        assert stop.signal == "SIGTERM" and stop.at is not None
    assert signal.getsignal(signal.SIGTERM) == before


def test_outside_the_main_thread_no_handler_is_installed():
    """Python allows signal handlers in the main thread only: `train` in a notebook's or a
    test's thread trains as before, and `StopRequest.request` still stops it."""
    before, seen = signal.getsignal(signal.SIGTERM), []

    def enter():
        with StopRequest() as stop:
            seen.append(signal.getsignal(signal.SIGTERM))
            stop.request("SIGTERM")
            seen.append(stop.requested)

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert seen == [before, True]


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(TWO_PROCESS_LAYOUTS))
def test_over_processes_a_signal_to_the_launcher_stops_and_saves_every_process_at_one_step(
    tmp_path, layout
):
    """The launcher passes SIGTERM to both processes; they agree on one boundary (the
    Controller's verdict), both save that step and exit with `PREEMPTED_EXIT`, as the launcher
    does; rerun, the run ends with the losses of an uninterrupted one."""
    run = {**TWO_PROCESS_BASE, **TWO_PROCESS_LAYOUTS[layout], "train.steps": 40,
           "train.checkpoint_every": 100, "train.eval_every": 1000}
    reference, workdir = tmp_path / "reference", tmp_path / "run"
    two_processes(reference, run)
    command = [
        sys.executable, "-m", "dynjax.launch.local", "--processes", "2",
        "--devices-per-process", "4", "--", "--config", "tests/tiny.py",
        "--workdir", str(workdir), *(f"--config.{k}={v}" for k, v in run.items()),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 600
    while len(losses_so_far(workdir)) < 3 and launcher.poll() is None:
        assert time.time() < deadline
        time.sleep(0.1)
    launcher.send_signal(signal.SIGTERM)
    out, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == PREEMPTED_EXIT, out[-3000:]
    stops = [events_of(w, "preempted") for w in (workdir, workdir / "process_1")]
    [[first], [second]] = stops
    assert first["step"] == second["step"] < 40 and first["saved"] and second["saved"]
    assert "Traceback" not in out

    two_processes(workdir, run)
    assert losses(workdir) == losses(reference)  # every step, bit for bit


def losses_so_far(workdir: Path) -> dict[int, float]:
    """The losses process 0 logged so far (none before its file exists)."""
    return losses(workdir) if (workdir / "metrics.jsonl").exists() else {}
