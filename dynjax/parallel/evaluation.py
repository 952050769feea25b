"""Validation loss of the pipeline's current parameters, as at inference."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import replace

import jax
import numpy as np
from jax.sharding import NamedSharding

from dynjax.parallel.stage_inputs import StageInputs
from dynjax.parallel.stage_state import StageState


def evaluate(
    stages: StageState,
    stage_inputs: StageInputs,
    batches: Iterable[tuple[np.ndarray, np.ndarray]],
) -> float | None:
    """Mean next-token loss over host ``(inputs, targets)`` batches (blocks for the result);
    None on a process without the last stage, or without batches.

    A batch runs in microbatches of the largest size that divides both it and the training
    microbatch: a full batch in the training microbatches, a smaller one (a short validation
    set) through stage programs compiled for its size. The programs run as at inference
    (`StageSpec.inference`), so the loss is the one causal sampling would see."""
    transport, programs = stages.transport, stages.programs
    losses = []
    readout = stage_inputs.send_readout(stages.spec)  # the parameters stay as they are
    for inputs, targets in batches:
        size = math.gcd(len(inputs), stages.spec.stages[0].microbatch_size)
        # Only a stage with plugin records can run differently at inference: the others
        # reuse their training forward programs instead of compiling copies.
        evaluated = [
            replace(stage, microbatch_size=size, inference=bool(stage.options))
            for stage in stages.spec.stages
        ]
        m_count, last = len(inputs) // size, evaluated[-1]
        batch = EvalBatch(inputs, targets)
        for m in range(m_count):
            x, carry = None, None
            if transport.is_local(0):
                x = batch.place("inputs", m, m_count, stage_inputs.rows(0))
            for stage in evaluated[:-1]:
                s, y, out_carry = stage.index, None, None
                if transport.is_local(s):
                    ctx = {**stage_inputs.context(stage, carry, batch, m, m_count), **(
                        {"readout": readout[s]} if s in readout else {})}
                    fwd = programs.get("fwd", replace(stage, batch_inputs=()))
                    y, out_carry, *_ = fwd(stages.state[s]["params"], x, ctx, None)
                after = programs.shapes(evaluated[s + 1])
                x = transport.send(y, s, s + 1, after.x)
                carry = transport.send_tree(
                    out_carry, s, s + 1, after.ctx.get("carry", {})
                ) or None
            if transport.is_local(last.index):
                loss = programs.get("eval", last)
                t = batch.place("targets", m, m_count, stage_inputs.rows(last.index))
                ctx = {} if carry is None else {"carry": carry}
                ctx.update(stage_inputs.step_inputs(last))
                losses.append(loss(stages.state[last.index]["params"], x, ctx, t))
    return float(np.mean(jax.device_get(losses))) if losses else None


@dataclasses.dataclass
class EvalBatch:
    """A validation batch, which every process holds whole (read once, at the start)."""

    inputs: np.ndarray
    targets: np.ndarray

    def place(self, field: str, m: int, m_count: int, sharding: NamedSharding) -> jax.Array:
        return jax.device_put(getattr(self, field)[m::m_count], sharding)
