"""Partial expert checkpoints (seed 004 §3, issue 13): K = E is the full save, partial rows
restore bit for bit, a restore assembles each expert from its newest copy, W / O / WO cut the
right leaves, retention keeps the steps holding newest copies, and a bad copy falls back."""

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from dynjax.checkpoint import Checkpointer, RowsMissing, layout
from dynjax.checkpoint.rows import row_group
from dynjax.dynamism.moe.checkpoint import EXPERT_STACKS, expert_layer
from dynjax.experiment import Experiment

from ..helpers import assert_bitwise_equal, assert_placed_like, one_step, overwrite_expert
from ..tiny import tiny_config

E = 4
LAYERS = (0, 1)  # both layers are MoE (moe.every=1)


@pytest.fixture(scope="module", params=["1-device", "8-devices"])
def trained(request):
    """A 2-layer, 4-expert MoE experiment and its state after one step: on one device, or on
    8 (data 2 x expert 4, one expert per expert shard)."""
    mesh = {} if request.param == "1-device" else {"mesh__data": 2, "mesh__expert": 4}
    exp = Experiment.from_config(tiny_config(moe__every=1, **mesh))
    return exp, one_step(exp)


def shifted(state, k):
    """``state`` with every float leaf + k: a later step's state, on the same devices."""
    return jax.tree.map(lambda a: a + k if a.dtype.kind == "f" else a, state)


def experts_of(state):
    return {k: np.asarray(a) for k, a in layout.split(state, EXPERT_STACKS)[layout.ROWS].items()}


def expected_state(states, sources, newest):
    """The state a restore must assemble: dense leaves of ``states[newest]``, each expert row
    of each (layer, group) from ``states[sources[layer][group][e]]``."""
    flat = {k: np.asarray(a) for k, a in layout.flatten(states[newest]).items()}
    for key in experts_of(states[newest]):
        chosen = sources[expert_layer(key)][row_group(key)]
        flat[key] = np.stack([experts_of(states[s])[key][e] for e, s in enumerate(chosen)])
    return flat


def assert_restored(restored, want):
    got = {k: np.asarray(a) for k, a in layout.flatten(restored).items()}
    assert set(got) == set(want)
    for key, arr in want.items():
        np.testing.assert_array_equal(got[key], arr, err_msg=key)


def stored_rows(step_dir):
    """Leading dimension of each array of the experts item as stored on disk."""
    stored = ocp.StandardCheckpointer().metadata(step_dir / "experts").item_metadata
    return {k: a.shape[0] for k, a in layout.denest(stored).items()}


@pytest.mark.slow
def test_all_experts_is_exactly_the_full_save(trained, tmp_path):
    exp, state = trained
    events = {"full": [], "pec": []}
    sizes, restored = {}, {}
    for name, experts in (("full", None), ("pec", {layer: range(E) for layer in LAYERS})):
        ckpt = Checkpointer(tmp_path / name, stacks=EXPERT_STACKS, keep=1, emit=events[name].append)
        assert ckpt.save(1, state, {}, rows=experts)
        ckpt.wait()
        restored[name], meta = ckpt.restore_latest(lambda meta: exp.abstract_state)
        ckpt.close()
        sizes[name] = stored_rows(tmp_path / name / "1")
        assert meta["expert_sources"] == {
            layer: {"weights": [1] * E, "optimizer": [1] * E} for layer in LAYERS
        }
    assert_bitwise_equal(state, restored["pec"])
    assert_bitwise_equal(restored["full"], restored["pec"])
    assert_placed_like(restored["pec"], exp.abstract_state)
    assert sizes["pec"] == sizes["full"] and set(sizes["pec"].values()) == {E}
    assert events["pec"][0]["bytes"] == events["full"][0]["bytes"]
    assert events["pec"][0]["experts_saved"] == {str(layer): list(range(E)) for layer in LAYERS}


