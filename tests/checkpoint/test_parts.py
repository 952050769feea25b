"""Checkpoints in parts (a pipeline over processes, issue 15 §4), written here by one process
playing both: each part holds some leaves, a restore reads each leaf from the part holding it
and verifies it, and unusable or incomplete steps are set aside, never deleted."""

import dataclasses
import shutil
import tarfile
import threading

import jax
import numpy as np
import pytest

from dynjax.checkpoint import CheckpointError, CheckpointMismatch, layout
from dynjax.checkpoint.parts import PartedCheckpointer, Sources, part_dir, restore_parts
from dynjax.checkpoint.rows import row_group
from dynjax.dynamism.moe.checkpoint import EXPERT_STACKS, expert_layer
from dynjax.experiment import Experiment
from dynjax.model.attention import qkv_per_head

from ..helpers import (
    QKV_BEFORE_PER_HEAD,
    Store,
    assert_bitwise_equal,
    corrupt,
    one_step,
    overwrite_expert,
)
from ..tiny import tiny_config


@dataclasses.dataclass
class Writer:
    """The `Peers` fields a save reads: one process of two (saving needs no exchange)."""

    index: int
    count: int = 2


@pytest.fixture(scope="module")
def trained():
    exp = Experiment.from_config(tiny_config(moe__every=2, model__num_layers=3))
    return exp, one_step(exp)


def part_of(state, p: int, first_layers=(0,)):
    """Process ``p``'s leaves as a pipeline over two processes would hold them: the embedding
    and ``first_layers`` on process 0, the rest on process 1, optimizer scalars on both; None
    elsewhere."""
    first_keys = ("embed", *(f"/layers/{i}/" for i in first_layers))

    def mine(path, leaf):
        key = layout.key_of(path)
        first = any(k in key for k in first_keys)
        shared = leaf.ndim == 0
        return leaf if shared or first == (p == 0) else None

    return jax.tree_util.tree_map_with_path(mine, state)


def save(root, step, state, parts=(0, 1), experts=None, first_layers=(0,)):
    """Each of ``parts`` saves its leaves of ``state`` at ``step`` (``experts``: every MoE
    layer's experts to save, as the ledger gives them to every process)."""
    saved = []
    for p in parts:
        ckpt = PartedCheckpointer(root, Writer(p), keep=3, stacks=EXPERT_STACKS, emit=saved.append)
        assert ckpt.save(step, part_of(state, p, first_layers), {"plan": {}, "config": {}},
                         rows=experts)
        ckpt.close()
    return [e["experts_saved"] for e in saved if e["event"] == "checkpoint"]


def later(state, by=1.0):
    return jax.tree.map(lambda a: a + by if a.dtype.kind == "f" else a, state)


def target(exp):
    return lambda meta: exp.abstract_state


def restored_step_2(exp, state, root, event):
    """Restore ``root``: step 2, holding ``state``, comes back; the ``event`` events logged."""
    events = []
    restored, meta = restore_parts(
        root, target(exp), None, stacks=EXPERT_STACKS, emit=events.append
    )
    assert meta["step"] == 2
    assert_bitwise_equal(jax.device_get(state), restored)
    return [e for e in events if e["event"] == event]


def test_each_leaf_is_read_from_the_part_that_holds_it(trained, tmp_path):
    exp, state = trained
    save(tmp_path, 2, state)
    save(tmp_path, 4, later(state))
    held = [set(Sources(tmp_path).meta(part_dir(tmp_path, p), 4)["checksums"]) for p in (0, 1)]
    assert held[0] and held[1] and held[0] - held[1] and held[1] - held[0]  # neither holds all
    assert any(expert_layer(k) is not None for k in held[1])  # and experts are parts too
    restored, meta = restore_parts(tmp_path, target(exp), None, stacks=EXPERT_STACKS)
    assert meta["step"] == 4 and meta["parts"] == 2
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(restored))
    assert_bitwise_equal(jax.device_get(later(state)), restored)


