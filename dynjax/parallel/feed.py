"""Which rows of the global batch a process's devices consume, and placing only those.

A *placement* puts rows ``rows`` of the global batch (in that order: all B for the single
program's step, rows ``m::M`` for microbatch m of a pipeline stage) on a sharding. A process
reads the union of the rows its own devices hold under the placements of its runtime
(`process_rows`), and builds each global array from its shards alone (`place_rows`), so no
process reads or transfers samples that only other processes' devices use (issue 15 §5).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import jax
import numpy as np
from jax.sharding import Sharding

Placement = tuple[Sharding, np.ndarray]  # (sharding, the global batch rows placed, in order)


def local_devices() -> frozenset[jax.Device]:
    """This process's devices."""
    return frozenset(jax.local_devices())


def process_rows(
    placements: Iterable[Placement], seq_len: int, devices: Collection[jax.Device]
) -> np.ndarray:
    """Ascending global batch rows that ``devices`` (one process's) hold under ``placements`` of
    [rows, seq_len] token arrays; a pure function of the shardings, so a test can ask it for
    any split of the devices into processes."""
    held = [
        rows[index[0]]
        for sharding, rows in placements
        for device, index in sharding.devices_indices_map((len(rows), seq_len)).items()
        if device in devices
    ]
    return np.unique(np.concatenate(held)) if held else np.empty(0, np.int64)


def place_rows(
    values: np.ndarray, held: np.ndarray, rows: np.ndarray, sharding: Sharding
) -> jax.Array:
    """The global [len(rows), ...] array of global batch ``rows`` on ``sharding``, built from
    this process's ``values`` (its rows ``held``, ascending) alone: `make_array_from_callback`
    asks only for the shards of addressable devices."""
    shape = (len(rows), *values.shape[1:])
    return jax.make_array_from_callback(
        shape, sharding, lambda index: shard(values, held, rows, index)
    )


def place_microbatches(
    values: np.ndarray, held: np.ndarray, size: int, count: int, sharding: Sharding
) -> list[jax.Array]:
    """Every microbatch (rows ``m::count`` of a batch of ``size``) of this process's ``values``
    (its rows ``held``) on ``sharding``, a sharding of this process's devices alone (a pipeline
    stage's). One transfer call for all: on CPU a call costs about 0.2 ms of host time whatever
    its size (issue 15 §7)."""
    rows = [np.arange(size)[m::count] for m in range(count)]
    return list(jax.device_put([values[positions(held, r)] for r in rows], [sharding] * count))


def shard(values: np.ndarray, held: np.ndarray, rows: np.ndarray, index: tuple) -> np.ndarray:
    """The ``index`` (a device's slices of the [len(rows), ...] array) of global batch ``rows``,
    from a process's ``values`` of its rows ``held``."""
    return values[positions(held, rows[index[0]])][:, *index[1:]]


def positions(held: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Where global batch ``rows`` are among a process's ``held`` rows; refuses rows not read."""
    at = np.searchsorted(held, rows)
    ok = at < len(held)
    ok[ok] = held[at[ok]] == rows[ok]
    if not ok.all():
        raise ValueError(
            f"rows {rows[~ok][:8].tolist()} of the batch were not read by this process: build "
            "the batch with the rows its runtime consumes (`batch_rows`)"
        )
    return at
