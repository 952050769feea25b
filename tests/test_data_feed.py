"""Data per host (issue 15 §5): each process reads only the rows its devices consume, the
global batch stays a function of (seed, step), and a background prefetcher feeds the loop."""

import threading
import time

import jax
import numpy as np
import pytest

from dynjax.config import load_config, validate_config
from dynjax.data import DataError, Prefetcher, TokenWindows, TrainOrder
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.parallel import batch_sharding
from dynjax.parallel.feed import place_rows, shard
from dynjax.train import train

from .helpers import losses
from .tiny import tiny_config


def simulated_processes(count: int) -> list[frozenset]:
    """The 8 devices split into ``count`` processes as a launch splits them: consecutive
    devices per process (the mesh takes them in (process, id) order)."""
    devices = sorted(jax.devices(), key=lambda d: d.id)
    per = len(devices) // count
    return [frozenset(devices[p * per : (p + 1) * per]) for p in range(count)]


def assembled(exp, step, placements, runtime, count):
    """For each placement (sharding, rows): the global array assembled from the shards each of
    ``count`` simulated processes builds from only the rows it read, and the rows each read."""
    full = exp.order.batch(step)
    reads = [runtime.batch_rows(devices) for devices in simulated_processes(count)]
    out = []
    for sharding, rows in placements:
        shape = (len(rows), exp.settings.data.seq_len)
        index = sharding.devices_indices_map(shape)
        arrays = {}
        for devices, read in zip(simulated_processes(count), reads, strict=True):
            part = exp.order.batch(step, read)  # this process's read
            np.testing.assert_array_equal(part.sample_ids, full.sample_ids)
            for d in devices & set(index):
                arrays[d] = jax.device_put(shard(part.targets, part.rows, rows, index[d]), d)
        got = jax.make_array_from_single_device_arrays(
            shape, sharding, [arrays[d] for d in sharding.addressable_devices]
        )
        out.append((got, jax.device_put(full.targets[rows], sharding)))  # today's placement
    return out, reads


@pytest.mark.parametrize(
    "mesh",
    [{"mesh__data": 8}, {"mesh__data": 2, "mesh__expert": 2, "mesh__tensor": 2, "moe__every": 2}],
)
@pytest.mark.parametrize("count", [1, 2, 4])
def test_data_parallel_processes_read_their_rows_and_assemble_the_global_batch(mesh, count):
    exp = Experiment.from_config(tiny_config(**mesh))
    runtime = exp.runtime(exp.initial_plan())
    for step in (0, 7):
        arrays, reads = assembled(exp, step, [(batch_sharding(exp.mesh), np.arange(8))],
                                  runtime, count)
        for got, want in arrays:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        # disjoint shares that cover the batch: a tensor pair of devices holds the same rows
        assert [len(r) for r in reads] == [8 // count] * count
        assert sorted(np.concatenate(reads).tolist()) == list(range(8))


@pytest.mark.parametrize("count", [1, 2, 4])
def test_pipeline_processes_read_rows_only_for_their_first_and_last_stages(count):
    exp = Experiment.from_config(
        tiny_config(model__num_layers=4, mesh__stage=4, mesh__data=2, train__microbatches=2)
    )
    runtime = exp.runtime(exp.initial_plan())
    placements = runtime.pipeline.batch_placements(8)
    assert len(placements) == 2 * 2  # microbatches of the first stage's inputs, last's targets
    arrays, reads = assembled(exp, 3, placements, runtime, count)
    for got, want in arrays:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # 4 processes of one stage each: the middle stages' processes read nothing
    want = {1: [8], 2: [8, 8], 4: [8, 0, 0, 8]}[count]
    assert [len(r) for r in reads] == want


@pytest.mark.slow
def test_a_pipeline_step_on_the_read_rows_equals_the_full_batch():
    """A batch read as rows trains as the whole batch does; one missing rows a stage's devices
    hold is refused, naming them (the first stage's devices hold rows 0, 2, 4 and 6 of
    microbatch 0, all placed with the first request)."""
    exp = Experiment.from_config(tiny_config(mesh__stage=2, mesh__data=2, train__microbatches=2))
    plan = exp.initial_plan()
    exe = exp.lower_train_step(plan).compile()
    losses = []
    for rows in (None, np.arange(8)):
        runtime = exp.runtime(plan)
        batch = exp.order.batch(5) if rows is None else exp.order.batch(5, rows)
        metrics = runtime.step(exe, batch, None)
        losses.append(jax.device_get(runtime.host_metrics(5, jax.device_get(metrics))["loss"]))
    assert losses[0] == losses[1]
    runtime = exp.runtime(plan)
    with pytest.raises(ValueError, match=r"rows \[0, 2, 4, 6\] of the batch were not read"):
        runtime.step(exe, exp.order.batch(5, np.array([1, 3, 5, 7])), None)


def reference_batch(windows, batch_size, seed, step):
    """The order and windows as written before this change: one sample at a time."""
    ids = np.empty(batch_size, np.int64)
    for j in range(batch_size):
        epoch, pos = divmod(step * batch_size + j, windows.num_train)
        ids[j] = np.random.default_rng([seed, epoch]).permutation(windows.num_train)[pos]
    L = windows.seq_len
    rows = np.stack([np.asarray(windows.tokens[i * L : i * L + L + 1]) for i in ids])
    return ids, rows[:, :-1].astype(np.int32), rows[:, 1:].astype(np.int32)


def test_any_rows_of_a_batch_are_those_rows_of_the_global_batch_across_epochs():
    tokens = np.random.default_rng(0).integers(0, 256, 23 * 8 + 1).astype(np.uint16)
    windows = TokenWindows(tokens, 8, 0.1, vocab_size=256, path="t.npy")  # 21 to train
    order = TrainOrder(windows, 6, seed=3)
    for step in (0, 3, 4, 13):  # 3 and 13 span two epochs
        ids, inputs, targets = reference_batch(windows, 6, 3, step)
        full = order.batch(step)
        np.testing.assert_array_equal(full.sample_ids, ids)
        np.testing.assert_array_equal(full.inputs, inputs)
        np.testing.assert_array_equal(full.targets, targets)
        for rows in (np.array([1, 4]), np.array([5]), np.arange(0)):
            part = TrainOrder(windows, 6, seed=3).batch(step, rows)  # a fresh (resumed) order
            np.testing.assert_array_equal(part.inputs, inputs[rows])
            np.testing.assert_array_equal(part.targets, targets[rows])
            np.testing.assert_array_equal(part.rows, rows)


def test_place_rows_equals_device_put_of_the_global_batch():
    exp = Experiment.from_config(tiny_config(mesh__data=2, mesh__expert=2, moe__every=2))
    sharding = batch_sharding(exp.mesh)
    full = exp.order.batch(2)
    got = place_rows(full.inputs, full.rows, np.arange(8)[1::2], sharding)
    np.testing.assert_array_equal(np.asarray(got), full.inputs[1::2])


def windows_order(batch_size=4):
    tokens = np.arange(40 * 8 + 1) % 256
    return TrainOrder(TokenWindows(tokens, 8, 0.1, 256, "t.npy"), batch_size, seed=1)


def test_prefetch_yields_the_sequence_without_prefetch():
    order = windows_order()
    for depth in (0, 1, 3):
        with Prefetcher(order.batch, 5, 25, depth) as batches:
            for step in range(5, 25):
                got, want = batches.get(step), order.batch(step)
                np.testing.assert_array_equal(got.inputs, want.inputs)
                np.testing.assert_array_equal(got.sample_ids, want.sample_ids)
            with pytest.raises(ValueError, match="asked for step 25, expected 25 of"):
                batches.get(25)
    with Prefetcher(order.batch, 0, 4, 2) as batches, pytest.raises(ValueError, match="step 1"):
        batches.get(1)


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "dynjax-prefetch"]


