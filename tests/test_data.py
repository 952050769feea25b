"""Byte-level data: sources, split, deterministic and resumable order, stable sample indices."""

import gc
import logging
import weakref

import numpy as np
import pytest

from dynjax import data
from dynjax.data import DataError, TokenWindows, TrainOrder, load_tokens, validation_batches
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.train import main

from .tiny import tiny_config


def windows(tokens, seq_len=8, val=0.25):
    return TokenWindows(tokens, seq_len, val, vocab_size=256, path="corpus.npy")


def test_sources_text_dir_npy_bin(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"hello ")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_bytes(b"world")
    np.testing.assert_array_equal(
        load_tokens(str(tmp_path), 100), np.frombuffer(b"hello world", np.uint8)
    )
    assert len(load_tokens(str(tmp_path), 7)) == 7
    arr = np.arange(50, dtype=np.int32)
    np.save(tmp_path / "t.npy", arr)
    np.testing.assert_array_equal(load_tokens(str(tmp_path / "t.npy"), 0), arr)
    arr.astype(np.uint16).tofile(tmp_path / "t.bin")
    np.testing.assert_array_equal(load_tokens(str(tmp_path / "t.bin"), 0), arr)
    with pytest.raises(DataError, match="data.path='nope' does not exist"):
        load_tokens("nope", 10)


def test_embedded_corpus_is_real_text():
    tokens = load_tokens("", 20_000)
    assert len(tokens) == 20_000 and b"def " in tokens.tobytes()


def test_windows_carry_stable_ids_and_split_is_disjoint():
    tokens = np.arange(201, dtype=np.int64) % 256
    w = windows(tokens)
    assert (w.num_train, w.num_val) == (19, 6)
    batch = w.window(np.array([3, 0]))
    np.testing.assert_array_equal(batch.inputs[0], np.arange(24, 32))
    np.testing.assert_array_equal(batch.targets[0], np.arange(25, 33))
    val_ids = np.concatenate([b.sample_ids for b in validation_batches(w, 2, 10, 1)])
    assert val_ids.min() >= w.num_train and len(val_ids) == 6


def test_order_is_deterministic_resumable_and_covers_each_epoch():
    w = windows(np.arange(401) % 256)
    a, b = TrainOrder(w, 4, seed=7), TrainOrder(w, 4, seed=7)
    steps = [a.batch(t).sample_ids for t in range(20)]
    # a fresh iterator started at step 13 (a resumed run) yields what the first one did
    np.testing.assert_array_equal(b.batch(13).sample_ids, steps[13])
    first_epoch = np.concatenate(steps)[: w.num_train]
    assert sorted(first_epoch.tolist()) == list(range(w.num_train))
    assert not np.array_equal(TrainOrder(w, 4, seed=8).batch(0).sample_ids, steps[0])


def test_bad_data_is_reported():
    with pytest.raises(DataError, match="too few for a train/validation split"):
        windows(np.zeros(10, np.int64), val=0.5)
    with pytest.raises(ConfigError, match="train.batch_size=5 exceeds the 4 training windows"):
        TrainOrder(windows(np.zeros(41, np.int64)), batch_size=5, seed=0)


