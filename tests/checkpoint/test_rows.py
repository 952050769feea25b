"""Row-stacked leaves of any scheme (`dynjax.checkpoint.rows`): the checkpoint machinery saves
and restores whatever rows a declaration names, not only MoE's experts (seed 004 §3's partial
saves, generically), and a run takes the declaration of the one plugin that makes it."""

import jax
import ml_collections
import numpy as np
import pytest

from dynjax.checkpoint import NO_ROWS, Checkpointer, RowStacks, layout
from dynjax.checkpoint.rows import SOURCES, row_group
from dynjax.dynamism import Plugin
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.train import partial_rows

from ..helpers import assert_placed_like, one_step
from ..tiny import tiny_config


def down_layer(key: str) -> int | None:
    """A dense model's MLP down projections (and their moments) as row-stacked leaves, one
    stack per layer: rows a scheme of its own might save a few at a time."""
    names = key.split("/")
    if names[-3:] != ["mlp", "down", "kernel"]:
        return None
    return int(names[names.index("layers") + 1])


DOWN = RowStacks(down_layer)


@pytest.fixture(scope="module")
def trained():
    exp = Experiment.from_config(tiny_config())
    return exp, one_step(exp)


def test_rows_of_another_declaration_save_partially_and_restore_row_by_row(trained, tmp_path):
    exp, state = trained
    later = jax.tree.map(lambda a: a + 1 if a.dtype.kind == "f" else a, state)
    events = []
    ckpt = Checkpointer(tmp_path, stacks=DOWN, keep=2, emit=events.append)
    ckpt.save(1, state, {})
    ckpt.save(2, later, {}, rows={0: [1], 1: [0, 5]})
    ckpt.wait()
    stacked = layout.split(state, DOWN)[layout.ROWS]
    assert sorted(stacked) == [
        f"{root}/layers/{i}/mlp/down/kernel"
        for root in ("opt_state/1/0/mu", "opt_state/1/0/nu", "params")
        for i in (0, 1)
    ]
    restored, meta = ckpt.restore_latest(lambda meta: exp.abstract_state)
    ckpt.close()
    rows = stacked[next(iter(stacked))].shape[0]
    want_0 = [2 if r == 1 else 1 for r in range(rows)]
    want_1 = [2 if r in (0, 5) else 1 for r in range(rows)]
    assert meta[SOURCES] == {
        0: {"weights": want_0, "optimizer": want_0},
        1: {"weights": want_1, "optimizer": want_1},
    }
    flat, old, new = (layout.flatten(t) for t in (restored, state, later))
    for key, got in flat.items():
        if key not in stacked:  # every other leaf whole from the newest step
            np.testing.assert_array_equal(np.asarray(got), np.asarray(new[key]), err_msg=key)
            continue
        chosen = want_0 if down_layer(key) == 0 else want_1
        want = [np.asarray((new if s == 2 else old)[key][r]) for r, s in enumerate(chosen)]
        np.testing.assert_array_equal(np.asarray(got), np.stack(want), err_msg=key)
        assert row_group(key) == ("weights" if key.startswith("params/") else "optimizer")
    assert_placed_like(restored, exp.abstract_state)


def test_without_a_declaration_every_leaf_is_dense(trained, tmp_path):
    exp, state = trained
    ckpt = Checkpointer(tmp_path, stacks=NO_ROWS, keep=1, async_save=False)
    ckpt.save(1, state, {})
    assert sorted(p.name for p in (tmp_path / "1").iterdir() if p.is_dir()) == ["dense", "meta"]
    restored, meta = ckpt.restore_latest(lambda meta: exp.abstract_state)
    ckpt.close()
    assert SOURCES not in meta  # no rows to assemble
    for key, got in layout.flatten(restored).items():
        np.testing.assert_array_equal(np.asarray(got), np.asarray(layout.flatten(state)[key]))


class _Rows:
    """A declaration as a scheme's `checkpoint_rows` gives it (`rows.PartialRows`)."""

    stacks, ids, rows, k, persist_k = DOWN, (0, 1), 64, 0, 0

    def fresh(self, step):
        raise AssertionError("K = 0: no policy")

    from_meta = fresh


class Down(Plugin):
    name = "down"

    def checkpoint_rows(self, checkpoint, history):
        return _Rows()


def test_a_run_takes_the_rows_of_the_one_plugin_that_declares_them():
    cfg = tiny_config(moe__every=1)
    exp = Experiment.from_config(cfg)
    moe = exp.plugins  # MoE's alone among the enabled schemes
    down = Down(ml_collections.ConfigDict({"enabled": True}), exp.facts)
    checkpoint = exp.settings.checkpoint
    assert partial_rows((down,), checkpoint, 3).stacks is DOWN
    assert partial_rows(moe, checkpoint, 3).ids == (0, 1)  # MoE's: its layers
    assert partial_rows((), checkpoint, 3) is None
    with pytest.raises(ConfigError, match=r"\['down', 'moe'\] each declare row-stacked"):
        partial_rows((*moe, down), checkpoint, 3)
