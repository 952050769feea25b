"""Monitor: hands out the metrics of step t - Δ and never touches a younger step."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dynjax.recompile.monitor import Monitor


class Probe:
    """A metric leaf that records when it is converted to host memory."""

    def __init__(self, step: int, reads: list[tuple[int, int]], clock: list[int]):
        self.step, self.reads, self.clock = step, reads, clock

    def __array__(self, dtype=None, copy=None):
        self.reads.append((self.step, self.clock[0]))
        return np.asarray(self.step, dtype=dtype)


@pytest.mark.parametrize("delta", [1, 2, 3])
def test_never_reads_a_step_younger_than_delta(delta):
    reads: list[tuple[int, int]] = []
    clock = [0]
    monitor = Monitor(delta)
    handed: list[int] = []
    for step in range(10):
        clock[0] = step
        monitor.push(step, {"loss": Probe(step, reads, clock), "nested": {"x": 1.0}})
        for s, metrics in monitor.pop_ready(step):
            assert s <= step - delta
            assert metrics["loss"] == s and isinstance(metrics["loss"], np.ndarray)
            handed.append(s)
    assert handed == list(range(10 - delta))
    assert all(read_step <= now - delta for read_step, now in reads)
    assert [s for s, _ in monitor.drain()] == list(range(10 - delta, 10))
    assert len(monitor) == 0


def test_delta_changes_at_runtime():
    monitor = Monitor(delta=3)
    for step in range(6):
        monitor.push(step, {"v": jnp.float32(step)})
    assert [s for s, _ in monitor.pop_ready(5)] == [0, 1, 2]
    monitor.delta = 1
    assert [s for s, _ in monitor.pop_ready(5)] == [3, 4]
    with pytest.raises(ValueError):
        monitor.delta = -1


def test_steps_must_increase():
    monitor = Monitor()
    monitor.push(3, {})
    with pytest.raises(ValueError):
        monitor.push(3, {})


@jax.jit
def _slow_step(x):
    return jax.lax.fori_loop(0, 300, lambda i, y: jnp.tanh(y @ y), x)


def test_popping_old_steps_does_not_wait_for_the_newest():
    x = jnp.eye(512) * 0.5
    _slow_step(x).block_until_ready()  # compile outside the measurement
    monitor = Monitor(delta=2)
    monitor.push(0, {"loss": jnp.float32(0.0)})
    monitor.push(1, {"loss": jnp.float32(1.0)})
    newest = _slow_step(x)  # dispatched asynchronously, takes hundreds of milliseconds
    monitor.push(2, {"loss": newest[0, 0]})
    t0 = time.perf_counter()
    ready = monitor.pop_ready(2)
    elapsed = time.perf_counter() - t0
    assert [s for s, _ in ready] == [0]
    assert not newest.is_ready(), "pop_ready waited for the newest step"
    assert elapsed < 0.05
    assert [s for s, _ in monitor.drain()] == [1, 2]


def test_completion_times_are_the_steps_own_not_the_hosts_reads():
    # Two slow steps, the second on the first's output, read together long after both ended
    # (as at a checkpoint or the end of a run): their completion times are as far apart as the
    # second step took, and both come before the read.
    x = jnp.eye(512) * 0.5
    _slow_step(x).block_until_ready()  # compile outside the measurement
    monitor = Monitor(delta=2)
    t0 = time.perf_counter()
    first = _slow_step(x)
    monitor.push(0, {"loss": first[0, 0]})
    second = _slow_step(first)
    monitor.push(1, {"loss": second[0, 0]})
    second.block_until_ready()
    alone = time.perf_counter()
    _slow_step(first).block_until_ready()
    one_step = time.perf_counter() - alone
    time.sleep(0.2)
    read = time.perf_counter()
    assert [s for s, _ in monitor.drain()] == [0, 1]
    done = [monitor.completed_at(0), monitor.completed_at(1)]
    assert t0 < done[0] < done[1] < read
    assert done[1] - done[0] > 0.3 * one_step  # the reads were microseconds apart
    monitor.close()
    assert not monitor._watcher.is_alive()
