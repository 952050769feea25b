"""Checkpoints: exact round trip, per-expert items, quarantine of a corrupt latest, refused saves,
resharding."""

import jax
import numpy as np
import pytest

from dynjax.checkpoint import Checkpointer, CheckpointError, CheckpointMismatch
from dynjax.experiment import Experiment

from .tiny import tiny_config


@pytest.fixture(scope="module")
def trained():
    """A MoE experiment and a state one optimizer step in (so Adam moments are non-zero)."""
    exp = Experiment.from_config(tiny_config(moe__every=1))
    plan = exp.initial_plan()
    step = exp.lower_train_step(plan).compile()
    state = exp.init_state()
    state["params"], state["opt_state"], _ = step(
        state["params"], state["opt_state"], exp.device_batch(exp.order.batch(0))
    )
    return exp, jax.device_get(state)


def assert_bitwise_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_is_exact_and_experts_are_items(trained, tmp_path):
    exp, state = trained
    events = []
    ckpt = Checkpointer(tmp_path, keep=2, emit=events.append)
    ckpt.save(5, state, {"plan": exp.initial_plan().to_dict()})
    ckpt.wait()
    items = sorted(p.name for p in (tmp_path / "5").iterdir() if p.is_dir())
    assert items == sorted(
        ["dense", "meta"] + [f"expert_l{layer}_e{e}" for layer in (0, 1) for e in range(4)]
    )
    restored, meta = ckpt.restore_latest(exp.abstract_state)
    assert meta["step"] == 5 and meta["plan"] == exp.initial_plan().to_dict()
    assert_bitwise_equal(state, restored)
    assert [e["event"] for e in events] == ["checkpoint", "checkpoint_restore"]
    ckpt.close()


def _corrupt(step_dir):
    """Truncate the largest data file of the dense item: a half-written checkpoint."""
    files = [p for p in (step_dir / "dense").rglob("*") if p.is_file()]
    biggest = max(files, key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])


def test_corrupt_latest_is_set_aside_and_its_step_saved_again(trained, tmp_path):
    exp, state = trained
    events = []
    ckpt = Checkpointer(tmp_path, keep=2, emit=events.append)
    ckpt.save(1, state, {})
    later = jax.tree.map(lambda a: a + 1 if a.dtype.kind == "f" else a, state)
    ckpt.save(2, later, {})
    ckpt.wait()
    _corrupt(tmp_path / "2")
    restored, meta = ckpt.restore_latest(exp.abstract_state)
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
    restored, meta = ckpt.restore_latest(exp.abstract_state)
    assert meta["step"] == 3
    assert_bitwise_equal(later, restored)
    ckpt.close()


def test_a_refused_save_is_an_error_event_not_a_checkpoint(trained, tmp_path, caplog):
    exp, state = trained
    events = []
    ckpt = Checkpointer(tmp_path, keep=3, emit=events.append)
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


def test_restore_into_a_different_model_fails_clearly_and_moves_nothing(trained, tmp_path):
    exp, state = trained
    ckpt = Checkpointer(tmp_path, keep=1)
    ckpt.save(1, state, {})
    ckpt.wait()
    other = Experiment.from_config(tiny_config(moe__every=2))  # one MoE layer instead of two
    with pytest.raises(CheckpointMismatch, match="different model configuration"):
        ckpt.restore_latest(other.abstract_state)
    assert ckpt.all_steps() == [1] and not (tmp_path / "corrupt").exists()
    ckpt.close()


def test_a_check_of_the_metadata_runs_before_any_array_is_read(trained, tmp_path):
    exp, state = trained
    ckpt = Checkpointer(tmp_path, keep=1)
    ckpt.save(1, state, {"config": {"seed": 0}})
    ckpt.wait()

    def refuse(meta):
        raise ValueError(f"config {meta['config']} does not match")

    with pytest.raises(ValueError, match="does not match"):
        ckpt.restore_latest(exp.abstract_state, check=refuse)
    assert ckpt.all_steps() == [1] and not (tmp_path / "corrupt").exists()
    ckpt.close()


def test_all_checkpoints_corrupt_is_an_error_that_says_where_they_are(trained, tmp_path):
    exp, state = trained
    ckpt = Checkpointer(tmp_path, keep=1)
    ckpt.save(1, state, {})
    ckpt.wait()
    _corrupt(tmp_path / "1")
    with pytest.raises(CheckpointError, match="could be restored.*corrupt"):
        ckpt.restore_latest(exp.abstract_state)
    assert len(list((tmp_path / "corrupt").iterdir())) == 1
    ckpt.close()


def test_restore_reshards_onto_a_different_mesh(trained, tmp_path):
    exp, state = trained
    ckpt = Checkpointer(tmp_path, keep=1)
    ckpt.save(1, state, {})
    ckpt.wait()
    sharded = Experiment.from_config(tiny_config(moe__every=1, mesh__data=2, mesh__expert=4))
    host, _ = ckpt.restore_latest(sharded.abstract_state)
    placed = sharded.place_state(host)
    w_in = placed["params"]["layers"][0]["moe"]["w_in"]
    assert len(w_in.sharding.device_set) == 8
    assert w_in.addressable_shards[0].data.shape[0] == 1  # 4 experts over 4 expert shards
    assert_bitwise_equal(state, jax.device_get(placed))
    ckpt.close()
