"""Dense/sparse selector: the pure decision, the per-device cache, and a tiny real measurement."""

from __future__ import annotations

import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import BlockSparseMatrix, selector
from pallas_kernels.timing import median_seconds


class _CountingMeasure:
    def __init__(self, value):
        self.value, self.calls = value, 0

    def __call__(self):
        self.calls += 1
        return self.value


@pytest.mark.parametrize(
    ("sparse_seconds", "expected"),
    [
        ([2.0, 0.9, 0.5, 0.3], 0.75),  # wins from 75% on (the Sputnik/A100 shape, 003 §C)
        ([0.9, 0.8, 0.5, 0.3], 0.5),
        ([2.0, 2.0, 1.5, 1.1], None),  # never wins
        ([0.9, 1.2, 0.5, 0.3], 0.9),  # a win below a loss does not count
        ([2.0, 2.0, 2.0, 0.3], 0.95),
    ],
)
def test_crossover_from_timings(sparse_seconds, expected):
    assert selector.crossover_from_timings(selector.SPARSITIES, 1.0, sparse_seconds) == expected


def test_prefer_sparse():
    assert selector.prefer_sparse(0.9, 0.75)
    assert selector.prefer_sparse(0.75, 0.75)
    assert not selector.prefer_sparse(0.5, 0.75)
    assert not selector.prefer_sparse(0.99, None)


def test_cache_measures_once_per_device_kind(tmp_path):
    path = tmp_path / "crossover.json"
    measure = _CountingMeasure(0.75)
    cache = selector.CrossoverCache(path=path, measure=measure)
    assert cache.get("H100") == 0.75 and cache.get("H100") == 0.75
    assert measure.calls == 1
    assert json.loads(path.read_text()) == {"H100": 0.75}
    measure.value = None
    assert cache.get("cpu") is None and measure.calls == 2
    assert json.loads(path.read_text()) == {"H100": 0.75, "cpu": None}
    # A new process (a fresh cache on the same file) measures nothing, a "never" included.
    fresh = selector.CrossoverCache(path=path, measure=_CountingMeasure(0.1))
    assert fresh.get("H100") == 0.75 and fresh.get("cpu") is None
    assert fresh.measure.calls == 0


def test_cache_defaults_to_this_device_kind(tmp_path):
    measure = _CountingMeasure(0.9)
    selector.CrossoverCache(path=tmp_path / "c.json", measure=measure).get()
    assert json.loads((tmp_path / "c.json").read_text()) == {jax.devices()[0].device_kind: 0.9}


def test_corrupt_cache_file_is_remeasured(tmp_path):
    path = tmp_path / "crossover.json"
    path.write_text("{not json")
    measure = _CountingMeasure(0.5)
    assert selector.CrossoverCache(path=path, measure=measure).get("A100") == 0.5
    assert measure.calls == 1 and json.loads(path.read_text()) == {"A100": 0.5}


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(selector.CACHE_ENV, str(tmp_path))
    assert selector.default_cache_path().parent == tmp_path
    monkeypatch.delenv(selector.CACHE_ENV)
    assert ".cache" in selector.default_cache_path().parts


@pytest.mark.parametrize(("crossover", "uses_kernel"), [(0.7, True), (0.8, False), (None, False)])
def test_sparse_or_dense_matmul_follows_the_crossover(tmp_path, crossover, uses_kernel):
    rng = np.random.default_rng(0)
    mask = np.zeros((4, 4), bool)
    mask[np.arange(4), np.arange(4)] = True  # 75% sparse
    w = BlockSparseMatrix.from_dense(rng.standard_normal((32, 32)).astype(np.float32), 8, mask)
    x = jnp.asarray(rng.standard_normal((3, 32)), jnp.float32)
    cache = selector.CrossoverCache(path=tmp_path / "c.json", measure=lambda: crossover)
    matmul = lambda x: selector.sparse_or_dense_matmul(x, w, cache=cache)
    assert ("pallas_call" in str(jax.make_jaxpr(matmul)(x))) == uses_kernel
    np.testing.assert_allclose(matmul(x), x @ w.to_dense(), rtol=1e-5, atol=1e-5)


def test_real_measurement_runs_small_even_from_inside_jit(tmp_path, monkeypatch):
    """A tiny real measurement, first requested while tracing, times concrete arrays on another
    thread and returns the crossover its timings give.

    At this size both products take tens of microseconds on a CPU, so which one wins is noise
    (None, 0.5 and 0.75 all come out). The dense timing is handicapped by a second here, so the
    real sparse timings must win at every sparsity: the answer can only be the smallest one.
    """
    timings = []

    def timed(fn, *args, **kwargs):
        seconds = median_seconds(fn, *args, **kwargs)
        dense = not isinstance(args[1], BlockSparseMatrix)
        concrete = not any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(args))
        timings.append((dense, seconds, concrete, threading.current_thread()))
        return seconds + 1.0 if dense else seconds

    monkeypatch.setattr(selector, "median_seconds", timed)
    measure = lambda: selector.measure_crossover(
        size=32, block_size=16, sparsities=(0.5, 0.75), repeats=1
    )
    cache = selector.CrossoverCache(path=tmp_path / "c.json", measure=measure)
    traced = jax.jit(lambda x: x + (cache.get() or np.nan))(0.0)  # None fails below
    assert cache.get() == 0.5 and traced == 0.5
    assert json.loads((tmp_path / "c.json").read_text()) == {jax.devices()[0].device_kind: 0.5}
    assert [dense for dense, *_ in timings] == [True, False, False]  # dense, then 0.5 and 0.75
    assert all(0 < seconds < 1 and concrete for _, seconds, concrete, _ in timings)
    assert threading.main_thread() not in {thread for *_, thread in timings}


def test_random_block_mask_has_exact_density():
    mask = selector.random_block_mask((8, 8), 0.75)
    assert mask.shape == (8, 8) and mask.sum() == 16
