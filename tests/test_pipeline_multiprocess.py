"""Two local processes (jax.distributed, gloo on CPU) run the pipeline: same losses as one."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynjax.train import train
from dynjax.writers import read_jsonl

from .tiny import tiny_config

ROOT = Path(__file__).resolve().parents[1]
# Two stages of one device each, one per process: every activation and gradient crosses
# processes (transfers inside a process are those of the single-process tests).
OVERRIDES = {
    "model.num_layers": 3,
    "model.d_model": 16,
    "model.mlp_dim": 32,
    "moe.every": 2,
    "mesh.stage": 2,
    "train.steps": 4,
    "train.microbatches": 2,
    "train.eval_every": 4,
    "pipeline.profile_on_change": False,
}


def losses(workdir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(workdir / "metrics.jsonl") if "loss" in r}


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    config = tiny_config(**{k.replace(".", "__"): v for k, v in OVERRIDES.items()})
    single = tmp_path / "single"
    train(config, single, progress=False)

    multi = tmp_path / "multi"
    args = [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
    command = [
        sys.executable, "-m", "dynjax.launch.local", "--processes", "2",
        "--devices-per-process", "1", "--", "--config", "tests/tiny.py",
        "--workdir", str(multi), *args,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "[0] dynjax run summary" in done.stdout and "[1] dynjax run summary" in done.stdout
    want = losses(single)
    assert sorted(want) == [1, 2, 3, 4]
    assert losses(multi) == want  # bit for bit: the same programs, moved the same way
    assert losses(multi / "process_1") == want  # every process logs the same metrics
    evals = lambda w: [r["eval_loss"] for r in read_jsonl(w / "metrics.jsonl") if "eval_loss" in r]
    assert evals(multi) == evals(single) and len(evals(single)) == 1