def expert_rows(tree, rows, group=None):
    """Each expert leaf of ``tree`` (host arrays; of expert ``group`` only, if given) with row e
    taken from ``rows[e]``'s tree."""
    flat = layout.flatten(tree)
    for key in layout.split(tree, EXPERT_STACKS)[layout.ROWS]:
        if group in (None, row_group(key)):
            rows_of = [np.asarray(layout.flatten(r)[key][e]) for e, r in enumerate(rows)]
            flat[key] = np.stack(rows_of)
    return layout.unflatten_like(tree, flat)


def test_partial_expert_saves_in_parts_restore_each_expert_from_its_newest_copy(
    trained, tmp_path
):
    """PEC (seed 004 §3) over parts: the part holding the MoE layer saves the ledger's experts
    of it, the other part none; a restore takes each expert from the newest step whose
    part holds it, says so in ``expert_sources``, and falls back past a corrupted copy."""
    exp, state = trained
    [moe] = exp.model_cfg.moe_layers
    b, c = later(state), later(state, 2.0)
    assert save(tmp_path, 2, state) == [{}, {str(moe): [0, 1, 2, 3]}]
    assert save(tmp_path, 4, b, experts={moe: [1]}) == [{}, {str(moe): [1]}]
    assert save(tmp_path, 6, c, experts={moe: [2, 3]}) == [{}, {str(moe): [2, 3]}]
    restored, meta = restore_parts(tmp_path, target(exp), None, stacks=EXPERT_STACKS)
    assert meta["step"] == 6
    assert meta["expert_sources"] == {moe: {"weights": [2, 4, 6, 6], "optimizer": [2, 4, 6, 6]}}
    host = [jax.device_get(t) for t in (state, b, c)]
    assert_bitwise_equal(expert_rows(host[2], [host[0], host[1], host[2], host[2]]), restored)

    key = f"params/layers/{moe}/moe/w_in"
    overwrite_expert(part_dir(tmp_path, 1) / "4", key, 0)  # its only row: expert 1
    events = []
    restored, meta = restore_parts(
        tmp_path, target(exp), None, stacks=EXPERT_STACKS, emit=events.append
    )
    assert meta["expert_sources"][moe]["weights"] == [2, 2, 6, 6]
    [fallback] = [e for e in events if e["event"] == "checkpoint_expert_fallback"]
    assert (fallback["step"], fallback["expert"], fallback["fallback_step"]) == (4, 1, 2)
    # Expert 1's weights from step 2; its optimizer state, which verified, still from step 4.
    want = expert_rows(host[2], [host[0], host[1], host[2], host[2]])
    want = expert_rows(want, [host[0], host[0], host[2], host[2]], group="weights")
    assert meta["expert_sources"][moe]["optimizer"] == [2, 4, 6, 6]
    assert_bitwise_equal(want, restored)


def test_an_expert_layer_that_moved_between_processes_is_assembled_across_parts(
    trained, tmp_path
):
    """The MoE layer is on process 0 at step 2, on process 1 at step 4 (a rebalance), back on
    process 0 at step 6. A part that has no copy of some expert saves it whole; process 0's
    part, which has copies from step 2, saves only expert 0 at step 6, and the restore takes
    the others from process 1's part of step 4, the newest."""
    exp, state = trained
    [moe] = exp.model_cfg.moe_layers
    b, c = later(state), later(state, 2.0)
    on_0 = (0, moe)
    assert save(tmp_path, 2, state, experts={moe: [0]}, first_layers=on_0) == [
        {str(moe): [0, 1, 2, 3]}, {}
    ]
    assert save(tmp_path, 4, b, experts={moe: [0]}) == [{}, {str(moe): [0, 1, 2, 3]}]
    assert save(tmp_path, 6, c, experts={moe: [0]}, first_layers=on_0) == [{str(moe): [0]}, {}]
    restored, meta = restore_parts(tmp_path, target(exp), None, stacks=EXPERT_STACKS)
    assert meta["expert_sources"] == {moe: {"weights": [6, 4, 4, 4], "optimizer": [6, 4, 4, 4]}}
    host = [jax.device_get(t) for t in (state, b, c)]
    assert_bitwise_equal(expert_rows(host[2], [host[2], host[1], host[1], host[1]]), restored)