def test_prefetch_stops_promptly_and_raises_build_errors_at_their_step():
    order = windows_order()
    batches = Prefetcher(order.batch, 0, 10_000, 2)
    time.sleep(0.2)  # the thread is blocked on a full queue
    began = time.perf_counter()
    batches.close()
    assert time.perf_counter() - began < 1 and not prefetch_threads()

    def build(step):
        if step == 3:
            raise DataError("data.path='x': unreadable window")
        return order.batch(step)

    with Prefetcher(build, 0, 10, 2) as batches:
        for step in range(3):
            batches.get(step)
        with pytest.raises(DataError, match="unreadable window"):
            batches.get(3)
    assert not prefetch_threads()


def test_a_run_stopped_by_an_exception_leaves_no_prefetch_thread(tmp_path, monkeypatch):
    from dynjax import train as train_module

    write = train_module.MetricsWriter.write

    def failing(self, step, record):
        if step == 3:
            raise RuntimeError("disk full")
        write(self, step, record)

    monkeypatch.setattr(train_module.MetricsWriter, "write", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        train(tiny_config(train__steps=8, data__prefetch=2), tmp_path, progress=False)
    assert not prefetch_threads()


@pytest.mark.slow
def test_resume_mid_run_and_prefetch_depth_see_the_same_batches(tmp_path):
    base = {"train__checkpoint_every": 3, "train__eval_every": 1000}
    reference = train(tiny_config(train__steps=6, data__prefetch=0, **base), tmp_path / "ref",
                      progress=False)
    assert 0 < reference.batch_build_seconds <= reference.batch_wait_seconds  # on the loop
    run = tmp_path / "run"
    train(tiny_config(train__steps=3, data__prefetch=3, **base), run, progress=False)
    resumed = train(tiny_config(train__steps=6, data__prefetch=1, **base), run, progress=False)
    assert resumed.start_step == 3  # a changed data.prefetch does not refuse the resume
    assert losses(run) == losses(tmp_path / "ref")  # every step, bit for bit


def test_bad_prefetch_depth_names_the_key():
    with pytest.raises(ConfigError, match=r"data.prefetch=-1 must be >= 0"):
        validate_config(tiny_config(data__prefetch=-1), 8)
    with pytest.raises(ConfigError, match="config key 'data.prefetch' expects int, got '1.5'"):
        load_config("tests/tiny.py", ["data.prefetch=1.5"])


def test_a_restarted_prefetcher_reads_from_its_new_step_with_its_new_reader():
    """A rollback reads again from an earlier step; a re-pack's new rows read other rows."""
    order = windows_order()
    some_rows = lambda step: order.batch(step, rows=np.arange(2))  # noqa: E731
    for depth in (0, 2):
        with Prefetcher(order.batch, 0, 10, depth) as batches:
            for step in range(4):
                batches.get(step)
            built = batches.build_seconds
            batches.restart(2)
            np.testing.assert_array_equal(batches.get(2).inputs, order.batch(2).inputs)
            batches.restart(3, some_rows)
            got, want = batches.get(3), some_rows(3)
            np.testing.assert_array_equal(got.inputs, want.inputs)
            assert len(got.inputs) < len(order.batch(3).inputs)
            assert batches.build_seconds > built  # the counters go on across restarts
            with pytest.raises(ValueError, match="asked for step 5, expected 4"):
                batches.get(5)
        assert not prefetch_threads()
