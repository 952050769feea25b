"""Checkpoints: exact round trips (FSDP, pipeline), a fixed item count, resharding, quarantine of
a corrupt latest, refused saves, subset-of-experts reads, layout-1 checkpoints, and Orbax
handlers scoped to dynjax."""

import asyncio
import errno
import gc
import logging
import shutil
import subprocess
import sys
import tarfile

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

from dynjax.checkpoint import Checkpointer, CheckpointError, CheckpointMismatch, layout
from dynjax.checkpoint import manager as manager_module
from dynjax.checkpoint.errors import NoSpaceError
from dynjax.checkpoint.read import qkv_columns_per_head
from dynjax.dynamism.moe.checkpoint import EXPERT_STACKS
from dynjax.experiment import Experiment
from dynjax.model.attention import qkv_per_head

from ..helpers import (
    DATA,
    QKV_BEFORE_PER_HEAD,
    assert_bitwise_equal,
    assert_placed_like,
    corrupt,
    one_step,
    overwrite_expert,
)
from ..tiny import tiny_config

OLD_LAYOUT = DATA / "old_layout_checkpoint.tar.gz"
@pytest.fixture(scope="module")
def trained():
    """A MoE experiment (expert-parallel over 2 devices, FSDP over 2) and its state after a step."""
    exp = Experiment.from_config(tiny_config(moe__every=1, mesh__data=2, mesh__expert=2))
    return exp, one_step(exp)


def fixed(exp):
    """The restore target of ``exp``'s single-program state, whatever the checkpoint says."""
    return lambda meta: exp.abstract_state


@pytest.mark.slow
def test_round_trip_is_exact_and_sharded_as_the_target(trained, tmp_path):
    exp, state = trained
    events = []
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=2, emit=events.append)
    ckpt.save(5, state, {"plan": exp.initial_plan().to_dict()})
    ckpt.wait()
    assert sorted(p.name for p in (tmp_path / "5").iterdir() if p.is_dir()) == [
        "dense",
        "experts",
        "meta",
    ]
    restored, meta = ckpt.restore_latest(fixed(exp))
    assert meta["step"] == 5 and meta["plan"] == exp.initial_plan().to_dict()
    assert meta["layout"] == 2
    assert_bitwise_equal(state, restored)
    assert_placed_like(restored, exp.abstract_state)
    w_in = restored["params"]["layers"][0]["moe"]["w_in"]
    assert w_in.addressable_shards[0].data.shape[0] == 2  # 4 experts over 2 expert shards
    assert [e["event"] for e in events] == ["checkpoint", "checkpoint_restore"]
    assert events[0]["items"] == 3
    ckpt.close()


@pytest.mark.parametrize("layers, experts", [(2, 2), (6, 8)])
def test_the_item_count_does_not_grow_with_layers_and_experts(tmp_path, layers, experts):
    cfg = tiny_config(moe__every=1, model__num_layers=layers, moe__num_experts=experts)
    exp = Experiment.from_config(cfg)
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=1, async_save=False)
    ckpt.save(1, exp.init_state(), {})
    ckpt.close()
    items = sorted(p.name for p in (tmp_path / "1").iterdir() if p.is_dir())
    assert items == ["dense", "experts", "meta"]
    # One array per expert leaf and MoE layer, each with all experts: [E, ...].
    stored = ocp.StandardCheckpointer().metadata(tmp_path / "1" / "experts").item_metadata
    shapes = [a.shape for a in jax.tree.leaves(stored)]
    assert len(shapes) == 3 * 2 * layers  # (params, mu, nu) x (w_in, w_out) x layers
    assert all(shape[0] == experts for shape in shapes)


