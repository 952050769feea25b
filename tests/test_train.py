"""End to end: a run writes its files, its loss falls, and a killed run resumes identically."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from dynjax import train as train_module
from dynjax.checkpoint import Checkpointer
from dynjax.checkpoint.rows import NO_ROWS
from dynjax.experiment import Experiment
from dynjax.train import NonFiniteError, format_summary, main, train
from dynjax.writers import read_jsonl

from .helpers import ROOT, losses
from .tiny import tiny_config


def test_quick_run_learns_and_writes_its_workdir(tmp_path):
    cfg = tiny_config(
        train__steps=40, train__log_every=5, train__eval_every=20, train__checkpoint_every=20
    )
    summary = train(cfg, tmp_path, progress=False)
    curve = losses(tmp_path)
    assert sorted(curve) == [5, 10, 15, 20, 25, 30, 35, 40]
    assert curve[40] < 0.7 * curve[5], curve  # bytes: ~5.5 nats at init, well below after 40 steps
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert all("tokens_per_sec" in r for r in records if "loss" in r and r["step"] > 5)
    assert [r["step"] for r in records if "eval_loss" in r] == [20, 40]
    events = [e["event"] for e in read_jsonl(tmp_path / "events.jsonl")]
    assert events == ["compile", "checkpoint", "checkpoint"]
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == 40
    assert any(
        p.name.startswith("events.out.tfevents") for p in (tmp_path / "tensorboard").iterdir()
    )
    assert summary.checkpoints == [20, 40] and summary.final_step == 40
    assert "final train loss" in format_summary(summary)
    # Running it again finds the finished run and does no work.
    again = train(cfg, tmp_path, progress=False)
    assert again.start_step == again.final_step == 40


def run_cli(workdir: Path, *extra: str) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "dynjax.train",
        "--config",
        "tests/tiny.py",
        "--workdir",
        str(workdir),
        "--config.moe.every=2",
        "--config.train.steps=120",
        "--config.train.checkpoint_every=10",
        "--config.checkpoint.async_save=True",
        "--config.train.eval_every=1000",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


@pytest.mark.slow
def test_killed_run_resumes_with_identical_losses(tmp_path):
    reference = tmp_path / "reference"
    out, _ = run_cli(reference).communicate(timeout=600)
    assert b"dynjax run summary" in out, out.decode()[-2000:]

    interrupted = tmp_path / "interrupted"
    proc = run_cli(interrupted)
    deadline = time.time() + 300
    while not (interrupted / "checkpoints" / "20").is_dir():  # a committed checkpoint
        assert proc.poll() is None and time.time() < deadline, "run ended before the kill"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(losses(interrupted))
    assert killed_at < 120, "the process finished before it was killed"

    out, _ = run_cli(interrupted).communicate(timeout=600)
    assert b"dynjax run summary" in out, out.decode()[-2000:]
    restores = [
        e for e in read_jsonl(interrupted / "events.jsonl") if e["event"] == "checkpoint_restore"
    ]
    assert restores and restores[0]["step"] >= 20
    assert losses(interrupted) == losses(reference)  # every step, bit for bit


def test_logs_model_flops_and_mfu_against_the_set_peak(tmp_path):
    from dynjax.flops import config_flops_per_token

    cfg = tiny_config(train__steps=6, train__peak_flops=1e12)
    summary = train(cfg, tmp_path, progress=False)
    per_token = config_flops_per_token(cfg)
    timed = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "tokens_per_sec" in r]
    assert timed
    for r in timed:  # one device: all of the step's tokens
        assert r["tflops_per_device"] == pytest.approx(r["tokens_per_sec"] * per_token / 1e12)
        assert r["mfu"] == pytest.approx(r["tokens_per_sec"] * per_token / 1e12)
    assert summary.flops_per_token == per_token and summary.mfu is not None
    assert "MFU (median)" in format_summary(summary)


DIVERGING = {"train__steps": 12, "train__learning_rate": 1e5, "train__grad_clip": 0.0,
             "train__warmup_steps": 0, "train__checkpoint_every": 2, "train__eval_every": 1000}


def test_a_diverging_model_stops_at_its_step_with_no_later_state_saved(tmp_path):
    """A non-finite loss or gradient norm stops the run, naming the step and the checkpoint
    from before it (issue 32 §5): the saves after it, due every 2 steps, never happen."""
    with pytest.raises(NonFiniteError, match=r"step (\d+): loss nan") as err:
        train(tiny_config(**DIVERGING), tmp_path, progress=False)
    bad = int(re.search(r"step (\d+)", str(err.value)).group(1))
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and max(saved) < bad
    assert f"step {max(saved)} in {tmp_path / 'checkpoints'}" in str(err.value)
    assert np.isfinite([v for s, v in losses(tmp_path).items() if s <= max(saved)]).all()


def test_the_cli_reports_a_divergence_as_an_error_with_exit_2(tmp_path, capsys):
    args = [f"--config.{k.replace('__', '.')}={v}" for k, v in DIVERGING.items()]
    code = main(["--config=tests/tiny.py", f"--workdir={tmp_path}", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: step ") and "diverged" in err
    assert "Traceback" not in err


def test_a_step_too_big_for_the_device_is_an_error_before_training(tmp_path, capsys):
    """Issue 32 §4: XLA's memory analysis of the compiled step against the device's memory
    (here ``balance.memory_bytes``, as on a backend that reports none), both numbers and the
    keys that shrink it, exit 2, no step trained."""
    for stage in (1, 2):
        workdir = tmp_path / str(stage)
        code = main(["--config=tests/tiny.py", f"--workdir={workdir}",
                     "--config.balance.memory_bytes=100000", f"--config.mesh.stage={stage}"])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: ") and "but a device has 0.10 MiB" in err
        assert ("pipeline stage 0" if stage == 2 else "the train step") in err
        assert "train.microbatches" in err and "Traceback" not in err
        assert not (workdir / "metrics.jsonl").exists() or not losses(workdir)
    assert main(["--config=tests/tiny.py", f"--workdir={tmp_path / 'fits'}",
                 "--config.balance.memory_bytes=1e9", "--config.train.steps=2"]) == 0


def test_a_full_disk_ends_the_run_with_an_error_naming_the_last_good_checkpoint(tmp_path):
    """Issue 32 §2: once no save can succeed, one ``error:`` line (what is full, what a
    checkpoint needs, the last good step), exit 2, that checkpoint intact; a rerun resumes."""
    run = ["--config=tests/tiny.py", f"--workdir={tmp_path}", "--config.train.steps=8",
           "--config.train.checkpoint_every=2", "--config.train.eval_every=1000"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "tests/scripts/disk_full_from.py", "6", *run],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    [line] = [x for x in done.stderr.splitlines() if x.startswith("error: ")]
    assert f"the filesystem of {tmp_path / 'checkpoints'} is full" in line
    assert "the newest good checkpoint is step 4" in line
    events = [(e["event"], e["step"]) for e in read_jsonl(tmp_path / "events.jsonl")
              if e["event"].startswith("checkpoint")]
    assert events == [("checkpoint", 2), ("checkpoint", 4), ("checkpoint_failed", 6)]
    summary = train(tiny_config(train__steps=8, train__checkpoint_every=2,
                                train__eval_every=1000), tmp_path, progress=False)
    assert summary.start_step == 4 and summary.checkpoints[-1] == 8


def test_out_of_memory_at_run_time_is_an_error_naming_what_shrinks_the_step(monkeypatch, capsys):
    """Where the backend could not tell the step's memory beforehand, its out-of-memory error
    says the same as the check before training (issue 32 §4)."""

    def oom(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.1GiB.")

    monkeypatch.setattr(train_module, "train", oom)
    assert main(["--config=tests/tiny.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: out of device memory (RESOURCE_EXHAUSTED: Out of memory")
    assert "train.microbatches" in err and "Traceback" not in err


def test_skipping_non_finite_updates_saves_only_finite_states_and_stops_after_too_many(tmp_path):
    """``train.nonfinite="skip"`` (issue 32 §5): a diverged step's update is skipped (logged
    ``skipped``), saves go on with the state from before it, all finite, and more than
    ``train.max_skipped`` in a row stop the run."""
    run = {**DIVERGING, "train__nonfinite": "skip", "train__max_skipped": 3}
    with pytest.raises(NonFiniteError, match=r"4 updates skipped in a row"):
        train(tiny_config(**run), tmp_path, progress=False)
    records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    skipped = [r["step"] for r in records if r.get("skipped") == 1.0]
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert len(skipped) == 3 and max(saved) >= skipped[0]  # saves went on while skipping
    exp = Experiment.from_config(tiny_config(**run))
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=10, stacks=NO_ROWS)
    state, meta = ckpt.restore_latest(lambda meta: exp.abstract_state)
    ckpt.close()
    assert meta["step"] == max(saved)
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(state))
