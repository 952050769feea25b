"""The single-program training and evaluation steps: one stage over the whole model.

The step is the pipeline's stage functions (`dynjax.parallel.stage`) on the one-stage spec
(`whole_model`: ``first`` and ``last``, every layer), run as one jitted program: a
``jax.lax.scan`` of the stage's backward over the microbatches, then its update. It is a pure
function ``(params, opt_state, batch) -> (params, opt_state, metrics)`` over plain pytrees, the
model's units merged inside so ``jax.jit`` caches on array shapes only (measured: ``jax.jit``
over split/merge is ~2x faster per call than ``nnx.jit`` on small models). Everything that
changes the compiled program (capacities, cached routing, microbatches, dtype, frozen layers,
the layers' records) is a field of the spec, so a different Plan is a different executable.
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
from dynjax.parallel.metrics import fold_stacked, moe_totals
from dynjax.parallel.stage import (
    StageSetup,
    backward_fn,
    evaluate_fn,
    sqnorm_fn,
    update_fn,
)
from dynjax.parallel.stages import StageSpec, stage_specs


def whole_model(
    num_layers: int,
    *,
    batch_size: int,
    moe_layers: Sequence[int] = (),
    capacities: Sequence[Sequence[int]] = (),
    frozen_layers: Sequence[int] = (),
    microbatches: int = 1,
    cached_routing: bool = False,
    dtype: str = "float32",
    options: Sequence[LayerOptions] = (),
    ragged_totals: Sequence[int] = (),
    hooks: Hooks = NO_HOOKS,
) -> StageSpec:
    """The single program's spec: one stage holding every layer (`stages.stage_specs`)."""
    (spec,) = stage_specs(
        (num_layers,),
        moe_layers=moe_layers,
        capacities=capacities,
        frozen_layers=frozen_layers,
        microbatches=microbatches,
        batch_size=batch_size,
        cached_routing=cached_routing,
        dtype=dtype,
        options=options,
        ragged_totals=ragged_totals,
        hooks=hooks,
    )
    return spec


def _split_microbatches(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [m, B/m, ...] taking every m-th row, so each device keeps its share of each."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def make_train_step(setup: StageSetup, spec: StageSpec, parallel: ExpertParallel | None):
    """Build ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` (not jitted)
    for the one-stage ``spec`` (`whole_model`).

    ``batch`` holds ``inputs``/``targets`` [B, S], with cached routing ``cached`` [L, B, S, k],
    on the ragged MoE path ``capacities`` [L, E] int32 (a runtime input: no recompile).
    Microbatch j takes rows j, j+M, ... of the batch; the gradients add up in float32.
    """
    if not (spec.first and spec.last):
        raise ValueError("the single-program step runs one stage holding the whole model")
    bwd, sqnorm = backward_fn(setup, spec, parallel), sqnorm_fn(spec)
    update = update_fn(setup, spec)
    trainable_units = spec.trainable(setup.parts.learned_positions)

    def step(params, opt_state, batch: dict[str, Any]):
        inputs, targets = batch["inputs"], batch["targets"]
        cached = batch.get("cached") if spec.cached_routing else None
        ctx = {"capacities": batch["capacities"]} if spec.ragged_totals else {}
        acc = jax.tree.map(
            lambda p: jnp.zeros(p.shape, jnp.float32), select(params, trainable_units)
        )
        m = spec.microbatches
        if m == 1:
            acc, _, _, metrics = bwd(params, acc, {}, inputs, ctx, targets, cached)
            stacked = jax.tree.map(lambda a: a[None], metrics)
        else:
            xs = (
                _split_microbatches(inputs, m),
                _split_microbatches(targets, m),
                None
                if cached is None
                else jnp.swapaxes(jax.vmap(lambda c: _split_microbatches(c, m))(cached), 0, 1),
            )

            def body(acc, x):
                acc, _, _, metrics = bwd(params, acc, {}, x[0], ctx, x[1], x[2])
                return acc, metrics

            acc, stacked = jax.lax.scan(body, acc, xs)
        folded = fold_stacked(stacked, setup.parts.cfg.hooks)
        params, opt_state, metrics = update(params, opt_state, acc, (sqnorm(acc),), folded)
        return params, opt_state, {**metrics, **moe_totals(metrics)}

    return step


def make_eval_step(setup: StageSetup, spec: StageSpec, parallel: ExpertParallel | None):
    """``eval(params, batch) -> mean next-token loss`` of the one-stage ``spec``, the forward
    run as at inference (`StageSpec.inference`): the loss causal sampling would see."""
    spec = dataclasses.replace(spec, cached_routing=False, inference=True)
    evaluate = evaluate_fn(setup, spec, parallel)

    def step(params, batch):
        ctx = {"capacities": batch["capacities"]} if spec.ragged_totals else {}
        return evaluate(params, batch["inputs"], ctx, batch["targets"])

    return step
