"""Two-level checkpoints (seed 004 §5.1-§5.2): snapshots equal the device state bit for bit and
survive the next step's donation, triple buffering never hands out a buffer being written, and
in-memory recovery resumes exactly where a full checkpoint would, with a PLT no higher than a
restart from storage."""

import shutil
import threading
import time

import jax
import numpy as np
import pytest

from dynjax.checkpoint import layout
from dynjax.checkpoint.snapshot import PERSIST, RECOVERY, SNAPSHOT, Snapshot, TripleBuffer, TwoLevel
from dynjax.config import validate_config
from dynjax.dynamism.moe.checkpoint import EXPERT_STACKS, expert_layer
from dynjax.errors import ConfigError
from dynjax.train import train
from dynjax.writers import read_jsonl

from ..helpers import (
    TWO_PROCESS_BASE,
    TWO_PROCESS_LAYOUTS,
    check_recoveries,
    events_of,
    losses,
    one_and_two,
    train_cli,
    two_processes,
)
from ..tiny import tiny_config

MOE = {"moe__every": 1, "train__eval_every": 1000}  # two MoE layers (0, 1) of 4 experts


def _host(state) -> dict[str, np.ndarray]:
    return {k: np.array(a) for k, a in layout.flatten(state).items()}


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_a_snapshot_is_the_state_of_its_step_after_the_next_step_donates_it():
    """Snapshot after step 2 (full) and step 3 (expert 1 of each layer only), each followed by
    a step that donates the snapshotted arrays: each buffer equals the state of its step bit
    for bit, the experts not copied at step 3 coming from step 2's snapshot."""
    from dynjax.experiment import Experiment

    exp = Experiment.from_config(tiny_config(**MOE))
    plan = exp.initial_plan()
    runtime = exp.runtime(plan)
    executable = exp.lower_train_step(plan).compile()
    two = TwoLevel(EXPERT_STACKS, [0, 1], 4, persist_k=0, emit=lambda e: None)
    states = {}
    for step in range(5):
        state = runtime.checkpoint_state()
        donated = jax.tree.leaves(state)
        if step in (2, 3):
            states[step] = _host(state)  # what the device holds at the snapshot
            two.snapshot(step, state, None if step == 2 else {0: [1], 1: [1]})
        runtime.step(executable, exp.order.batch(step), None)
        assert all(a.is_deleted() for a in donated)  # the step did donate what was snapshotted
    keys = set(states[3])
    assert two.recovery(keys - {next(iter(keys))}) is None  # not the leaves this process holds
    snap = two.recovery(keys)
    two.close()
    assert snap.step == 3 and snap.sources == {0: [2, 3, 2, 2], 1: [2, 3, 2, 2]}
    assert set(snap.arrays) == set(states[3])
    for key, got in snap.arrays.items():
        if expert_layer(key) is None:
            assert _same_bits(got, states[3][key]), key
            continue
        assert _same_bits(got[1], states[3][key][1]), key
        for e in (0, 2, 3):
            assert _same_bits(got[e], states[2][key][e]), key
        assert not _same_bits(got[0], states[3][key][0]), key  # it did train since step 2


def test_triple_buffer_never_hands_out_a_buffer_being_written():
    """A slow writer thread fills buffers word by word while the reader takes the recovery
    buffer and persists it slowly: every buffer handed out is whole (every word its step's)
    and does not change while held; the roles rotate over all three buffers."""
    tb = TripleBuffer()
    words, fills = 64, 40
    stop = threading.Event()

    def writer() -> None:
        for step in range(1, fills + 1):
            buf = tb.begin_fill()
            out = buf.arrays.setdefault("w", np.zeros(words, np.int64))
            for i in range(words):
                out[i] = step
                if i % 16 == 0:
                    time.sleep(0.0005)
            buf.step = step
            tb.complete(buf)
        stop.set()

    thread = threading.Thread(target=writer)
    thread.start()
    seen, persisted, used = set(), 0, set()
    while not stop.is_set():
        roles = [set(r) for r in tb.roles]
        assert not any(SNAPSHOT in r and r & {PERSIST, RECOVERY} for r in roles)
        snap = tb.recovery()
        if snap is not None:
            used.add(id(snap))
            assert (snap.arrays["w"] == snap.step).all()
            seen.add(snap.step)
        held = tb.begin_persist()
        if held is not None:
            before = held.arrays["w"].copy()
            assert (before == held.step).all()
            time.sleep(0.003)  # a slow write: fills go on meanwhile
            assert (held.arrays["w"] == before).all()  # never refilled while persisting
            tb.end_persist(held)
            persisted += 1
    thread.join()
    assert tb.recovery().step == fills and (tb.recovery().arrays["w"] == fills).all()
    assert len(seen) > 3 and persisted > 3 and len(used) == 3
    with pytest.raises(RuntimeError, match="being filled"):
        tb.begin_fill()
        tb.begin_fill()