@pytest.mark.slow
def test_fsdp_state_round_trips_on_eight_devices(tmp_path):
    exp = Experiment.from_config(
        tiny_config(moe__every=1, mesh__data=4, mesh__expert=2, parallel__fsdp=True)
    )
    state = one_step(exp)
    embed = state["params"]["embed"]["embedding"]
    assert len(embed.sharding.device_set) == 8 and embed.addressable_shards[0].data.shape[0] < 256
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=1)
    ckpt.save(1, state, {})
    restored, _ = ckpt.restore_latest(fixed(exp))
    ckpt.close()
    assert_bitwise_equal(state, restored)
    assert_placed_like(restored, exp.abstract_state)


@pytest.mark.slow
def test_a_pipeline_state_restores_onto_its_stages(tmp_path):
    cfg = tiny_config(moe__every=1, mesh__stage=2, mesh__data=2, mesh__expert=2)
    exp = Experiment.from_config(cfg)
    plan = exp.initial_plan()
    runtime = exp.runtime(plan)
    exe = exp.lower_train_step(plan).compile()
    runtime.step(exe, exp.order.batch(0), None)
    saved = runtime.pipeline.host_state()
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=1)
    ckpt.save(1, runtime.checkpoint_state(), {"plan": plan.to_dict()})
    target = exp.restore_target(plan)
    restored, _ = ckpt.restore_latest(lambda meta: target)
    ckpt.close()
    assert_placed_like(restored, target)
    stage_1 = set(exp.pipeline_programs.transport.stage_meshes[1].devices.flat)
    assert restored["params"]["head"]["kernel"].sharding.device_set == stage_1
    assert_bitwise_equal(saved, restored)
    again = exp.runtime(plan, restored)
    assert_bitwise_equal(saved, again.pipeline.host_state())
    # The same checkpoint resumes without a pipeline (another stage count).
    single = Experiment.from_config(tiny_config(moe__every=1, mesh__data=2, mesh__expert=2))
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=1)
    restored, _ = ckpt.restore_latest(fixed(single))
    ckpt.close()
    assert_bitwise_equal(saved, restored)


def test_restore_reshards_onto_a_different_mesh(trained, tmp_path):
    exp, state = trained  # data 2 x expert 2
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=1)
    ckpt.save(1, state, {})
    ckpt.wait()
    other = Experiment.from_config(tiny_config(moe__every=1, mesh__data=4, mesh__expert=1))
    restored, _ = ckpt.restore_latest(fixed(other))
    ckpt.close()
    assert_placed_like(restored, other.abstract_state)
    w_in = restored["params"]["layers"][0]["moe"]["w_in"]
    assert len(w_in.sharding.device_set) == 4
    assert w_in.addressable_shards[0].data.shape[0] == 4  # all experts on each device
    assert_bitwise_equal(state, restored)


def test_corrupt_latest_is_set_aside_and_its_step_saved_again(trained, tmp_path):
    exp, state = trained
    events = []
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=2, emit=events.append)
    ckpt.save(1, state, {})
    later = jax.tree.map(lambda a: a + 1 if a.dtype.kind == "f" else a, state)
    ckpt.save(2, later, {})
    ckpt.wait()
    corrupt(tmp_path / "2")
    restored, meta = ckpt.restore_latest(fixed(exp))
    assert meta["step"] == 1
    assert_bitwise_equal(state, restored)
    failed = [e for e in events if e["event"] == "checkpoint_restore_failed"]
    assert [e["step"] for e in failed] == [2]
    moved = sorted((tmp_path / "corrupt").iterdir())
    assert [p.name.split("-")[0] for p in moved] == ["2"] and failed[0]["moved_to"] == str(moved[0])
    assert (moved[0] / "dense").is_dir()  # kept whole for a person to inspect
    assert ckpt.all_steps() == [1]  # no longer counted by `keep`, and its step is free again
    assert ckpt.save(2, later, {})
    ckpt.save(3, later, {})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3]  # keep=2 dropped step 1, not a good one for a corrupt one
    restored, meta = ckpt.restore_latest(fixed(exp))
    assert meta["step"] == 3
    assert_bitwise_equal(later, restored)
    ckpt.close()


