"""The jitted programs of one pipeline stage: forward, backward, gradient norm, update, eval.

Each program is one function of `dynjax.parallel.stage` (the single-program step's too),
compiled per stage on the stage's own (data, expert) sub-mesh: data parallel over ``'data'``
and expert parallel over ``'expert'`` exactly as the single-program step. The schedule runs the
microbatch loop (`dynjax.parallel.step_run`):

* ``fwd(params, x, ctx, batch_in) -> (y, carry, metrics, [kept | residuals])``:
  `stage.forward_loss` on one microbatch; ``kept``, the output of a frozen prefix
  (`stage.frozen_prefix`), where the stage has one; ``residuals``, what its backward reads,
  with ``pipeline.recompute`` off (`dynjax.parallel.residuals`). The last stage has no forward
  program: its forward output only feeds its own backward.
* ``bwd(params, acc, racc, x, ctx, stored, seed, batch_in) -> (acc, g_x, racc, [metrics])``:
  `stage.backward_fn`, recomputing the forward from the stored stage input (activation
  checkpointing at stage boundaries: a stage keeps one input per microbatch in flight, not
  every intermediate), or from ``kept`` past a frozen prefix (``stored``: ``()``); with
  ``recompute`` off, the pullback on the forward's residuals alone (``stored``: them).
* ``bwd_b(params, x, ctx, stored, seed, batch_in) -> (g_x, boundary, [metrics])`` and
  ``bwd_w(params, acc, racc, kept, boundary) -> (acc, done, racc)``: under ZB-H1
  (``pipeline.schedule="zb_h1"``), that backward cut in two (`dynjax.parallel.split_backward`);
  ``kept``, what W
  reads of a microbatch's inputs. A stage that passes no gradient back and is not the last has
  no ``bwd_b``.
* ``sqnorm(acc) -> [1]``: this stage's squared gradient norm; `Transport.gather` brings every
  stage's to every stage.
* ``update(params, opt_state, acc, sq_norms, metrics) -> (params, opt_state, zeros, metrics)``:
  `stage.update_fn`'s update on the metrics folded over the microbatches, returning a zeroed
  accumulator, run as one small program per signature of a group of layers
  (`dynjax.parallel.stage_update`, lowered by `PipelinePrograms`, not here).
* ``eval(params, x, ctx, targets) -> loss`` (last stage only).

``ctx`` is `dynjax.parallel.stage`'s (its module docstring); ``readout`` is sent once per
step, and the readout gradient a stage before the last accumulates in ``racc`` is sent to the
last stage before the gradient norm (`add_readout_grads`), so the shared head gets the
single-program gradient with no replica of its parameters or optimizer state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dynjax.parallel.layout import select
from dynjax.parallel.mesh import TOKEN_AXES, expert_parallel, param_shardings
from dynjax.parallel.residuals import (
    ResidualLayout,
    keeps_residuals,
    residual_forward_fn,
    residual_gradients_fn,
    residual_shapes,
)
from dynjax.parallel.split_backward import (
    StageSplit,
    input_grad_fn,
    split_stage,
    weight_grad_fn,
)
from dynjax.parallel.stage import (
    DTYPES,
    READOUT_UNITS,
    Metrics,
    StageSetup,
    accumulate,
    backward_fn,
    evaluate_fn,
    forward_loss,
    frozen_prefix,
    gradients_fn,
    sqnorm_fn,
)
from dynjax.parallel.stages import StageSpec


def forward_fn(
    setup: StageSetup, spec: StageSpec, mesh: Mesh, traced: list[ResidualLayout] | None = None
):
    parallel = expert_parallel(mesh)
    if keeps_residuals(setup, spec):
        return residual_forward_fn(setup, spec, parallel, traced)
    keep = frozen_prefix(setup, spec)

    def fwd(params, x, ctx, batch_in):
        y, carry, _, metrics, kept = forward_loss(
            setup, spec, parallel, params, x, ctx, batch_in, keep=keep
        )
        return (y, carry, metrics) + ((kept,) if keep else ())

    return fwd


def add_readout_grads(acc: Any, racc: Any) -> Any:
    """The last stage's accumulator with a readout gradient accumulated by an earlier stage
    added to its norm and head entries (the shared readout's gradient, module docstring)."""
    return {**acc, **{k: jax.tree.map(jnp.add, acc[k], racc[k]) for k in racc}}


@dataclasses.dataclass(frozen=True)
class StageShapes:
    """Abstract inputs of one stage's programs (shapes, dtypes, shardings on its sub-mesh)."""

    params: Any
    opt_state: Any
    acc: Any
    x: jax.ShapeDtypeStruct  # the stage input: tokens on the first stage, activations after
    # What the backward recomputes from: ``x``, or a frozen prefix's output (`frozen_prefix`).
    kept: jax.ShapeDtypeStruct
    y: jax.ShapeDtypeStruct | None  # the stage output (None on the last stage)
    ctx: dict[str, Any]  # what the stage's wrappers read beside x (module docstring)
    carry: dict[str, jax.ShapeDtypeStruct]  # the carry the stage outputs (empty on the last)
    racc: dict[str, Any]  # the readout-gradient accumulator (empty unless needs_readout)
    # What the forward keeps for the backward with ``recompute`` off (else empty), and how its
    # VJP flattens (`dynjax.parallel.residuals`).
    residuals: tuple[jax.ShapeDtypeStruct, ...]
    residual_layout: ResidualLayout | None
    targets: jax.ShapeDtypeStruct
    batch_in: dict[str, jax.ShapeDtypeStruct] | None  # the batch inputs of a microbatch
    metrics: Metrics  # of one microbatch


def stage_shapes(
    setup: StageSetup, spec: StageSpec, mesh: Mesh, full_params: Any, seq_len: int
) -> StageShapes:
    """Abstract state and inputs of ``spec`` on ``mesh`` (full_params: abstract, no sharding)."""
    cfg = setup.parts.cfg
    with_sharding = lambda tree: jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        tree,
        param_shardings(tree, mesh, fsdp=setup.fsdp),
    )
    params = with_sharding(select(full_params, spec.units(setup.parts.learned_positions)))
    opt_state = with_sharding(jax.eval_shape(setup.optimizer.init, params))
    acc = select(params, spec.trainable(setup.parts.learned_positions))
    rows = NamedSharding(mesh, P(TOKEN_AXES))
    b, dtype = spec.microbatch_size, DTYPES[spec.dtype]
    tokens = jax.ShapeDtypeStruct((b, seq_len), jnp.int32, sharding=rows)
    acts = jax.ShapeDtypeStruct((b, seq_len, cfg.d_model), dtype, sharding=rows)
    batch_in = {
        sig.name: jax.ShapeDtypeStruct(
            (len(sig.layers), b, *sig.shape),
            sig.dtype,
            sharding=NamedSharding(mesh, P(None, TOKEN_AXES)),
        )
        for sig in spec.batch_inputs
    } or None
    x = tokens if spec.first else acts
    carry = {
        k: jax.ShapeDtypeStruct((b, seq_len), d, sharding=rows)
        for k, d in setup.parts.cfg.hooks.carry_dtypes(spec.carry).items()
    }
    ctx: dict[str, Any] = {} if spec.first or not carry else {"carry": carry}
    replicated = NamedSharding(mesh, P())
    if spec.step_inputs:
        ctx["inputs"] = {
            sig.name: jax.ShapeDtypeStruct(
                (len(sig.layers), *sig.shape), sig.dtype, sharding=replicated
            )
            for sig in spec.step_inputs
        }
    if spec.needs_targets:
        ctx["targets"] = tokens
    racc: dict[str, Any] = {}
    if spec.needs_readout:
        ctx["readout"] = with_sharding(select(full_params, READOUT_UNITS))
        racc = ctx["readout"]
    kept, residuals, traced = x, (), []
    if spec.last:
        fn = backward_fn(setup, spec, expert_parallel(mesh))
        metrics = jax.eval_shape(fn, params, acc, racc, x, ctx, tokens, batch_in)[3]
    else:
        outs = jax.eval_shape(forward_fn(setup, spec, mesh, traced), params, x, ctx, batch_in)
        metrics = outs[2]
        if frozen_prefix(setup, spec):
            kept = jax.ShapeDtypeStruct(outs[3].shape, outs[3].dtype, sharding=rows)
        if keeps_residuals(setup, spec):
            residuals = residual_shapes(outs[3], mesh, b)
    metrics = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), metrics
    )
    return StageShapes(
        params=params,
        opt_state=opt_state,
        acc=acc,
        x=x,
        kept=kept,
        y=None if spec.last else acts,
        ctx=ctx,
        carry={} if spec.last else carry,
        racc=racc,
        residuals=residuals,
        residual_layout=traced[0] if keeps_residuals(setup, spec) else None,
        targets=tokens,
        batch_in=batch_in,
        metrics=metrics,
    )