def test_partial_rows_restore_bit_for_bit(trained, tmp_path):
    exp, state = trained
    later = shifted(state, 1.0)
    events = []
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=2, emit=events.append)
    ckpt.save(1, state, {})
    ckpt.save(2, later, {}, rows={0: [1], 1: [3, 2]})
    ckpt.wait()
    assert events[1]["experts_saved"] == {"0": [1], "1": [2, 3]}
    full = sum(a.nbytes for a in jax.tree.leaves(state))
    expert_bytes = sum(a.nbytes for a in experts_of(state).values())
    assert events[1]["bytes"] == full - expert_bytes + expert_bytes * 3 // (2 * E)
    rows = stored_rows(tmp_path / "2")
    assert all(n == (1 if expert_layer(k) == 0 else 2) for k, n in rows.items())
    want = experts_of(later)
    for key in want:
        chosen = [1] if expert_layer(key) == 0 else [2, 3]
        np.testing.assert_array_equal(ckpt.restore_rows(2, key, chosen), want[key][chosen])
    restored, meta = ckpt.restore_latest(lambda meta: exp.abstract_state)
    ckpt.close()
    sources = {
        0: {"weights": [1, 2, 1, 1], "optimizer": [1, 2, 1, 1]},
        1: {"weights": [1, 1, 2, 2], "optimizer": [1, 1, 2, 2]},
    }
    assert meta["step"] == 2 and meta["expert_sources"] == sources
    assert_restored(restored, expected_state({1: state, 2: later}, sources, 2))
    assert_placed_like(restored, exp.abstract_state)


def test_rotating_experts_assemble_from_their_newest_steps(trained, tmp_path):
    exp, state = trained
    states = {s: shifted(state, float(s)) for s in (1, 2, 3)}
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=3)
    ckpt.save(1, states[1], {})
    ckpt.save(2, states[2], {}, rows={0: [0, 1], 1: [2, 3]})
    ckpt.save(3, states[3], {}, rows={0: [1, 2], 1: [3, 0]})
    ckpt.wait()
    restored, meta = ckpt.restore_latest(lambda meta: exp.abstract_state)
    sources = {
        0: {"weights": [2, 3, 3, 1], "optimizer": [2, 3, 3, 1]},
        1: {"weights": [3, 1, 2, 3], "optimizer": [3, 1, 2, 3]},
    }
    assert meta["step"] == 3 and meta["expert_sources"] == sources
    assert_restored(restored, expected_state(states, sources, 3))
    # As of step 2, step 3's copies do not count.
    restored, meta = ckpt.restore(2, exp.abstract_state)
    ckpt.close()
    sources = {
        0: {"weights": [2, 2, 1, 1], "optimizer": [2, 2, 1, 1]},
        1: {"weights": [1, 1, 2, 2], "optimizer": [1, 1, 2, 2]},
    }
    assert meta["expert_sources"] == sources
    assert_restored(restored, expected_state(states, sources, 2))


@pytest.mark.parametrize("content", ["W", "O", "WO"])
def test_content_cuts_only_its_leaves(trained, tmp_path, content):
    exp, state = trained
    later = shifted(state, 1.0)
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=2)
    ckpt.save(1, state, {})
    ckpt.save(2, later, {}, rows={0: [3], 1: [0]}, content=content)
    ckpt.wait()
    partial = {"W": {"weights"}, "O": {"optimizer"}, "WO": {"weights", "optimizer"}}[content]
    rows = stored_rows(tmp_path / "2")
    assert len(rows) == 12  # (params, mu, nu) x (w_in, w_out) x 2 layers
    for key, n in rows.items():
        assert n == (1 if row_group(key) in partial else E), key
    assert {row_group(k) for k in rows if k.startswith("params/")} == {"weights"}
    restored, meta = ckpt.restore_latest(lambda meta: exp.abstract_state)
    ckpt.close()
    sources = {
        layer: {
            group: [2 if group not in partial or e == chosen else 1 for e in range(E)]
            for group in ("weights", "optimizer")
        }
        for layer, chosen in ((0, 3), (1, 0))
    }
    assert meta["expert_sources"] == sources
    assert_restored(restored, expected_state({1: state, 2: later}, sources, 2))


def test_retention_keeps_the_steps_holding_newest_copies(trained, tmp_path):
    exp, state = trained
    states = {s: shifted(state, float(s)) for s in (1, 2, 3, 4)}
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=1, async_save=True)
    ckpt.save(1, states[1], {})
    ckpt.save(2, states[2], {}, rows={0: [0, 1], 1: [0, 1]})
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]  # step 1 holds the only copy of experts 2, 3
    ckpt.save(3, states[3], {}, rows={0: [1, 2], 1: [1, 2]})
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2, 3]  # 1: expert 3, 2: expert 0, 3: the newest
    ckpt.save(4, states[4], {}, rows={0: [0, 3], 1: [0, 3]})
    ckpt.wait()
    assert ckpt.all_steps() == [3, 4]  # 1's expert 3 and 2's expert 0 are newer at 4
    restored, meta = ckpt.restore_latest(lambda meta: exp.abstract_state)
    ckpt.close()
    sources = {layer: {g: [4, 3, 3, 4] for g in ("weights", "optimizer")} for layer in LAYERS}
    assert meta["expert_sources"] == sources
    assert_restored(restored, expected_state(states, sources, 4))
    # A new Checkpointer reads what each step holds from its metadata: a full save frees all.
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=1, async_save=False)
    ckpt.save(5, states[4], {})
    assert ckpt.all_steps() == [5]
    ckpt.close()