def test_wrong_data_in_an_expert_shard_falls_back_to_its_previous_copy(trained, tmp_path):
    exp, state = trained
    events = []
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=2, emit=events.append)
    ckpt.save(1, state, {})
    ckpt.save(2, state, {})
    ckpt.wait()
    key = "opt_state/1/0/nu/layers/1/moe/w_out"
    overwrite_expert(tmp_path / "2", key, 3)
    with pytest.raises(CheckpointError, match=f"{key} expert 3: checksum mismatch"):
        ckpt.restore_rows(2, key, [3])
    np.testing.assert_array_equal(  # the other experts of that array are intact
        ckpt.restore_rows(2, key, [0, 2]),
        np.asarray(state["opt_state"][1][0].nu["layers"][1]["moe"]["w_out"])[[0, 2]],
    )
    # Only that expert's optimizer state falls back to step 1; step 2 stays (its dense part
    # and other experts are the newest state).
    restored, meta = ckpt.restore_latest(fixed(exp))
    assert meta["step"] == 2 and ckpt.all_steps() == [1, 2]
    assert_bitwise_equal(state, restored)
    assert meta["expert_sources"][1]["optimizer"] == [2, 2, 2, 1]
    assert meta["expert_sources"][1]["weights"] == [2, 2, 2, 2]
    assert not [e for e in events if e["event"] == "checkpoint_restore_failed"]
    [fallback] = [e for e in events if e["event"] == "checkpoint_expert_fallback"]
    assert (fallback["step"], fallback["layer"], fallback["expert"]) == (2, 1, 3)
    assert f"{key}: checksum mismatch" in fallback["error"] and fallback["fallback_step"] == 1
    ckpt.close()


def _file_bytes_read() -> int:
    [metric] = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
    return metric["values"][0]["value"]


@pytest.mark.slow
def test_a_subset_of_experts_reads_only_those_experts(tmp_path):
    exp = Experiment.from_config(
        tiny_config(moe__every=1, moe__num_experts=8, model__d_model=64, model__mlp_dim=128)
    )
    state = one_step(exp)
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=1)
    ckpt.save(1, state, {})
    ckpt.wait()
    key = "params/layers/1/moe/w_in"
    full = np.asarray(state["params"]["layers"][1]["moe"]["w_in"])
    read = {}
    for experts in ([5], [6, 1], list(range(8))):
        before = _file_bytes_read()
        rows = ckpt.restore_rows(1, key, experts)
        read[len(experts)] = _file_bytes_read() - before
        np.testing.assert_array_equal(rows, full[experts])
    # Each expert is its own chunk: bytes read grow with the experts asked for.
    assert read[1] < 0.25 * read[8] and read[2] < 0.4 * read[8]
    assert read[8] >= full.nbytes * 0.9  # (stored compressed; random floats barely shrink)
    ckpt.close()


def test_a_refused_save_is_an_error_event_not_a_checkpoint(trained, tmp_path, caplog):
    exp, state = trained
    events = []
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=3, emit=events.append)
    assert ckpt.save(2, state, {})
    assert not ckpt.save(2, state, {})  # the step exists: Orbax refuses
    assert not ckpt.save(1, state, {})  # older than the latest: Orbax refuses
    assert [(e["event"], e["step"]) for e in events] == [
        ("checkpoint", 2),
        ("checkpoint_failed", 2),
        ("checkpoint_failed", 1),
    ]
    assert "was not saved" in caplog.text
    assert ckpt.save(3, state, {})  # later saves still happen
    ckpt.close()


@pytest.mark.parametrize(
    "change", [{"moe__every": 2}, {"model__d_model": 64}], ids=["moe-layers", "shapes"]
)
def test_restore_into_a_different_model_fails_clearly_and_moves_nothing(trained, tmp_path, change):
    exp, state = trained
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=1)
    ckpt.save(1, state, {})
    ckpt.wait()
    other = Experiment.from_config(tiny_config(**{"moe__every": 1, **change}))
    with pytest.raises(CheckpointMismatch, match="different model configuration") as err:
        ckpt.restore_latest(fixed(other))
    assert "saved " in str(err.value) and ", model " in str(err.value)  # names what differs
    assert ckpt.all_steps() == [1] and not (tmp_path / "corrupt").exists()
    ckpt.close()