@pytest.mark.parametrize(
    "bad, message",
    [
        (-1, r"token id -1 at index 37 .* outside \[0, model.vocab_size=256\): ids must be >= 0"),
        (300, r"token id 300 at index 37 .*: raise model.vocab_size to at least 301"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused(bad, message):
    tokens = np.arange(201, dtype=np.int32) % 256
    tokens[37] = bad
    with pytest.raises(DataError, match="data.path='corpus.npy': " + message):
        windows(tokens)


class ReadLog(np.ndarray):
    """A token array that records the length of each slice taken of part of it."""

    reads: list[int] = []

    def __getitem__(self, key):
        if isinstance(key, slice) and len(range(*key.indices(len(self)))) < len(self):
            ReadLog.reads.append(len(range(*key.indices(len(self)))))
        return super().__getitem__(key)


def test_vocabulary_check_reads_a_chunk_at_a_time(monkeypatch):
    monkeypatch.setattr(data, "SCAN_CHUNK", 16)
    tokens = np.arange(201, dtype=np.int64) % 256  # 25 windows of 8: every token is used
    tokens[150] = -5  # in the tenth chunk
    ReadLog.reads = []
    with pytest.raises(DataError, match="token id -5 at index 150 "):
        windows(tokens.view(ReadLog))
    assert ReadLog.reads and max(ReadLog.reads) <= 16
    assert sum(ReadLog.reads) >= 151  # the chunks cover the stream up to the bad id


def test_empty_and_malformed_files_are_refused(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    np.save(tmp_path / "empty.npy", np.zeros(0, np.int32))
    (tmp_path / "blank.npy").write_bytes(b"")
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    for name in ("empty.txt", "empty.npy", "empty.bin"):
        with pytest.raises(DataError, match=f"data.path='.*{name}' holds no tokens: point it"):
            load_tokens(str(tmp_path / name), 100)
    with pytest.raises(DataError, match="blank.npy' is not a readable .npy array"):
        load_tokens(str(tmp_path / "blank.npy"), 100)
    with pytest.raises(DataError, match="odd.bin' has 3 bytes, not a whole number of 2-byte"):
        load_tokens(str(tmp_path / "odd.bin"), 100)


def test_cli_refuses_bad_tokens_with_an_error_not_a_traceback(tmp_path, capsys):
    tokens = np.random.default_rng(0).integers(0, 256, 4000).astype(np.int32)
    tokens[2500] = -3
    np.save(tmp_path / "t.npy", tokens)
    argv = ["--config", "tests/tiny.py", "--workdir", str(tmp_path / "run")]
    assert main([*argv, f"--config.data.path={tmp_path / 't.npy'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data.path=") and "token id -3 at index 2500" in err


def test_a_validation_set_smaller_than_a_batch_is_evaluated_with_a_warning(caplog):
    w = windows(np.arange(201) % 256, val=0.3)  # 25 windows: 18 train, 7 validation
    with caplog.at_level(logging.WARNING, logger="dynjax.data"):
        (batch,) = validation_batches(w, batch_size=8, num_batches=4, batch_shards=2)
    np.testing.assert_array_equal(batch.sample_ids, np.arange(18, 24))
    assert "data.val_fraction=0.3 gives 7 validation windows, fewer than train.batch_size=8: " \
        "evaluating on one batch of 6" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dynjax.data"):
        assert validation_batches(w, batch_size=16, num_batches=4, batch_shards=8) == []
    assert "too few to split over the 8 batch shards" in caplog.text
    assert "evaluation is off" in caplog.text


def short_validation(tmp_path, **overrides):
    """A run on 60 windows of 32 tokens: 54 to train on, 6 to validate (fewer than a batch of 8),
    and its runtime at the initial Plan."""
    tokens = np.random.default_rng(0).integers(0, 256, 60 * 32 + 1).astype(np.int32)
    np.save(tmp_path / "t.npy", tokens)
    cfg = tiny_config(
        data__path=str(tmp_path / "t.npy"), data__val_fraction=0.1, moe__every=2, **overrides
    )
    exp = Experiment.from_config(cfg)
    plan = exp.initial_plan()
    return exp, plan, exp.runtime(plan)


@pytest.mark.slow
def test_both_runtimes_evaluate_a_validation_set_smaller_than_a_batch(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="dynjax.data"):
        one, plan, single = short_validation(tmp_path)
        ep, ep_plan, sharded = short_validation(tmp_path, mesh__data=2, mesh__expert=2)
        # one training microbatch of 8: the 6 rows run as 3 microbatches of 2 (new shapes)
        pp, pp_plan, pipeline = short_validation(
            tmp_path, mesh__stage=2, mesh__data=2, train__microbatches=1
        )
    assert pp_plan.stage_layers == (1, 1)
    assert [len(e.val_batches[0].inputs) for e in (one, ep, pp)] == [6, 4, 6]
    assert "one batch of 4 (the most that split over the 4 batch shards" in caplog.text
    six = single.evaluate(plan)
    assert 4 < six < 7  # about ln(256) at initialization
    assert pipeline.evaluate(pp_plan) == pytest.approx(six, rel=1e-5)
    four = one.eval_step(plan)(single.state["params"], one.device_batch(ep.val_batches[0]))
    assert sharded.evaluate(ep_plan) == pytest.approx(float(four), rel=1e-5)


def test_eval_steps_are_kept_for_the_last_cache_size_plans():
    exp = Experiment.from_config(tiny_config(moe__every=2, recompile__cache_size=2))
    a, b, c = (exp.initial_plan().with_part("moe", capacities=((n,) * 4,)) for n in (3, 4, 5))
    first = exp.eval_step(a)
    assert exp.eval_step(a) is first
    exp.eval_step(b)
    assert exp.eval_step(a) is first  # and `a` is now the most recent
    exp.eval_step(c)  # drops `b`, the least recent
    assert exp.eval_step(a) is first
    dropped = weakref.ref(exp.eval_step(b))  # back, dropping `a`
    exp.eval_step(c)
    assert exp.eval_step(a) is not first
    gc.collect()
    assert dropped() is None  # `b` was dropped again, and nothing else holds it