def test_a_full_buffer_set_still_has_one_to_fill():
    tb = TripleBuffer()
    a = tb.begin_fill()
    tb.complete(a)
    assert tb.begin_persist() is a  # persisting and still the newest
    b = tb.begin_fill()
    tb.complete(b)
    c = tb.begin_fill()  # a persists, b is the recovery buffer
    assert c is not a and c is not b
    tb.complete(c)
    assert tb.recovery() is c and RECOVERY not in tb.roles[tb.buffers.index(b)]
    tb.end_persist(a)
    assert isinstance(tb.begin_fill(), Snapshot)


@pytest.mark.slow
def test_memory_recovery_continues_like_a_restore_of_a_full_checkpoint(tmp_path):
    """A fault before step 7 restores step 6's full snapshot from host memory; the run goes on
    with the losses of a run restored from a full checkpoint of step 6."""
    two = {
        "checkpoint__snapshot_every": 1,
        "checkpoint__persist_every": 4,
        "checkpoint__inject_fault_at": 7,
        "train__steps": 10,
        **MOE,
    }
    train(tiny_config(**two), tmp_path / "memory", progress=False)
    (rec,) = events_of(tmp_path / "memory", "checkpoint_recovery")
    assert rec["source"] == "memory" and rec["step"] == 6 and rec["fault_step"] == 7
    assert rec["lost_tokens"] == 0  # full snapshots: every expert copied at step 6
    full = tiny_config(train__checkpoint_every=6, train__steps=10, **MOE)
    train(full, tmp_path / "disk", progress=False)
    first = losses(tmp_path / "disk")
    shutil.rmtree(tmp_path / "disk" / "checkpoints" / "10")  # resume from the full step 6
    train(full, tmp_path / "disk", progress=False)
    memory, disk = losses(tmp_path / "memory"), losses(tmp_path / "disk")  # the last logged
    assert [memory[s] for s in range(1, 11)] == [disk[s] for s in range(1, 11)]
    assert [first[s] for s in range(1, 11)] == [disk[s] for s in range(1, 11)]


@pytest.mark.slow
def test_memory_recovery_loses_no_more_tokens_than_a_restart_from_storage(tmp_path):
    """Same partial two-level run (K_snapshot = K_persist = 1), same fault before step 15: the
    surviving process recovers from memory (step 14), a killed one restarts from storage (the
    persist of step 11, whose other experts are from steps 3 and 7); each writes a
    ``checkpoint_recovery`` event and the in-memory one has the lower PLT (seed 004 §5.1)."""
    run = {
        "checkpoint__snapshot_every": 1,
        "checkpoint__snapshot_experts": 1,
        "checkpoint__persist_every": 4,
        "train__steps": 16,
        **MOE,
    }
    train(tiny_config(**run, checkpoint__inject_fault_at=15), tmp_path / "memory", progress=False)
    assert train_cli("tests/scripts/kill_at.py", tmp_path / "storage", run, 15, "step") == -9
    train(tiny_config(**run), tmp_path / "storage", progress=False)
    (memory,), (storage,) = (
        events_of(tmp_path / where, "checkpoint_recovery") for where in ("memory", "storage")
    )
    assert memory["source"] == "memory" and storage["source"] == "storage"
    assert memory["step"] == 14 and storage["step"] <= 12
    assert 0 < memory["plt"] <= storage["plt"]
    check_recoveries(tmp_path / "storage")  # the ledger's PLT is the one the logs give
    # Memory's, from the routing counts logged before the fault: expert e of layer l copied at
    # step src lost the tokens routed to it in steps src+1..14 (eq. 7).
    logged = {
        r["step"]: np.array(r["tokens_per_expert"], np.int64)
        for r in read_jsonl(tmp_path / "memory" / "metrics.jsonl")
        if r["time"] < memory["time"]
    }
    lost = {
        layer: [int(sum(logged[t][layer][e] for t in range(src + 1, 15))) for e, src in
                enumerate(memory["layers"][str(layer)]["sources"])]
        for layer in (0, 1)
    }
    assert {int(k): v["lost_tokens"] for k, v in memory["layers"].items()} == lost
    total = sum(int(logged[t].sum()) for t in range(1, 15))
    assert memory["plt"] == pytest.approx(sum(map(sum, lost.values())) / total, rel=1e-12)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"checkpoint__snapshot_every": 2, "checkpoint__persist_every": 3}, "persist_every=3"),
        ({"checkpoint__snapshot_every": 2}, "persist_every=0"),
        ({"checkpoint__persist_every": 4}, "needs checkpoint.snapshot_every"),
        (
            {"checkpoint__snapshot_every": 1, "checkpoint__persist_every": 2,
             "checkpoint__snapshot_experts": 1, "checkpoint__persist_experts": 2, **MOE},
            "persist_experts=2 exceeds checkpoint.snapshot_experts",
        ),
        (
            {"checkpoint__snapshot_every": 1, "checkpoint__persist_every": 2,
             "checkpoint__snapshot_experts": 1},
            "need MoE layers",
        ),
        (
            {"checkpoint__snapshot_every": 1, "checkpoint__persist_every": 2,
             "checkpoint__experts_per_save": 1, **MOE},
            "checkpoint.experts_per_save=1",
        ),
        (
            {"checkpoint__snapshot_every": 1, "checkpoint__persist_every": 2,
             "checkpoint__pec_content": "W", **MOE},
            "checkpoint.pec_content",
        ),
        ({"checkpoint__inject_fault_at": -1}, "checkpoint.inject_fault_at"),
    ],
)
def test_two_level_config_errors_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate_config(tiny_config(**overrides), 1)