def test_the_target_sees_the_metadata_before_any_array_is_read(trained, tmp_path):
    exp, state = trained
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=1)
    ckpt.save(1, state, {"config": {"seed": 0}})
    ckpt.wait()

    def refuse(meta):
        raise ValueError(f"config {meta['config']} does not match")

    with pytest.raises(ValueError, match="does not match"):
        ckpt.restore_latest(refuse)
    assert ckpt.all_steps() == [1] and not (tmp_path / "corrupt").exists()
    ckpt.close()


def test_all_checkpoints_corrupt_is_an_error_that_says_where_they_are(trained, tmp_path):
    exp, state = trained
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=1)
    ckpt.save(1, state, {})
    ckpt.wait()
    corrupt(tmp_path / "1")
    with pytest.raises(CheckpointError, match="could be restored.*corrupt"):
        ckpt.restore_latest(fixed(exp))
    assert len(list((tmp_path / "corrupt").iterdir())) == 1
    ckpt.close()


def test_orbax_reads_failing_together_log_no_traceback(caplog):
    """A damaged step fails several of Orbax's concurrent reads: the first error reaches the
    reader, which reports it in one line; the others, whose tasks nobody awaits, are not logged
    again with a traceback when collected. Any other task's unretrieved error still is."""
    serialization = pytest.importorskip("orbax.checkpoint._src.serialization.serialization")
    async_deserialize = getattr(serialization, "async_deserialize", None)
    if async_deserialize is None:
        pytest.skip("this Orbax reads arrays through another coroutine")

    async def not_a_read():
        raise ValueError("a task of the user's")

    async def start_and_drop():
        for coro in (async_deserialize(None, {"driver": "no-such-driver"}), not_a_read()):
            asyncio.ensure_future(coro)
        await asyncio.sleep(0.05)

    gc.collect()  # an earlier test's unretrieved futures are logged now, not counted below
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(start_and_drop())
        gc.collect()
    logged = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert len(logged) == 1 and "not_a_read" in logged[0], logged


def restore_old(archive, tmp_path, writer, exp):
    """Restore ``archive`` (a checkpoint an older dynjax wrote: tests/data/README.md) onto
    ``exp``'s mesh, and check it is the state ``writer``'s seed reaches one step in, recomputed
    here on whatever jax is installed: the fixtures were written on jax 0.10, and a newer XLA
    rounds the step's float32 arithmetic differently (relative 2e-5 seen on jax 0.12).
    Returns (Checkpointer, state, meta)."""
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "old", filter="data")
    want = jax.device_get(one_step(writer))  # what that run had (same seed, same step)
    ckpt = Checkpointer(tmp_path / "old", stacks=EXPERT_STACKS, keep=2)
    restored, meta = ckpt.restore_latest(fixed(exp))
    assert meta["step"] == 1
    assert_placed_like(restored, exp.abstract_state)
    for got, expected in zip(jax.tree.leaves(restored), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-7)
    return ckpt, restored, meta


SMALL = {"model__d_model": 8, "model__num_heads": 2, "model__mlp_dim": 16, "data__seq_len": 8}


@pytest.mark.slow
def test_a_layout_1_checkpoint_still_restores(tmp_path):
    """``tests/data/old_layout_checkpoint.tar.gz``: step 1 of a run written by the code before
    layout 2 (one item per expert; tests/data/README.md), restored onto an expert-parallel mesh
    (the restore verified the layout-1 checksums) and then saved again in layout 2."""
    writer = Experiment.from_config(tiny_config(moe__every=1, **SMALL))
    exp = Experiment.from_config(tiny_config(moe__every=1, mesh__expert=2, mesh__data=2, **SMALL))
    ckpt, restored, meta = restore_old(OLD_LAYOUT, tmp_path, writer, exp)
    items = sorted(p.name for p in (tmp_path / "old" / "1").iterdir() if p.is_dir())
    experts = [f"expert_l{i}_e{e}" for i in (0, 1) for e in range(4)]
    assert items == sorted(["dense", "meta", *experts]) and "layout" not in meta
    ckpt.save(2, restored, meta)
    again, meta = ckpt.restore_latest(fixed(exp))
    ckpt.close()
    assert meta["step"] == 2 and meta["layout"] == 2
    assert_bitwise_equal(restored, again)
    shutil.rmtree(tmp_path / "old")


