"""Two local processes of 4 CPU devices each, every one reading only the batch rows its devices
consume (issue 15 §5): the same losses as one process of 8 devices."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynjax.train import train
from dynjax.writers import read_jsonl

from .tiny import dotted_config

ROOT = Path(__file__).resolve().parents[1]
BASE = {"train.steps": 4, "train.eval_every": 4, "pipeline.profile_on_change": False}


def losses(workdir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(workdir / "metrics.jsonl") if "loss" in r}


def two_processes(workdir: Path, overrides: dict, devices: int = 4) -> str:
    """Train ``overrides`` over 2 local processes of ``devices`` CPU devices each; their output."""
    args = [f"--config.{k}={v}" for k, v in overrides.items()]
    command = [
        sys.executable, "-m", "dynjax.launch.local", "--processes", "2",
        "--devices-per-process", str(devices), "--", "--config", "tests/tiny.py",
        "--workdir", str(workdir), *args,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh, reads",
    [
        # one program over both processes: each reads the half of every batch its devices hold
        ({"mesh.data": 8}, (4, 4)),
        # one stage per process: the first stage's process reads the inputs, the last's the
        # targets (whole microbatches each)
        ({"mesh.stage": 2, "mesh.data": 4, "train.microbatches": 2}, (8, 8)),
    ],
)
def test_two_processes_reading_their_rows_match_one(tmp_path, mesh, reads):
    overrides = {**BASE, **mesh}
    single = tmp_path / "single"
    train(dotted_config(overrides), single, progress=False)
    out = two_processes(tmp_path / "multi", overrides)
    for process, rows in enumerate(reads):
        assert f"[{process}]   batches (host)     {rows} rows of each read here" in out
    want = losses(single)
    assert sorted(want) == [1, 2, 3, 4]
    # Within float32 rounding: a stage of 4 devices adds up across processes in another order
    # (main's pipeline gives the same last-bit difference); other data would differ by ~1e-2.
    assert losses(tmp_path / "multi") == pytest.approx(want, rel=1e-6, abs=0)
    assert losses(tmp_path / "multi" / "process_1") == losses(tmp_path / "multi")