def stage_gradients(setup: StageSetup, spec: StageSpec, mesh: Mesh, shapes: StageShapes):
    """``grads(params, x, ctx, stored, seed, batch_in) -> (gradients, metrics)``: the stage's
    backward before accumulating, on its forward's residuals with ``recompute`` off
    (``stored``: them, `residuals`), else recomputing its forward (``stored``: ``()``)."""
    if keeps_residuals(setup, spec):
        return residual_gradients_fn(shapes.residual_layout)
    recomputing = gradients_fn(setup, spec, expert_parallel(mesh))
    return lambda p, x, ctx, _, seed, b: recomputing(p, x, ctx, seed, b)  # noqa: E731


def pipeline_backward_fn(spec: StageSpec, gradients):
    """``bwd(params, acc, racc, x, ctx, stored, seed, batch_in) -> (acc, g_x, racc,
    [metrics])``: ``gradients`` (`stage_gradients`) accumulated as `stage.backward_fn` does."""

    def bwd(params, acc, racc, x, ctx, stored, seed, batch_in):
        grads, metrics = gradients(params, x, ctx, stored, seed, batch_in)
        acc, g_x, racc = accumulate(spec, acc, racc, grads)
        return (acc, g_x, racc) + ((metrics,) if spec.last else ())

    return bwd


