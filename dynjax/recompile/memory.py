"""What a pipeline stage's layers need in memory, read from a profile (seed 000 §3.4).

DynMo balances and re-packs "subject to the memory capacity of each worker", measured in the
profiling step. A profile gives each stage's bytes per device and the part its kept stage inputs
take (`dynjax.parallel.profile`); the rest is shared among the stage's layers in proportion to
their state bytes, so a layer's share moves with it. A stage of another layout needs its layers'
shares plus the stage inputs the schedule keeps at its place (`peak_in_flight`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dynjax.balance import peak_in_flight, schedule_tasks, stage_costs
from dynjax.recompile.policy import Metrics

STAGE_MEMORY = "profile/stage_memory_bytes"  # [S] per-device bytes of each stage, measured
STAGE_INPUTS = "profile/stage_input_bytes"  # [S] of which: stage inputs kept for the backward
MICROBATCH_INPUT = "profile/microbatch_input_bytes"  # [S] one kept stage input


def layer_memory(
    metrics: Metrics, counts: Sequence[int], layer_state_bytes: np.ndarray
) -> np.ndarray:
    """[L] bytes per device each layer needs: its stage's measured bytes less the kept inputs,
    shared in proportion to the layers' state bytes (embedding in the first layer, head in the
    last)."""
    resident = np.asarray(metrics[STAGE_MEMORY], np.float64) - np.asarray(
        metrics[STAGE_INPUTS], np.float64
    )
    stage = np.repeat(np.arange(len(counts)), counts)  # the stage of each layer
    totals = stage_costs(layer_state_bytes, counts)[stage]
    even = 1.0 / np.asarray(counts, np.float64)[stage]  # a stage whose layers hold nothing
    share = np.divide(layer_state_bytes, totals, out=even, where=totals > 0)
    return resident[stage] * share


def stage_capacities(
    memory_bytes: float,
    metrics: Metrics,
    schedule: str,
    stages: int,
    microbatches: int,
    virtual_stages: int = 1,
) -> np.ndarray:
    """[stages] bytes per device left for layers on each stage of a ``stages``-stage layout:
    ``memory_bytes`` less the stage inputs the schedule keeps there (the largest measured input
    per microbatch, so the first stage's token inputs are over-counted: the safe side). With
    ``virtual_stages`` v the stages are logical: a device's v chunks share what its schedule
    leaves, an equal part each."""
    activation = float(np.max(metrics[MICROBATCH_INPUT]))
    devices = stages // virtual_stages
    tasks = schedule_tasks(schedule, devices, microbatches, virtual_stages)
    kept = np.array([peak_in_flight(t) for t in tasks], dtype=np.float64)
    per_device = (memory_bytes - activation * kept) / virtual_stages
    return np.tile(per_device, virtual_stages)  # logical stage c * devices + d
