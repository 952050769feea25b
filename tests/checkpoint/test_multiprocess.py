"""Checkpoints of a data-parallel run over 2 local processes x 4 CPU devices (issue 15 §4, issue
13 §5): every process writes its own share, a rerun resumes (also after one process was killed),
and one process of 8 devices restores the same state."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

from dynjax.checkpoint import Checkpointer, layout
from dynjax.dynamism.moe.checkpoint import EXPERT_STACKS, expert_layer
from dynjax.experiment import Experiment
from dynjax.launch import local
from dynjax.launch.cluster import HEARTBEAT_SECONDS
from dynjax.launch.watchdog import RESUME
from dynjax.train import train
from dynjax.writers import read_jsonl

from ..helpers import ROOT, losses, two_processes
from ..tiny import dotted_config

BASE = {
    "mesh.data": 8,
    "train.eval_every": 4,
    "train.checkpoint_every": 2,
    "pipeline.profile_on_change": False,
}


def config(**overrides):
    return dotted_config({**BASE, **overrides})


def written_bytes(item: Path, processes: int) -> tuple[list[int], int]:
    """Bytes of array data (uncompressed) each process wrote into an Orbax item, read from its
    own ``ocdbt.process_<i>`` store (chunk count x chunk bytes), and the bytes of the leaves
    written whole by one process (no axis divides over the replicas: the scalars)."""
    stores = [
        ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/ocdbt.process_{p}/"}).result()
        for p in range(processes)
    ]
    keys = [[k.decode() for k in kv.list().result()] for kv in stores]
    zarrays = {
        k.removesuffix("/.zarray"): json.loads(kv.read(k).result().value)
        for kv, ks in zip(stores, keys, strict=True)
        for k in ks
        if k.endswith("/.zarray")
    }
    shares, whole = [0] * processes, 0
    for p, ks in enumerate(keys):
        for k in ks:
            name, _, chunk = k.rpartition("/")
            if chunk.startswith("."):
                continue
            z = zarrays[name]
            size = np.dtype(z["dtype"]).itemsize
            nbytes = int(np.prod(z["chunks"])) * size
            shares[p] += nbytes
            if nbytes == int(np.prod(z["shape"])) * size:
                whole += nbytes
    return shares, whole


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """A 6-step run over the 2 processes, saved every 2 steps, and its losses: the reference."""
    workdir = tmp_path_factory.mktemp("multi")
    two_processes(workdir, {**BASE, "train.steps": 6})
    want = losses(workdir)
    assert sorted(want) == [1, 2, 3, 4, 5, 6]
    return workdir, want


def steps(workdir: Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_two_processes_save_resume_and_restore_on_one(tmp_path, uninterrupted):
    multi, want = uninterrupted
    one = tmp_path / "one"
    assert steps(multi) == [2, 4, 6]
    assert not (multi / "process_1" / "checkpoints").exists()  # one directory for every process

    # Replica-parallel writes: each process wrote half of the replicated dense leaves' bytes.
    shares, whole = written_bytes(multi / "checkpoints" / "4" / layout.DENSE, 2)
    print("bytes written per process", shares, "of them in leaves written whole", whole)
    assert abs(shares[0] - shares[1]) <= whole < 1e-3 * sum(shares)

    # One process of 8 devices restores step 4; the 2 processes find step 6's metadata
    # corrupted, agree to move the step aside (process 0 moves it) and rerun from step 4; both
    # redo steps 5 and 6 as the uninterrupted run did.
    shutil.copytree(multi / "checkpoints", one / "checkpoints", ignore=lambda d, names: ["6"])
    (multi / "checkpoints/6/meta/metadata").write_text("{not json")
    two_processes(multi, {**BASE, "train.steps": 6})
    train(config(**{"train.steps": 6}), one, progress=False)
    failed = [
        [
            e["moved_to"]
            for e in read_jsonl(w / "events.jsonl")
            if e["event"] == "checkpoint_restore_failed"
        ]
        for w in (multi, multi / "process_1")
    ]
    assert failed[0] == failed[1] and len(failed[0]) == 1 and Path(failed[0][0]).is_dir()
    assert steps(multi) == [2, 4, 6]  # saved again
    for workdir in (multi, one):
        [resume] = [e for e in read_jsonl(workdir / "events.jsonl") if e["event"] == "resume"]
        assert resume["step"] == 4
    assert losses(multi) == want  # bit for bit: the same programs from the same state
    assert losses(multi / "process_1") == want
    # Within float32 rounding: one process of 8 devices adds up in another order (as in
    # test_data_multiprocess without restores); a state off by a step would differ by ~1e-2.
    assert losses(one) == pytest.approx({s: want[s] for s in (5, 6)}, rel=1e-6, abs=0)

    # Bit for bit: the state one process restores has the checksums the 2 processes computed
    # on the global arrays they saved.
    checkpointer = Checkpointer(
        one / "checkpoints", stacks=EXPERT_STACKS, keep=10, async_save=False
    )
    exp = Experiment.from_config(config(**{"train.steps": 6}))
    state, meta = checkpointer.restore(4, exp.restore_target(exp.initial_plan()))
    checkpointer.close()
    assert layout.checksums(layout.flatten(state), EXPERT_STACKS) == meta["checksums"]
    assert {d.id for leaf in layout.flatten(state).values() for d in leaf.devices()} == set(
        range(8)
    )


@pytest.mark.slow
def test_a_killed_process_stops_the_other_and_the_rerun_resumes(tmp_path, uninterrupted):
    """Process 1 is killed (SIGKILL) once it has saved step 2. Process 0, started on its own
    (no launcher to stop it), stops with an error naming process 1 within 60 s; the rerun of
    both resumes from step 2 and trains steps 3-6 as the uninterrupted run did."""
    _, want = uninterrupted
    args = ["--config", "tests/tiny.py", "--workdir", str(tmp_path),
            *(f"--config.{k}={v}" for k, v in {**BASE, "train.steps": 6}.items())]
    port = local.free_port()
    logs = [open(tmp_path / f"log.{rank}", "w+") for rank in range(2)]
    commands = [["-m", "dynjax.train"], ["tests/scripts/kill_after_save.py", "2"]]
    survivor, victim = [
        subprocess.Popen(
            [sys.executable, *command, *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**local.process_env(rank, 2, 4, port), "PYTHONPATH": str(ROOT)},
        )
        for rank, (command, log) in enumerate(zip(commands, logs, strict=True))
    ]
    assert victim.wait(timeout=600) == -9
    died = time.monotonic()
    try:
        survivor.wait(timeout=60)
    except subprocess.TimeoutExpired:
        survivor.kill()
        pytest.fail("process 0 still runs 60 s after process 1 was killed")
    print(f"process 0 stopped {time.monotonic() - died:.1f} s after process 1 was killed")
    logs[0].seek(0)
    out = logs[0].read()
    assert survivor.returncode == 1, out[-3000:]
    message = "error: process 1 (of 2) stopped responding "
    assert f"{message}(no heartbeat for {HEARTBEAT_SECONDS:g} s); {RESUME}" in out, out[-3000:]

    two_processes(tmp_path, {**BASE, "train.steps": 6})  # the rerun: both processes
    [resume] = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "resume"]
    assert resume["step"] == 2
    assert steps(tmp_path) == [2, 4, 6]
    assert losses(tmp_path) == want  # bit for bit, as the resume above
    # Process 1's lines of steps 1-2 may have died unflushed with it; the rerun's are there.
    resumed = {s: loss for s, loss in losses(tmp_path / "process_1").items() if s > 2}
    assert resumed == {s: want[s] for s in (3, 4, 5, 6)}


@pytest.mark.slow
def test_partial_expert_checkpoints_of_two_processes_restore_on_one(tmp_path):
    """MoE on data 2 x expert 4 with partial expert saves (K=3 of 4 experts: the expert axis
    does not divide K): the first save holds every expert, the second experts 0 to 2; the two
    processes write equal shares of both experts items (seed 004 §4); one process assembles
    expert 3 from the first."""
    moe = {
        "mesh.data": 2,
        "mesh.expert": 4,
        "moe.every": 2,
        "checkpoint.experts_per_save": 3,
        "train.steps": 4,
    }
    two_processes(tmp_path, {**BASE, **moe})
    saved = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "checkpoint"]
    assert [(e["step"], e["experts_saved"]) for e in saved] == [
        (2, {"1": [0, 1, 2, 3]}),
        (4, {"1": [0, 1, 2]}),
    ]
    # Each process writes half of the expert rows' bytes: a full save's [4, ...] arrays (one
    # expert per expert shard, its 2 data replicas in the 2 processes) and the partial save's
    # [3, ...] rows (gathered replicated over all 8 devices, as 4 does not divide 3). Orbax
    # splits a replicated shard along its first axis the replica count divides.
    exp = Experiment.from_config(config(**moe))
    experts = layout.split(exp.abstract_state, EXPERT_STACKS)[layout.ROWS].values()
    all_rows = sum(a.size * a.dtype.itemsize for a in experts)
    for step, rows in ((2, 4), (4, 3)):
        shares, whole = written_bytes(tmp_path / "checkpoints" / str(step) / layout.ROWS, 2)
        print(f"step {step}: expert bytes written per process", shares)
        assert shares[0] == shares[1] and whole == 0
        assert sum(shares) == all_rows * rows // 4
    checkpointer = Checkpointer(
        tmp_path / "checkpoints", stacks=EXPERT_STACKS, keep=10, async_save=False
    )
    state, meta = checkpointer.restore_latest(lambda meta: exp.restore_target(exp.initial_plan()))
    _, older = checkpointer.restore(2, exp.restore_target(exp.initial_plan()))
    checkpointer.close()
    assert meta["step"] == 4
    assert meta["expert_sources"] == {1: {"weights": [4, 4, 4, 2], "optimizer": [4, 4, 4, 2]}}
    sums = layout.checksums(layout.flatten(state), EXPERT_STACKS)
    for key, got in sums.items():
        if expert_layer(key) is None:
            assert got == meta["checksums"][key]
        else:  # rows 0 to 2 as the 2 processes saved them at step 4, row 3 at step 2
            assert got == [*meta["checksums"][key], *older["checksums"][key][3:]]
