"""The single-program training and evaluation steps: one stage over the whole model.

The step is the pipeline's stage functions (`dynjax.parallel.stage`) on the one-stage spec
(`whole_model`: ``first`` and ``last``, every layer), run as one jitted program: a
``jax.lax.scan`` of the stage's backward over the microbatches, then its update. It is a pure
function ``(params, opt_state, batch) -> (params, opt_state, metrics)`` over plain pytrees, the
model's units merged inside so ``jax.jit`` caches on array shapes only (measured: ``jax.jit``
over split/merge is ~2x faster per call than ``nnx.jit`` on small models). Everything that
changes the compiled program (microbatches, dtype, frozen layers, the layers' records, the
shapes of their per-layer inputs) is a field of the spec, so a different Plan is a different
executable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from dynjax.model import ExpertParallel
from dynjax.model.hooks import NO_HOOKS, Hooks, LayerOptions
from dynjax.parallel.layout import select
from dynjax.parallel.metrics import fold_stacked
from dynjax.parallel.stage import (
    StageSetup,
    backward_fn,
    evaluate_fn,
    sqnorm_fn,
    update_fn,
)
from dynjax.parallel.stages import StageSpec, stage_specs
from dynjax.parallel.step_inputs import InputSignature


def whole_model(
    num_layers: int,
    *,
    batch_size: int,
    frozen_layers: Sequence[int] = (),
    microbatches: int = 1,
    dtype: str = "float32",
    options: Sequence[LayerOptions] = (),
    hooks: Hooks = NO_HOOKS,
    step_inputs: Sequence[InputSignature] = (),
    batch_inputs: Sequence[InputSignature] = (),
    remat: Sequence[str] = (),
) -> StageSpec:
    """The single program's spec: one stage holding every layer (`stages.stage_specs`)."""
    (spec,) = stage_specs(
        (num_layers,),
        frozen_layers=frozen_layers,
        microbatches=microbatches,
        batch_size=batch_size,
        dtype=dtype,
        options=options,
        hooks=hooks,
        step_inputs=step_inputs,
        batch_inputs=batch_inputs,
        remat=remat,
    )
    return spec


def _split_microbatches(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [m, B/m, ...] taking every m-th row, so each device keeps its share of each."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def make_train_step(setup: StageSetup, spec: StageSpec, parallel: ExpertParallel | None):
    """Build ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` (not jitted)
    for the one-stage ``spec`` (`whole_model`).

    ``batch`` holds ``inputs``/``targets`` [B, S], the batch inputs ``batch_inputs`` (each
    name [its layers, B, ...]) and the step inputs ``step_inputs`` (each name [its layers,
    ...]: runtime inputs, no recompile) the spec declares. Microbatch j takes rows j, j+M, ...
    of the batch; the gradients add up in float32. The metrics end with what the hook sets
    derive from them (`Hooks.derived`).
    """
    if not (spec.first and spec.last):
        raise ValueError("the single-program step runs one stage holding the whole model")
    bwd, sqnorm = backward_fn(setup, spec, parallel), sqnorm_fn(spec)
    update = update_fn(setup, spec)
    trainable_units = spec.trainable(setup.parts.learned_positions)

    def step(params, opt_state, batch: dict[str, Any]):
        inputs, targets = batch["inputs"], batch["targets"]
        batch_in = batch.get("batch_inputs") if spec.batch_inputs else None
        ctx = {"inputs": batch["step_inputs"]} if spec.step_inputs else {}
        acc = jax.tree.map(
            lambda p: jnp.zeros(p.shape, jnp.float32), select(params, trainable_units)
        )
        m = spec.microbatches
        if m == 1:
            acc, _, _, metrics = bwd(params, acc, {}, inputs, ctx, targets, batch_in)
            stacked = jax.tree.map(lambda a: a[None], metrics)
        else:
            xs = (
                _split_microbatches(inputs, m),
                _split_microbatches(targets, m),
                None
                if batch_in is None
                else {
                    k: jnp.swapaxes(jax.vmap(lambda c: _split_microbatches(c, m))(v), 0, 1)
                    for k, v in batch_in.items()
                },
            )

            def body(acc, x):
                acc, _, _, metrics = bwd(params, acc, {}, x[0], ctx, x[1], x[2])
                return acc, metrics

            acc, stacked = jax.lax.scan(body, acc, xs)
        folded = fold_stacked(stacked, setup.parts.cfg.hooks)
        params, opt_state, metrics = update(params, opt_state, acc, (sqnorm(acc),), folded)
        return params, opt_state, {**metrics, **setup.parts.cfg.hooks.derived(metrics, jnp)}

    return step


def make_eval_step(setup: StageSetup, spec: StageSpec, parallel: ExpertParallel | None):
    """``eval(params, batch) -> mean next-token loss`` of the one-stage ``spec``, the forward
    run as at inference (`StageSpec.inference`): the loss causal sampling would see."""
    spec = dataclasses.replace(spec, batch_inputs=(), inference=True)
    evaluate = evaluate_fn(setup, spec, parallel)

    def step(params, batch):
        ctx = {"inputs": batch["step_inputs"]} if spec.step_inputs else {}
        return evaluate(params, batch["inputs"], ctx, batch["targets"])

    return step
