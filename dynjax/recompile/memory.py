"""What a pipeline stage's layers need in memory, read from a profile (seed 000 §3.4).

DynMo balances and re-packs "subject to the memory capacity of each worker", measured in the
profiling step. A profile gives each stage's bytes per device, the part its kept stage inputs
take and the part its programs' temporaries take (`dynjax.parallel.profile`). The temporaries
are shared among the stage's layers in proportion to the activations each layer's forward keeps
for its backward (measured per layer with its rematerialisation policy, `model.remat`: a layer
that recomputes its forward takes a small share), the rest (parameters, optimizer state,
gradients) in proportion to their state bytes, so a layer's share moves with it. A stage of
another layout needs its layers' shares plus the stage inputs the schedule keeps at its place
(`peak_in_flight`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dynjax.balance import peak_in_flight, schedule_tasks, stage_costs
from dynjax.recompile.policy import Metrics

STAGE_MEMORY = "profile/stage_memory_bytes"  # [S] per-device bytes of each stage, measured
STAGE_INPUTS = "profile/stage_input_bytes"  # [S] of which: stage inputs kept for the backward
MICROBATCH_INPUT = "profile/microbatch_input_bytes"  # [S] one kept stage input
STAGE_TEMP = "profile/stage_temp_bytes"  # [S] of which: the largest program's temporaries
# [L] what each layer's forward keeps for its backward per microbatch (its remat policy's)
LAYER_ACTIVATIONS = "profile/layer_activation_bytes"


def layer_memory(
    metrics: Metrics, counts: Sequence[int], layer_state_bytes: np.ndarray
) -> np.ndarray:
    """[L] bytes per device each layer needs: its stage's measured bytes less the kept inputs,
    the program temporaries shared in proportion to the layers' kept activations and the rest
    in proportion to their state bytes (embedding in the first layer, head in the last)."""
    temp = np.asarray(metrics[STAGE_TEMP], np.float64)
    resident = (
        np.asarray(metrics[STAGE_MEMORY], np.float64)
        - np.asarray(metrics[STAGE_INPUTS], np.float64)
        - temp
    )
    stage = np.repeat(np.arange(len(counts)), counts)  # the stage of each layer
    activations = np.asarray(metrics[LAYER_ACTIVATIONS], np.float64)
    return (
        resident[stage] * _shares(np.asarray(layer_state_bytes, np.float64), counts)
        + temp[stage] * _shares(activations, counts)
    )


def _shares(weights: np.ndarray, counts: Sequence[int]) -> np.ndarray:
    """[L] each layer's fraction of its stage by ``weights`` (even where a stage's are 0)."""
    stage = np.repeat(np.arange(len(counts)), counts)
    totals = stage_costs(weights, counts)[stage]
    even = 1.0 / np.asarray(counts, np.float64)[stage]
    return np.divide(weights, totals, out=even, where=totals > 0)


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
