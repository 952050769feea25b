"""Fault injection (issue 32): one run stopped again and again, by SIGKILL, SIGTERM, a corrupted
newest checkpoint and a full disk for one save, each time rerun with the same command, ends with
the per-step losses and the final evaluation of an uninterrupted run. Prints the table of faults
injected, recovered and steps trained again per kind."""

import collections
import os
import subprocess
import sys

import numpy as np
import pytest

from dynjax.train import train
from dynjax.writers import read_jsonl

from .helpers import ROOT, corrupt, events_of, losses
from .tiny import tiny_config

RUN = {"train__steps": 36, "train__checkpoint_every": 3, "train__eval_every": 1000}
KINDS = ("kill", "term", "corrupt", "enospc")
EXITS = {"kill": -9, "term": 75, "corrupt": -9, "enospc": -9}


def faulty(workdir, kind, step):
    """One run of the CLI on `RUN` with the fault ``kind`` at ``step``; its exit status."""
    script_kind = "kill_after_save" if kind == "corrupt" else kind
    cmd = [sys.executable, "tests/scripts/faulty.py", script_kind, str(step),
           "--config=tests/tiny.py", f"--workdir={workdir}",
           *(f"--config.{k.replace('__', '.')}={v}" for k, v in RUN.items())]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert "Traceback" not in done.stderr, (kind, step, done.stderr[-6000:])
    return done.returncode


@pytest.mark.slow
def test_a_run_stopped_by_every_kind_of_fault_trains_as_an_uninterrupted_one(tmp_path):
    """Each faulty run is the rerun of the one before (the same command, so the same schedule):
    it resumes from where the fault left the run, then meets its own fault further on."""
    reference = tmp_path / "reference"
    train(tiny_config(**RUN), reference, progress=False)
    run, rng = tmp_path / "run", np.random.default_rng(0)
    table = collections.defaultdict(lambda: {"injected": 0, "recovered": 0, "redone": []})
    faults = []  # (kind, its step, the steps the run had dispatched when it stopped)

    def recovered() -> None:
        """The newest run resumed from a checkpoint of the newest fault: account for it."""
        kind, step, reached = faults[-1]
        resumed = events_of(run, "resume")[-1]["step"]
        expected = {"term": step, "corrupt": step - 3, "enospc": step - 3}.get(kind)
        assert expected in (None, resumed), (kind, step, resumed)
        table[kind]["recovered"] += 1
        table[kind]["redone"].append(reached - resumed)

    for kind in KINDS * 2:
        at = faults[-1][2] if faults else 0
        step = int(rng.integers(at + 2, at + 6))
        if kind in ("corrupt", "enospc"):  # a step that is saved
            step = -(-step // 3) * 3
        if step >= RUN["train__steps"] - 1:
            break
        assert faulty(run, kind, step) == EXITS[kind]
        if faults:
            recovered()
        table[kind]["injected"] += 1
        if kind == "corrupt":
            corrupt(run / "checkpoints" / str(step))
        if kind == "enospc":
            assert step in [e["step"] for e in events_of(run, "checkpoint_failed")]
        faults.append((kind, step, step + (kind == "enospc")))
    final = train(tiny_config(**RUN), run, progress=False)
    recovered()
    assert final.final_step == RUN["train__steps"]
    assert losses(run) == losses(reference)  # every step, bit for bit
    evals = lambda w: [r["eval_loss"] for r in read_jsonl(w / "metrics.jsonl") if "eval_loss" in r]
    assert evals(run)[-1] == evals(reference)[-1]
    print("\n| fault | injected | recovered | steps dispatched past the checkpoint resumed "
          "from (each) |\n|---|---|---|---|")
    for kind in KINDS:
        row = table[kind]
        print(f"| {kind} | {row['injected']} | {row['recovered']} | {row['redone']} |")