@pytest.mark.slow
def test_a_dense_model_snapshots_and_recovers_its_state(tmp_path):
    run = {
        "checkpoint__snapshot_every": 2,
        "checkpoint__persist_every": 4,
        "checkpoint__inject_fault_at": 6,
        "train__steps": 7,
        "train__eval_every": 1000,
    }
    summary = train(tiny_config(**run), tmp_path, progress=False)
    (rec,) = events_of(tmp_path, "checkpoint_recovery")
    assert rec["source"] == "memory" and rec["step"] == 4 and rec["plt"] == 0.0
    assert summary.final_step == 7 and np.isfinite(summary.final_loss)


def test_a_process_s_shards_round_trip_and_take_new_rows():
    """`HostShards`, what a process of a program over several snapshots of a global array: its
    distinct shards by bounds (replicas once), placed back bit for bit, and expert rows set
    in whichever shard holds them (here an expert axis of 2 devices x a data axis of 2)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from dynjax.checkpoint.snapshot import HostShards

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("expert", "data"))
    rng = np.random.default_rng(0)
    whole = rng.standard_normal((4, 6, 8)).astype(np.float32)
    for spec, pieces in ((P("expert", None, "data"), 4), (P("expert"), 2), (P(), 1)):
        sharding = NamedSharding(mesh, spec)
        shards = HostShards.of(jax.device_put(whole, sharding))
        assert len(shards.pieces) == pieces
        back = shards.placed(sharding)
        assert back.sharding == sharding and _same_bits(np.asarray(back), whole)
        rows = rng.standard_normal((2, 6, 8)).astype(np.float32)
        want = whole.copy()
        want[[1, 2]] = rows
        got = np.asarray(shards.with_rows([1, 2], rows).placed(sharding))
        assert _same_bits(got, want), spec
        assert _same_bits(np.asarray(shards.placed(sharding)), whole)  # a copy: unchanged


@pytest.mark.slow
@pytest.mark.parametrize("layout_name", ["one-program", "stage-per-process"])
def test_two_processes_recover_from_memory_as_one_process(tmp_path, layout_name):
    """Two-level checkpoints (seed 004 §5) over 2 processes x 4 devices, partial snapshots
    (K_snapshot = K_persist = 1) every 2 steps: each process snapshots what it holds (in one
    program its shards of the global arrays, in a pipeline its stage), both persist the same
    steps, and after the injected fault both recover the same step from memory with the same
    PLT and the losses of one process of 8 devices; a rerun resumes from the persisted
    steps."""
    run = {
        **TWO_PROCESS_BASE,
        **TWO_PROCESS_LAYOUTS[layout_name],
        "moe.every": 1,
        "train.steps": 14,
        "train.eval_every": 6,
        "pipeline.profile_on_change": True,
        "checkpoint.snapshot_every": 2,
        "checkpoint.snapshot_experts": 1,
        "checkpoint.persist_every": 4,
        "checkpoint.inject_fault_at": 12,
    }
    single, multi = one_and_two(tmp_path, run)
    workdirs = (single, multi, multi / "process_1")
    recoveries = [
        [{k: v for k, v in e.items() if k != "time"} for e in events_of(w, "checkpoint_recovery")]
        for w in workdirs
    ]
    [alone] = recoveries[0]
    # Step 11 runs again, and with it the exchanges of its metrics (and of an evaluation and
    # a profile before the fault): the processes number them by exchange, not by step.
    assert alone["source"] == "memory" and alone["step"] == 10 and alone["fault_step"] == 12
    assert alone["lost_tokens"] > 0  # a partial snapshot: experts copied before step 10
    assert recoveries[1] == [alone] and recoveries[2] == [alone]
    assert losses(multi) == pytest.approx(losses(single), rel=1e-6, abs=0)
    assert losses(multi / "process_1") == losses(multi)
    persisted = [[e["step"] for e in read_jsonl(w / "events.jsonl") if e["event"] == "checkpoint"]
                 for w in workdirs[1:]]
    assert persisted[0] and persisted[0] == persisted[1]

    rerun = {**run, "train.steps": 16, "checkpoint.inject_fault_at": 0}
    two_processes(multi, rerun)
    resumed = [[e["step"] for e in read_jsonl(w / "events.jsonl") if e["event"] == "resume"]
               for w in workdirs[1:]]
    assert resumed[0] == resumed[1] == [max(persisted[0])]