def test_a_corrupt_expert_row_falls_back_to_its_previous_copy(trained, tmp_path, caplog):
    exp, state = trained
    later = shifted(state, 1.0)
    events = []
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=2, emit=events.append)
    ckpt.save(1, state, {})
    ckpt.save(2, later, {}, rows={0: [0, 2], 1: [1, 3]})
    ckpt.wait()
    # Expert 2 of layer 0 is the second row stored at step 2: rewrite its w_out weights.
    overwrite_expert(tmp_path / "2", "params/layers/0/moe/w_out", 1)
    restored, meta = ckpt.restore_latest(lambda meta: exp.abstract_state)
    assert meta["step"] == 2 and ckpt.all_steps() == [1, 2]  # not quarantined
    assert not (tmp_path / "corrupt").exists()
    sources = {
        0: {"weights": [2, 1, 1, 1], "optimizer": [2, 1, 2, 1]},
        1: {"weights": [1, 2, 1, 2], "optimizer": [1, 2, 1, 2]},
    }
    assert meta["expert_sources"] == sources
    # The expert's weights fall back together (w_in too), its optimizer state does not.
    assert_restored(restored, expected_state({1: state, 2: later}, sources, 2))
    [event] = [e for e in events if e["event"] == "checkpoint_expert_fallback"]
    assert {k: event[k] for k in ("step", "layer", "expert", "group", "fallback_step")} == {
        "step": 2,
        "layer": 0,
        "expert": 2,
        "group": "weights",
        "fallback_step": 1,
    }
    assert "checksum mismatch" in event["error"] and "expert 2 of layer 0" in caplog.text
    # No copy left: step 1 holds the only copy of expert 3 of layer 0.
    overwrite_expert(tmp_path / "1", "opt_state/1/0/mu/layers/0/moe/w_in", 3)
    with pytest.raises(RowsMissing, match="expert 3 of layer 0 .optimizer. has no usable"):
        ckpt.restore_latest(lambda meta: exp.abstract_state)
    assert ckpt.all_steps() == [1, 2] and not (tmp_path / "corrupt").exists()
    ckpt.close()


def test_a_first_partial_save_saves_every_expert_without_a_copy(trained, tmp_path):
    exp, state = trained
    events = []
    ckpt = Checkpointer(
        tmp_path, stacks=EXPERT_STACKS, keep=1, async_save=False, emit=events.append
    )
    ckpt.save(1, state, {}, rows={0: [1], 1: [2]}, content="W")
    assert events[0]["experts_saved"] == {"0": list(range(E)), "1": list(range(E))}
    ckpt.save(2, state, {}, rows={0: [1], 1: [2]}, content="W")
    assert events[1]["experts_saved"] == {"0": [1], "1": [2]}
    with pytest.raises(ValueError, match="content='X'"):
        ckpt.save(3, state, {}, content="X")
    with pytest.raises(ValueError, match="each layer"):
        ckpt.save(3, state, {}, rows={0: [1]})
    with pytest.raises(ValueError, match=r"experts\[1\] = \[4\]"):
        ckpt.save(3, state, {}, rows={0: [1], 1: [4]})
    ckpt.close()


@pytest.mark.slow
def test_pruning_masks_are_saved_with_their_experts_weights(tmp_path):
    exp = Experiment.from_config(tiny_config(moe__every=1, pruning__enabled=True))
    state = exp.init_state()
    later = jax.tree.map(
        lambda a: a + 1 if a.dtype.kind == "f" else ~a if a.dtype == bool else a, state
    )
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=2)
    ckpt.save(1, state, {})
    ckpt.save(2, later, {}, rows={0: [2], 1: [0]}, content="W")
    ckpt.wait()
    rows = stored_rows(tmp_path / "2")
    masks = [k for k in rows if "/masks/" in k]
    assert len(masks) == 4 and all(rows[k] == 1 for k in masks)
    assert all(n == E for k, n in rows.items() if "/inner/" in k)  # the Adam moments: whole
    restored, meta = ckpt.restore_latest(lambda meta: exp.abstract_state)
    ckpt.close()
    sources = {
        layer: {"weights": [2 if e == chosen else 1 for e in range(E)], "optimizer": [2] * E}
        for layer, chosen in ((0, 2), (1, 0))
    }
    assert meta["expert_sources"] == sources
    assert_restored(restored, expected_state({1: state, 2: later}, sources, 2))