def test_a_checkpoint_from_before_the_per_head_columns_restores_them_reordered(tmp_path):
    """``tests/data/qkv_before_per_head_checkpoint.tar.gz``: step 1 of a dense run written by
    the code whose fused attention projection had (q/k/v, head) columns (tests/data/README.md).
    Restored onto a tensor-parallel mesh it is the state this seed reaches now (the same model,
    its columns per head, as are its Adam moments), and saved again it is marked per head and
    restores unchanged."""
    writer = Experiment.from_config(tiny_config(**SMALL))
    exp = Experiment.from_config(tiny_config(mesh__tensor=2, **SMALL))
    ckpt, restored, meta = restore_old(QKV_BEFORE_PER_HEAD, tmp_path, writer, exp)
    assert "qkv_columns" not in meta
    saved = layout.read_array(tmp_path / "old" / "1" / "dense", "params/layers/0/attn/qkv/kernel")
    kernel = np.asarray(restored["params"]["layers"][0]["attn"]["qkv"]["kernel"])
    assert not np.array_equal(saved, kernel)
    np.testing.assert_array_equal(qkv_per_head(saved, 2), kernel)
    ckpt.save(2, restored, meta)
    again, meta = ckpt.restore_latest(fixed(exp))
    ckpt.close()
    assert meta["step"] == 2 and meta["qkv_columns"] == "per head"
    assert_bitwise_equal(restored, again)


def test_columns_per_head_put_each_heads_query_key_and_value_side_by_side():
    """(q/k/v, head, Dh) columns become (head, q/k/v, Dh), on every leading axis."""
    heads, head_dim = 3, 2
    names = [(j, h, e) for j in range(3) for h in range(heads) for e in range(head_dim)]
    x = np.arange(2 * len(names)).reshape(2, len(names))
    got = qkv_per_head(x, heads)
    want = [names.index((j, h, e)) for h in range(heads) for j in range(3)
            for e in range(head_dim)]
    np.testing.assert_array_equal(got, x[:, want])


def old_meta(**pruning):
    return {"config": {"model": {"num_heads": 2, "d_model": 8}, "pruning": pruning}}


def test_only_a_checkpoint_from_before_the_per_head_columns_is_reordered():
    flat = {
        "params/layers/0/attn/qkv/kernel": np.arange(48.0).reshape(2, 24),
        "opt_state/1/0/mu/layers/0/attn/qkv/bias": np.arange(24.0),
        "params/layers/0/attn/out/kernel": np.arange(64.0).reshape(8, 8),
    }
    assert qkv_columns_per_head(flat, {"qkv_columns": "per head"}, 3) is flat
    got = qkv_columns_per_head(flat, old_meta(), 3)
    for key in ("params/layers/0/attn/qkv/kernel", "opt_state/1/0/mu/layers/0/attn/qkv/bias"):
        np.testing.assert_array_equal(got[key], qkv_per_head(flat[key], 2))
    assert got["params/layers/0/attn/out/kernel"] is flat["params/layers/0/attn/out/kernel"]