def stage_split(
    setup: StageSetup, spec: StageSpec, mesh: Mesh, shapes: StageShapes
) -> StageSplit:
    """The stage's backward (`stage_gradients`) cut into ``B`` and ``W``
    (`split_backward.split_stage`)."""
    return split_stage(spec, stage_gradients(setup, spec, mesh, shapes), _microbatch(spec, shapes),
                       mesh)


def _microbatch(spec: StageSpec, shapes: StageShapes) -> tuple:
    """The abstract ``(params, x, ctx, stored, seed, batch_in)`` a backward takes."""
    seed = shapes.targets if spec.last else shapes.y
    return (shapes.params, shapes.kept, shapes.ctx, shapes.residuals, seed, shapes.batch_in)


def lower_stage(
    kind: str,
    setup: StageSetup,
    spec: StageSpec,
    mesh: Mesh,
    shapes: StageShapes,
    split: StageSplit | None = None,
) -> jax.stages.Lowered:
    """Trace and lower one program of a stage from abstract values (``split``: the stage's
    `stage_split`, for ``bwd_b`` and ``bwd_w``)."""
    sharding = lambda tree: jax.tree.map(lambda a: a.sharding, tree)
    replicated = NamedSharding(mesh, P())
    metrics = sharding(shapes.metrics)
    params, *microbatch = _microbatch(spec, shapes)
    g_x = shapes.x.sharding if spec.input_grads else replicated
    if kind in ("bwd_b", "bwd_w"):
        if split is None:
            raise ValueError(f"stage program {kind!r} needs the stage's split backward")
        if kind == "bwd_b":
            outs = (g_x, sharding(split.boundary)) + ((metrics,) if spec.last else ())
            jitted = jax.jit(input_grad_fn(spec, split), out_shardings=outs)
            return jitted.lower(params, *microbatch)
        outs = (sharding(shapes.acc), replicated, sharding(shapes.racc))
        jitted = jax.jit(weight_grad_fn(split), out_shardings=outs, donate_argnums=(1, 2))
        kept = split.kept_for_w(tuple(microbatch))
        return jitted.lower(params, shapes.acc, shapes.racc, kept, split.boundary)
    if kind == "fwd":
        outs = (shapes.y.sharding, sharding(shapes.carry), metrics)
        outs += (shapes.kept.sharding,) if frozen_prefix(setup, spec) else ()
        residuals = keeps_residuals(setup, spec)
        outs += (sharding(shapes.residuals),) if residuals else ()
        traced: list[ResidualLayout] = []
        jitted = jax.jit(forward_fn(setup, spec, mesh, traced), out_shardings=outs)
        lowered = jitted.lower(shapes.params, shapes.x, shapes.ctx, shapes.batch_in)
        if residuals and traced[0].sources != shapes.residual_layout.sources:
            raise RuntimeError(  # the backward is lowered with the layout `stage_shapes` traced
                f"stage {spec.index}: its forward's VJP flattened differently in two traces"
            )
        return lowered
    if kind == "bwd":
        outs = (sharding(shapes.acc), g_x, sharding(shapes.racc))
        outs += (metrics,) if spec.last else ()
        bwd = pipeline_backward_fn(spec, stage_gradients(setup, spec, mesh, shapes))
        jitted = jax.jit(bwd, out_shardings=outs, donate_argnums=(1, 2))
        return jitted.lower(params, shapes.acc, shapes.racc, *microbatch)
    if kind == "sqnorm":
        return jax.jit(sqnorm_fn(spec), out_shardings=replicated).lower(shapes.acc)
    if kind == "eval":
        jitted = jax.jit(evaluate_fn(setup, spec, expert_parallel(mesh)), out_shardings=replicated)
        return jitted.lower(shapes.params, shapes.x, shapes.ctx, shapes.targets)
    raise ValueError(f"unknown stage program {kind!r}")
