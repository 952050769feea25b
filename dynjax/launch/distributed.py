"""The processes of one run: `jax.distributed` set-up from the environment and host exchanges.

A launcher starts every process of a run: ``dynjax.launch.local`` with ``DYNJAX_COORDINATOR``
(host:port of process 0), ``DYNJAX_NUM_PROCESSES``, ``DYNJAX_PROCESS_ID`` and, on CPU,
``DYNJAX_LOCAL_DEVICES``; SLURM and Kubernetes with their own variables
(`dynjax.launch.cluster`). ``dynjax.train`` calls `initialize_from_env` before JAX starts.

Each process holds the metrics of its own pipeline stages only, but every process must log and
decide from the same numbers, so host values are exchanged through the coordinator's key-value
store: host to host, never through a device collective that would wait for the steps still
queued on the devices. The same store carries the processes' heartbeats
(`dynjax.launch.watchdog`), so that a process that dies stops the others within
``DYNJAX_HEARTBEAT_SECONDS``. That store is reached through JAX's private distributed client;
this module is the one place that touches it (STYLE.md habit 7).
"""

from __future__ import annotations

import atexit
import inspect
import math
import os
import pickle
from typing import Any, NoReturn

import jax

from dynjax.launch.cluster import heartbeat_seconds, process_env
from dynjax.launch.watchdog import Watchdog
from jax_private import distributed_client

TIMEOUT_MS = 600_000
# JAX's own heartbeat timeout, in units of the watchdog's: the backstop if the watchdog's thread
# cannot run. It must be the later of the two: JAX aborts with a log line, not dynjax's error.
JAX_HEARTBEAT_FACTOR = 3

_watchdog: Watchdog | None = None


def initialize_from_env() -> bool:
    """Join the run's processes if a launcher set the environment; True if it did. Raises
    `ClusterError` (naming the variable) when the environment contradicts itself."""
    found = process_env(os.environ)
    if found is None:
        return False
    timeout = heartbeat_seconds(os.environ)
    local = os.environ.get("DYNJAX_LOCAL_DEVICES")
    if local:
        jax.config.update("jax_num_cpu_devices", int(local))
    options = {}
    if "heartbeat_timeout_seconds" in inspect.signature(jax.distributed.initialize).parameters:
        options["heartbeat_timeout_seconds"] = math.ceil(JAX_HEARTBEAT_FACTOR * timeout)
    jax.distributed.initialize(
        coordinator_address=found.coordinator,
        num_processes=found.num_processes,
        process_id=found.process_id,
        **options,
    )
    global _watchdog
    _watchdog = Watchdog(distributed_client(), found.process_id, found.num_processes, timeout)
    _watchdog.start()
    # Registered after JAX's own exit handler, so it runs first: the peers learn that this
    # process finished before it waits for them in JAX's shutdown barrier.
    atexit.register(_watchdog.finish)
    return True


def fail() -> NoReturn:
    """Leave a multi-process run after an error in this process, without waiting for the others
    in JAX's shutdown barrier (they may be waiting in a collective for this process): the others
    stop with an error naming this process, or this one names a peer that died first."""
    assert _watchdog is not None, "fail() is for a process that joined a multi-process run"
    _watchdog.fail()


def joined() -> bool:
    """Whether this process joined a multi-process run (`initialize_from_env`)."""
    return _watchdog is not None


def publish(key: str, value: Any) -> None:
    """Store this process's ``value`` for ``key`` (a name all processes use once)."""
    if jax.process_count() > 1:
        distributed_client().key_value_set_bytes(
            f"dynjax/{key}/{jax.process_index()}", pickle.dumps(value)
        )


def collect(key: str) -> list[Any]:
    """Every process's value for ``key``, by process index. Blocks until every process has
    published its value; values stay in the store until each process `forget`s its own."""
    return [_read(key, p) for p in range(jax.process_count())]


def exchange(key: str, value: Any) -> list[Any]:
    """`publish` this process's ``value`` for ``key`` and `collect` the others' (its own is not
    read back)."""
    if jax.process_count() == 1:
        return [value]
    publish(key, value)
    me = jax.process_index()
    return [value if p == me else _read(key, p) for p in range(jax.process_count())]


def _read(key: str, process: int) -> Any:
    return pickle.loads(
        distributed_client().blocking_key_value_get_bytes(f"dynjax/{key}/{process}", TIMEOUT_MS)
    )


def forget(key: str) -> None:
    """Delete this process's value of an exchange every process has read."""
    if jax.process_count() > 1:
        distributed_client().key_value_delete(f"dynjax/{key}/{jax.process_index()}")


class Peers:
    """The run's processes as the Controller agrees on swaps with them and the pipeline gathers
    its profiles (`dynjax.parallel.peers.Peers`)."""

    def __init__(self) -> None:
        self.index, self.count = jax.process_index(), jax.process_count()

    def publish(self, key: str, value: Any) -> None:
        publish(key, value)

    def collect(self, key: str) -> list[Any]:
        return collect(key)

    def forget(self, key: str) -> None:
        forget(key)
