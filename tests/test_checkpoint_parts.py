"""Checkpoints in parts (a pipeline over processes, issue 15 §4), written here by one process
playing both: each part holds some leaves, a restore reads each leaf from the part holding it
and verifies it, and unusable or incomplete steps are set aside, never deleted."""

import dataclasses

import jax
import numpy as np
import pytest

from dynjax.checkpoint import CheckpointError, CheckpointMismatch, layout
from dynjax.checkpoint.parts import PartedCheckpointer, Sources, part_dir, restore_parts
from dynjax.experiment import Experiment

from .test_checkpoint import _corrupt, _overwrite_expert, assert_bitwise_equal, one_step
from .tiny import tiny_config


@dataclasses.dataclass
class Writer:
    """The `Peers` fields a save reads: one process of two (saving needs no exchange)."""

    index: int
    count: int = 2


@pytest.fixture(scope="module")
def trained():
    exp = Experiment.from_config(tiny_config(moe__every=2, model__num_layers=3))
    return exp, one_step(exp)


def part_of(state, p: int):
    """Process ``p``'s leaves as a pipeline over two processes would hold them: the embedding
    and layer 0 on process 0, the rest on process 1, optimizer scalars on both; None
    elsewhere."""

    def mine(path, leaf):
        key = layout.key_of(path)
        first = "embed" in key or "/layers/0/" in key
        shared = leaf.ndim == 0
        return leaf if shared or first == (p == 0) else None

    return jax.tree_util.tree_map_with_path(mine, state)


def save(root, step, state, parts=(0, 1)):
    for p in parts:
        ckpt = PartedCheckpointer(root, Writer(p), keep=3)
        assert ckpt.save(step, part_of(state, p), {"plan": {}, "config": {}})
        ckpt.close()


def later(state, by=1.0):
    return jax.tree.map(lambda a: a + by if a.dtype.kind == "f" else a, state)


def target(exp):
    return lambda meta: exp.abstract_state


def test_each_leaf_is_read_from_the_part_that_holds_it(trained, tmp_path):
    exp, state = trained
    save(tmp_path, 2, state)
    save(tmp_path, 4, later(state))
    held = [set(Sources(tmp_path).meta(part_dir(tmp_path, p), 4)["checksums"]) for p in (0, 1)]
    assert held[0] and held[1] and held[0] - held[1] and held[1] - held[0]  # neither holds all
    assert any(layout.expert_layer(k) is not None for k in held[1])  # and experts are parts too
    restored, meta = restore_parts(tmp_path, target(exp), None)
    assert meta["step"] == 4 and meta["parts"] == 2
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(restored))
    assert_bitwise_equal(jax.device_get(later(state)), restored)


def test_a_process_reads_only_the_leaves_its_stages_need(trained, tmp_path):
    exp, state = trained
    save(tmp_path, 2, state)
    only_1 = lambda meta: part_of(exp.abstract_state, 1)
    restored, _ = restore_parts(tmp_path, only_1, None)
    assert_bitwise_equal(jax.device_get(part_of(state, 1)), restored)
    assert len(jax.tree.leaves(restored)) < len(jax.tree.leaves(state))


def test_a_step_one_process_never_saved_is_set_aside_and_its_number_saved_again(
    trained, tmp_path
):
    exp, state = trained
    save(tmp_path, 2, state)
    save(tmp_path, 4, later(state), parts=(0,))  # process 1 died before saving step 4
    events = []
    restored, meta = restore_parts(tmp_path, target(exp), None, emit=events.append)
    assert meta["step"] == 2
    assert_bitwise_equal(jax.device_get(state), restored)
    incomplete = [e for e in events if e["event"] == "checkpoint_incomplete"]
    assert [e["step"] for e in incomplete] == [4] and len(incomplete[0]["moved_to"]) == 1
    kept = list((part_dir(tmp_path, 0) / "corrupt").iterdir())
    assert [k.name.split("-")[0] for k in kept] == ["4"] and (kept[0] / "dense").is_dir()
    save(tmp_path, 4, later(state, 2.0))  # the step number is free again, in both parts
    restored, meta = restore_parts(tmp_path, target(exp), None)
    assert meta["step"] == 4
    assert_bitwise_equal(jax.device_get(later(state, 2.0)), restored)


def test_a_corrupted_part_sets_its_step_aside_in_every_part(trained, tmp_path):
    exp, state = trained
    save(tmp_path, 2, state)
    save(tmp_path, 4, later(state))
    _corrupt(part_dir(tmp_path, 1) / "4")
    events = []
    restored, meta = restore_parts(tmp_path, target(exp), None, emit=events.append)
    assert meta["step"] == 2
    assert_bitwise_equal(jax.device_get(state), restored)
    failed = [e for e in events if e["event"] == "checkpoint_restore_failed"]
    assert [e["step"] for e in failed] == [4] and len(failed[0]["moved_to"]) == 2
    assert Sources(tmp_path).part_steps() == {2: [part_dir(tmp_path, p) for p in (0, 1)]}


def test_wrong_data_in_a_part_is_caught_by_its_checksum(trained, tmp_path):
    exp, state = trained
    save(tmp_path, 2, state)
    save(tmp_path, 4, later(state))
    held = Sources(tmp_path).meta(part_dir(tmp_path, 1), 4)["checksums"]
    key = next(k for k in held if layout.expert_layer(k) is not None)
    _overwrite_expert(part_dir(tmp_path, 1) / "4", key, expert=1)  # reads back fine
    events = []
    restored, meta = restore_parts(tmp_path, target(exp), None, emit=events.append)
    assert meta["step"] == 2
    failed = [e for e in events if e["event"] == "checkpoint_restore_failed"]
    assert [e["step"] for e in failed] == [4] and "checksum mismatch" in failed[0]["error"]
    assert_bitwise_equal(jax.device_get(state), restored)


def test_no_usable_step_is_an_error_that_says_where_they_are(trained, tmp_path):
    exp, state = trained
    save(tmp_path, 2, state)
    _corrupt(part_dir(tmp_path, 0) / "2")
    with pytest.raises(CheckpointError, match="none of the checkpoints \\[2\\]"):
        restore_parts(tmp_path, target(exp), None)
    assert (part_dir(tmp_path, 0) / "corrupt").is_dir()


def test_a_checkpoint_of_another_model_is_an_error_and_moves_nothing(trained, tmp_path):
    exp, state = trained
    save(tmp_path, 2, state)
    narrower = tiny_config(moe__every=2, model__num_layers=3, model__d_model=16)
    other = Experiment.from_config(narrower)
    with pytest.raises(CheckpointMismatch, match="different model configuration"):
        restore_parts(tmp_path, target(other), None)
    assert Sources(tmp_path).part_steps() == {2: [part_dir(tmp_path, p) for p in (0, 1)]}