def test_a_process_reads_only_the_leaves_its_stages_need(trained, tmp_path):
    exp, state = trained
    save(tmp_path, 2, state)
    only_1 = lambda meta: part_of(exp.abstract_state, 1)
    restored, _ = restore_parts(tmp_path, only_1, None, stacks=EXPERT_STACKS)
    assert_bitwise_equal(jax.device_get(part_of(state, 1)), restored)
    assert len(jax.tree.leaves(restored)) < len(jax.tree.leaves(state))


def test_a_step_one_process_never_saved_is_set_aside_and_its_number_saved_again(
    trained, tmp_path
):
    exp, state = trained
    save(tmp_path, 2, state)
    save(tmp_path, 4, later(state), parts=(0,))  # process 1 died before saving step 4
    incomplete = restored_step_2(exp, state, tmp_path, "checkpoint_incomplete")
    assert [e["step"] for e in incomplete] == [4] and len(incomplete[0]["moved_to"]) == 1
    kept = list((part_dir(tmp_path, 0) / "corrupt").iterdir())
    assert [k.name.split("-")[0] for k in kept] == ["4"] and (kept[0] / "dense").is_dir()
    save(tmp_path, 4, later(state, 2.0))  # the step number is free again, in both parts
    restored, meta = restore_parts(tmp_path, target(exp), None, stacks=EXPERT_STACKS)
    assert meta["step"] == 4
    assert_bitwise_equal(jax.device_get(later(state, 2.0)), restored)


def test_a_corrupted_part_sets_its_step_aside_in_every_part(trained, tmp_path):
    exp, state = trained
    save(tmp_path, 2, state)
    save(tmp_path, 4, later(state))
    corrupt(part_dir(tmp_path, 1) / "4")
    failed = restored_step_2(exp, state, tmp_path, "checkpoint_restore_failed")
    assert [e["step"] for e in failed] == [4] and len(failed[0]["moved_to"]) == 2
    assert Sources(tmp_path).part_steps() == {2: [part_dir(tmp_path, p) for p in (0, 1)]}


def test_wrong_data_in_a_part_is_caught_by_its_checksum(trained, tmp_path):
    exp, state = trained
    save(tmp_path, 2, state)
    save(tmp_path, 4, later(state))
    held = Sources(tmp_path).meta(part_dir(tmp_path, 1), 4)["checksums"]
    key = next(k for k in held if expert_layer(k) is not None)
    overwrite_expert(part_dir(tmp_path, 1) / "4", key, expert=1)  # reads back fine
    failed = restored_step_2(exp, state, tmp_path, "checkpoint_restore_failed")
    assert [e["step"] for e in failed] == [4] and "checksum mismatch" in failed[0]["error"]


def test_no_usable_step_is_an_error_that_says_where_they_are(trained, tmp_path):
    exp, state = trained
    save(tmp_path, 2, state)
    corrupt(part_dir(tmp_path, 0) / "2")
    with pytest.raises(CheckpointError, match="unusable: \\[2\\]"):
        restore_parts(tmp_path, target(exp), None, stacks=EXPERT_STACKS)
    assert (part_dir(tmp_path, 0) / "corrupt").is_dir()


def test_a_checkpoint_of_another_model_is_an_error_and_moves_nothing(trained, tmp_path):
    exp, state = trained
    save(tmp_path, 2, state)
    narrower = tiny_config(moe__every=2, model__num_layers=3, model__d_model=16)
    other = Experiment.from_config(narrower)
    with pytest.raises(CheckpointMismatch, match="different model configuration"):
        restore_parts(tmp_path, target(other), None, stacks=EXPERT_STACKS)
    assert Sources(tmp_path).part_steps() == {2: [part_dir(tmp_path, p) for p in (0, 1)]}