@pytest.mark.parametrize("meta, match", [
    ({"config": {}}, "no model.num_heads"),
    ({"config": {"model": {"num_heads": 2}}}, "no model.num_heads and model.d_model"),
    # head_dim 4: 8 x 8 blocks would be split by the reordering
    (old_meta(enabled=True, granularity="block", block_size=8), "pruned in 8 x 8 blocks"),
])
def test_a_checkpoint_that_cannot_be_reordered_is_refused_by_name(meta, match):
    flat = {"params/layers/0/attn/qkv/kernel": np.zeros((8, 24))}
    with pytest.raises(CheckpointMismatch, match=match):
        qkv_columns_per_head(flat, meta, 3)
    whole = qkv_columns_per_head(flat, old_meta(enabled=True, granularity="block", block_size=4),
                                 3)  # blocks of 4 stay whole: reordered
    key = "params/layers/0/attn/qkv/kernel"
    np.testing.assert_array_equal(whole[key], qkv_per_head(flat[key], 2))


def test_importing_dynjax_leaves_orbax_global_handlers_alone():
    """The replica-parallel writes are the checkpointer's own handlers (`checkpoint.handlers`):
    importing dynjax swaps no handler in Orbax's global registry under another Orbax user."""
    code = (
        "import jax, orbax.checkpoint as ocp\n"
        "before = ocp.type_handlers.get_type_handler(jax.Array)\n"
        "import dynjax.checkpoint, dynjax.train\n"
        "assert ocp.type_handlers.get_type_handler(jax.Array) is before\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_save_that_fails_in_the_background_is_an_event_of_its_own_step(trained, tmp_path,
                                                                          monkeypatch):
    """Issue 32 §2: the ``checkpoint`` event is written once the save is complete, and an error
    of the background write names that save's step, not the next one's."""
    exp, state = trained
    events = []
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=3, emit=events.append)
    assert ckpt.save(2, state, {})
    wait = ckpt._manager.wait_until_finished

    def fails_once():
        monkeypatch.setattr(ckpt._manager, "wait_until_finished", wait)
        wait()
        raise OSError("I/O error writing step 2")

    monkeypatch.setattr(ckpt._manager, "wait_until_finished", fails_once)
    assert ckpt.save(4, state, {})  # settles step 2 first: its own failure
    ckpt.wait()
    assert [(e["event"], e["step"]) for e in events] == [
        ("checkpoint_failed", 2), ("checkpoint", 4)
    ]
    assert events[0]["error"] == "OSError: I/O error writing step 2"
    assert events[1]["write_seconds"] >= events[1]["blocking_seconds"]
    ckpt.close()


@pytest.mark.parametrize("free", ["none", "plenty"])
def test_a_full_disk_fails_one_save_or_stops_naming_the_last_good_step(trained, tmp_path,
                                                                       monkeypatch, free):
    """A save that runs out of space is removed half-written and named; while another
    checkpoint fits, training goes on (a full disk for one save), and once none can, a
    `NoSpaceError` says what is full, how much a checkpoint needs and which step is good."""
    exp, state = trained
    events = []
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=3, emit=events.append)
    assert ckpt.save(2, state, {})
    ckpt.wait()
    save = ckpt._manager.save

    def no_space(step, *args, **kwargs):
        (tmp_path / f"{step}.orbax-checkpoint-tmp-1").mkdir()  # what a failed write leaves
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt._manager, "save", no_space)
    if free == "none":
        usage = shutil.disk_usage(tmp_path)._replace(free=1000)
        monkeypatch.setattr(manager_module.shutil, "disk_usage", lambda path: usage)
        with pytest.raises(NoSpaceError, match=r"is full: a checkpoint needs about .* MiB and "
                           r"0\.0 MiB are free; the newest good checkpoint is step 2 in"):
            ckpt.save(4, state, {})
    else:
        assert not ckpt.save(4, state, {})
        monkeypatch.setattr(ckpt._manager, "save", save)
        assert ckpt.save(6, state, {})  # later saves still happen
        ckpt.wait()
    assert not list(tmp_path.glob("*.orbax-checkpoint-tmp*"))
    assert ("checkpoint_failed", 4) in [(e["event"], e["step"]) for e in events]
    assert "No space left on device" in next(e["error"] for e in events if e["step"] == 4)
    assert 2 in ckpt.all_steps()  # the last good checkpoint is intact
    ckpt.close()
