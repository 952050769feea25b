"""A stage forward that keeps its VJP's residuals, and the backward that consumes them.

By default a pipeline stage's backward recomputes its forward from the stored stage input
(activation checkpointing at stage boundaries, `stage.backward_fn`): a stage keeps one input per
microbatch in flight, and every microbatch's layers run forward twice. With
``pipeline.recompute=False`` the forward program returns what ``jax.vjp`` keeps for the backward
(its *residuals*: the activations the backward reads) and the backward program runs the pullback
alone on them, Megatron-LM's pipeline without recomputation: a backward task costs its backward
only, a stage's forward and backward compile to what the single program's step holds, and a
stage keeps every layer's residuals for each microbatch in flight instead of one input.

The residuals cross from one jitted program to the other as a flat tuple of arrays. ``jax.vjp``
returns a pytree (its leaves the residuals, its structure the linearised program), so the forward
flattens it and the backward rebuilds it from the `ResidualLayout` its forward was traced with.
Leaves that are the forward's own inputs (the parameters, the stage input, the context) are not
returned: the backward has them and takes them from its arguments, so no parameter is copied per
microbatch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dynjax.model import ExpertParallel
from dynjax.parallel.mesh import TOKEN_AXES, expert_parallel
from dynjax.parallel.stage import StageSetup, stage_vjp
from dynjax.parallel.stages import StageSpec


@dataclasses.dataclass(frozen=True, eq=False)
class ResidualLayout:
    """How a stage forward's VJP flattens: its structure and, per leaf, the index of the
    forward input leaf it is (of ``(params, x, ctx, batch_in)``), or None for a returned
    residual."""

    treedef: Any
    sources: tuple[int | None, ...]


def keeps_residuals(setup: StageSetup, spec: StageSpec) -> bool:
    """Whether ``spec``'s forward keeps residuals for its backward: ``recompute`` off, a stage
    with a backward and a forward program (the last stage runs both in its backward)."""
    return not setup.recompute and spec.has_backward and not spec.last


def residual_forward_fn(
    setup: StageSetup,
    spec: StageSpec,
    parallel: ExpertParallel | None,
    traced: list[ResidualLayout] | None = None,
):
    """``fwd(params, x, ctx, batch_in) -> (y, carry, metrics, residuals)``; each trace appends
    its `ResidualLayout` to ``traced``."""

    def fwd(params, x, ctx, batch_in):
        (y, _), vjp, (metrics, carry) = stage_vjp(setup, spec, parallel, params, x, ctx, batch_in)
        leaves, treedef = jax.tree.flatten(vjp)
        index = {id(a): i for i, a in enumerate(jax.tree.leaves((params, x, ctx, batch_in)))}
        sources = tuple(index.get(id(leaf)) for leaf in leaves)
        if traced is not None:
            traced.append(ResidualLayout(treedef, sources))
        residuals = tuple(leaf for leaf, src in zip(leaves, sources, strict=True) if src is None)
        return y, carry, metrics, residuals

    return fwd


def residual_gradients_fn(layout: ResidualLayout):
    """``grads(params, x, ctx, residuals, seed, batch_in) -> (gradients, None)``: the pullback
    of `residual_forward_fn`'s VJP (traced as ``layout``) on the next stage's input gradient
    ``seed``, before accumulating (no metrics: not the last stage)."""

    def grads(params, x, ctx, residuals, seed, batch_in):
        inputs = jax.tree.leaves((params, x, ctx, batch_in))
        stored = iter(residuals)
        leaves = [next(stored) if src is None else inputs[src] for src in layout.sources]
        vjp = jax.tree.unflatten(layout.treedef, leaves)
        return vjp((seed, jnp.ones((), jnp.float32))), None

    return grads


def kept_bytes(setup: StageSetup, spec: StageSpec, mesh: Mesh, shapes: Any) -> int:
    """Per-device bytes of the activations one microbatch's forward of ``spec`` keeps for its
    backward (its VJP's residuals, with the stage input where the backward reads it), under its
    layers' rematerialisation policies; 0 for a stage without a backward. ``shapes``: its
    `StageShapes`. Traced, never compiled: what a profile weighs a layer's share of its stage's
    program temporaries by (`dynjax.recompile.memory.layer_memory`), whether the forward
    returns them (``recompute`` off) or the backward program recomputes and holds them (on)."""
    if not spec.has_backward:
        return 0
    traced: list[ResidualLayout] = []
    fwd = residual_forward_fn(setup, spec, expert_parallel(mesh), traced)
    outs = jax.eval_shape(fwd, shapes.params, shapes.x, shapes.ctx, shapes.batch_in)
    kept = list(residual_shapes(outs[3], mesh, spec.microbatch_size))
    if len(jax.tree.leaves(shapes.params)) in traced[0].sources:  # the leaf of x
        kept.append(shapes.x)
    return sum(a.size * a.dtype.itemsize // a.sharding.num_devices for a in kept)


def residual_shapes(
    residuals: tuple[jax.ShapeDtypeStruct, ...], mesh: Mesh, rows: int
) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The residuals with the shardings the forward returns them in: split over the stage's
    token axes where the leading axis is a multiple of the microbatch's ``rows`` (activations,
    and tokens flattened row-major), replicated otherwise (what the forward derived from
    replicated parameters)."""

    def placed(a: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        split = a.ndim > 0 and a.shape[0] >= rows and a.shape[0] % rows == 0
        sharding = NamedSharding(mesh, P(TOKEN_AXES) if split else P())
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    return tuple(placed(a) for a in residuals)