def both_processes(restore):
    """``restore(peers)`` in two threads standing for two processes; their results (or the
    exceptions they raised), by process."""
    store, out = Store(2), [None, None]

    def process(index):
        try:
            out[index] = restore(store.peers(index))
        except Exception as err:  # noqa: BLE001 - returned for the test to look at
            out[index] = err

    threads = [threading.Thread(target=process, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_a_step_only_one_process_cannot_read_is_set_aside_for_all(trained, tmp_path):
    """Process 1's leaf of step 4 is corrupt; process 0 reads its own leaves fine. Both agree
    that step 4 is unusable, process 0 moves it aside in both parts, and both restore step 2."""
    exp, state = trained
    save(tmp_path, 2, state)
    save(tmp_path, 4, later(state))
    held = Sources(tmp_path).meta(part_dir(tmp_path, 1), 4)["checksums"]
    key = next(k for k in held if expert_layer(k) is not None)
    overwrite_expert(part_dir(tmp_path, 1) / "4", key, expert=0)
    events = [[], []]
    got = both_processes(lambda peers: restore_parts(
        tmp_path, lambda meta: part_of(exp.abstract_state, peers.index), peers,
        stacks=EXPERT_STACKS, emit=events[peers.index].append,
    ))
    for p, (restored, meta) in enumerate(got):
        assert meta["step"] == 2
        assert_bitwise_equal(jax.device_get(part_of(state, p)), restored)
        (failed,) = [e for e in events[p] if e["event"] == "checkpoint_restore_failed"]
        assert failed["step"] == 4 and len(failed["moved_to"]) == 2
        assert failed["error"].startswith("in process 1: CheckpointError")
    assert Sources(tmp_path).part_steps() == {2: [part_dir(tmp_path, p) for p in (0, 1)]}


def test_another_model_seen_by_one_process_is_an_error_in_both(trained, tmp_path):
    """Only process 1's leaves differ from the checkpoint's: both raise the mismatch (none
    waits for the other) and nothing is moved."""
    exp, state = trained
    save(tmp_path, 2, state)
    narrower = Experiment.from_config(
        tiny_config(moe__every=2, model__num_layers=3, model__d_model=16)
    )

    def target(index):
        which = exp if index == 0 else narrower
        return lambda meta: part_of(which.abstract_state, index)

    got = both_processes(
        lambda peers: restore_parts(tmp_path, target(peers.index), peers, stacks=EXPERT_STACKS)
    )
    assert all(isinstance(e, CheckpointMismatch) for e in got), got
    assert Sources(tmp_path).part_steps() == {2: [part_dir(tmp_path, p) for p in (0, 1)]}


def test_unreadable_metadata_of_part_0_is_a_broken_step_not_a_fresh_start(trained, tmp_path):
    exp, state = trained
    save(tmp_path, 2, state)
    save(tmp_path, 4, later(state))
    (part_dir(tmp_path, 0) / "4" / "meta" / "metadata").write_text("{not json")
    failed = restored_step_2(exp, state, tmp_path, "checkpoint_restore_failed")
    assert [e["step"] for e in failed] == [4]
    # Only incomplete steps left: an error that says so, never a silent start from scratch.
    save(tmp_path, 6, later(state), parts=(0,))
    for p in (0, 1):
        shutil.rmtree(part_dir(tmp_path, p) / "2")
    with pytest.raises(CheckpointError, match="not saved by every process: \\[6\\]"):
        restore_parts(tmp_path, target(exp), None, stacks=EXPERT_STACKS)


def test_a_whole_checkpoint_from_before_the_per_head_columns_is_read_reordered(tmp_path):
    """The reads of a pipeline over processes reorder the fused projection's columns of a
    checkpoint written before they were per head, as a whole restore does."""
    with tarfile.open(QKV_BEFORE_PER_HEAD) as tar:
        tar.extractall(tmp_path, filter="data")
    keys = ["params/layers/0/attn/qkv/kernel", "opt_state/1/0/mu/layers/1/attn/qkv/bias",
            "params/layers/0/attn/out/kernel"]
    saved = {k: layout.read_array(tmp_path / "1" / "dense", k) for k in keys}
    template = {k: jax.ShapeDtypeStruct(a.shape, a.dtype) for k, a in saved.items()}
    got, meta = Sources(tmp_path).read(1, [tmp_path], template, EXPERT_STACKS)
    assert "qkv_columns" not in meta
    for key in keys[:2]:
        np.testing.assert_array_equal(got[key], qkv_per_head(saved[key], 2))
    np.testing.assert_array_equal(got[keys[2]], saved[keys[2]])
