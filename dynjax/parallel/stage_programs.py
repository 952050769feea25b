"""The jitted programs of one pipeline stage: forward, backward, gradient norm, update, eval.

Each program runs on its stage's own (data, expert) sub-mesh: data parallel over ``'data'`` and
expert parallel over ``'expert'`` exactly as the single-program step (`dynjax.parallel.step`).

* ``fwd(params, x, ctx, cached) -> (y, carry, metrics)``: the stage's layers on one
  microbatch. The last stage has no forward program: its forward output only feeds its own
  backward.
* ``bwd(params, acc, racc, x, ctx, seed, cached) -> (acc, g_x, racc, [metrics])``: recomputes
  the stage forward from the stored stage input (activation checkpointing at stage boundaries:
  a stage keeps one input per microbatch in flight, not every intermediate), then adds the
  weight gradients of the trainable layers to the accumulator ``acc`` and returns the input
  gradient if an earlier stage needs it (else a scalar to wait on). The last stage seeds it
  with the loss; the others with the next stage's input gradient. MoE auxiliary losses of the
  stage enter here, so every stage's aux and z losses count, as in the single-program loss.
* ``sqnorm(acc) -> [1]``: this stage's squared gradient norm; `Transport.gather` brings every
  stage's to every stage.
* ``update(params, opt_state, acc, sq_norms, metrics) -> (params, opt_state, zeros, metrics)``:
  clips with the *global* norm (the sum of all stages' squared norms, in stage order, so every
  stage computes the same factor), applies the optimizer to the trainable units only (frozen
  units keep their parameters and optimizer state), folds the microbatch metrics, and runs
  the state rules of its trainable layers on them (`HookSet.state_rule`).
* ``eval(params, x, ctx, targets) -> loss`` (last stage only).

``ctx`` holds what the stage's block wrappers read of the `LayerContext` beyond activations
(`HookSet` ``needs`` and ``carry``), only what they need, and on the ragged
MoE path ``capacities``, the stage's MoE layers' per-expert capacities [len(spec.moe), E] int32
(a runtime input like the single-program step's, issue 12 §1): ``carry``, the
per-token arrays the previous stage's layers left (a stage input and output beside the
activations, stored with the input for the backward, never differentiated); ``targets``; and
``readout``, the last stage's norm and head parameters, sent once per step. A stage before
the last that reads the readout differentiates its loss terms through those parameters too
and adds that gradient to ``racc`` (empty elsewhere); the pipeline sends it to the last stage
before the gradient norm (`add_readout_grads`), so the shared head gets the single-program
gradient with no replica of its parameters or optimizer state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dynjax.model import ModelParts, RaggedCapacities, lm_loss
from dynjax.model.gpt import run_layers
from dynjax.model.hooks import LayerContext
from dynjax.parallel.layout import select
from dynjax.parallel.mesh import TOKEN_AXES, expert_parallel, param_shardings
from dynjax.parallel.metrics import fold_microbatches, hook_metrics, moe_metrics, stack_layers
from dynjax.parallel.stages import StageSpec
from dynjax.parallel.step import (
    DTYPES,
    cast_floats,
    layer_grad_norms,
    overlay,
    update_layer_state,
    update_trainable,
)

Metrics = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class StageSetup:
    """What every stage program of a run shares: the model's units, optimizer and loss weights."""

    parts: ModelParts
    optimizer: optax.GradientTransformation
    grad_clip: float  # the optimizer's global-norm bound, applied globally here; 0 = no clipping
    aux_loss_weight: float
    z_loss_weight: float
    return_assignments: bool  # add the router's top-k per token to the metrics (caching)
    fsdp: bool = False  # parameters and optimizer state split over the stage's data devices


READOUT_UNITS = (("norm",), ("head",))  # the parameter units of `GPT.readout`


def apply_stage(setup: StageSetup, spec: StageSpec, mesh: Mesh, params, x, ctx, cached):
    """The stage's slice of ``GPT.forward``: (output, the carry after its layers (empty on the
    last stage), MoE stats of its layers in order, each layer's hook metrics), through the
    model's own layer loop with the `LayerContext` built from ``ctx`` (module docstring).

    The first stage takes tokens [b, S] and embeds them; the last returns float32 logits.
    """
    parts, dtype = setup.parts, DTYPES[spec.dtype]
    hooks = parts.cfg.hooks
    p = cast_floats(params, dtype, hooks)
    if spec.first:
        x = nnx.merge(parts.embed, p["embed"])(x)
        if parts.learned_positions:
            x = x + p["pos"][: x.shape[1]].astype(x.dtype)
    held = p if spec.last else None
    if not spec.last and "readout" in ctx:
        held = cast_floats(ctx["readout"], dtype, hooks)
    readout = None
    if held is not None:
        norm, head = nnx.merge(parts.norm, held["norm"]), nnx.merge(parts.head, held["head"])
        readout = lambda h: head(norm(h)).astype(jnp.float32)
    carry = dict(ctx.get("carry", {}))
    if spec.first:
        carry = hooks.initial_carry(spec.carry, x.shape[:2])
    context = LayerContext(
        readout=readout, targets=ctx.get("targets"), carry=carry, inference=spec.inference
    )
    capacities: tuple = spec.capacities
    if spec.ragged_totals:
        caps = ctx["capacities"]
        capacities = tuple(RaggedCapacities(caps[j], t) for j, t in enumerate(spec.ragged_totals))
    x, stats, layer_metrics = run_layers(
        [nnx.merge(parts.layers[i], p["layers"][i]) for i in spec.layers],
        x,
        capacities=capacities,
        options=spec.layer_options(),
        parallel=expert_parallel(mesh),
        cached=cached,
        context=context,
        scan=parts.cfg.scan_layers,
        frozen=[i in spec.frozen for i in spec.layers],
    )
    if spec.last:
        return readout(x), {}, stats, layer_metrics
    # The activation a stage sends is in the compute dtype, as the next stage was lowered for
    # (`stage_shapes`): layers may hand back a wider residual (float32 norms in a bfloat16 step).
    carry = {k: context.carry[k] for k in hooks.carry_dtypes(spec.carry)}
    return x.astype(dtype), carry, stats, layer_metrics


def _microbatch_metrics(
    setup: StageSetup, stats, ce, layer_metrics
) -> tuple[jax.Array, Metrics]:
    """(the stage's share of the loss to minimise, its metrics) for one microbatch."""
    aux = sum((jnp.mean(s.aux_loss) for s in stats), jnp.float32(0))
    z = sum((jnp.mean(s.z_loss) for s in stats), jnp.float32(0))
    hook_loss = setup.parts.cfg.hooks.loss(layer_metrics)
    local = setup.aux_loss_weight * aux + setup.z_loss_weight * z + hook_loss
    metrics: Metrics = {"aux_loss": aux, "z_loss": z, **stack_layers(layer_metrics)}
    metrics.update(moe_metrics(stats, setup.return_assignments))
    if ce is not None:
        metrics["loss"] = ce
        local = ce + local
    return local, metrics


def forward_fn(setup: StageSetup, spec: StageSpec, mesh: Mesh):
    def fwd(params, x, ctx, cached):
        y, carry, stats, layer_metrics = apply_stage(setup, spec, mesh, params, x, ctx, cached)
        return y, carry, _microbatch_metrics(setup, stats, None, layer_metrics)[1]

    return fwd


def backward_fn(setup: StageSetup, spec: StageSpec, mesh: Mesh):
    trainable_units = spec.trainable(setup.parts.learned_positions)

    def bwd(params, acc, racc, x, ctx, seed, cached):
        if spec.last:
            ctx = {**ctx, "targets": seed}

        def f(trainable, readout, x):
            out, _, stats, layer_metrics = apply_stage(
                setup, spec, mesh, overlay(params, trainable), x, {**ctx, **readout}, cached
            )
            local, metrics = _microbatch_metrics(
                setup, stats, lm_loss(out, seed) if spec.last else None, layer_metrics
            )
            return (local if spec.last else (out, local)), metrics

        readout = {"readout": ctx["readout"]} if spec.needs_readout else {}
        args = (select(params, trainable_units), readout, x)
        argnums = (0, 1, 2) if spec.input_grads else (0, 1)
        fixed = lambda *a: f(*a, *args[len(argnums) :])
        _, vjp, metrics = jax.vjp(fixed, *args[: len(argnums)], has_aux=True)
        one = jnp.ones((), jnp.float32)
        grads = vjp(one if spec.last else (seed, one))
        add = lambda a, g: a + g.astype(jnp.float32)
        acc = jax.tree.map(add, acc, grads[0])
        racc = jax.tree.map(add, racc, grads[1].get("readout", {}))
        # Without an input gradient, a scalar that is ready with the backward: something to
        # wait on that the stage's next backward does not donate (`Pipeline.timed_step`).
        g_x = grads[2] if spec.input_grads else _done(acc)
        return (acc, g_x, racc) + ((metrics,) if spec.last else ())

    return bwd


def add_readout_grads(acc: Any, racc: Any) -> Any:
    """The last stage's accumulator with a readout gradient accumulated by an earlier stage
    added to its norm and head entries (the shared readout's gradient, module docstring)."""
    return {**acc, **{k: jax.tree.map(jnp.add, acc[k], racc[k]) for k in racc}}


def _done(acc: Any) -> jax.Array:
    """A float32 zero computed from the accumulator, so it is ready only when it is."""
    leaves = jax.tree.leaves(acc)
    return leaves[0].reshape(-1)[0] * 0 if leaves else jnp.zeros((), jnp.float32)


def sqnorm_fn(spec: StageSpec):
    def sqnorm(acc):
        total = sum(
            (jnp.sum(jnp.square(a / spec.microbatches)) for a in jax.tree.leaves(acc)),
            jnp.float32(0),
        )
        return jnp.reshape(total, (1,))

    return sqnorm


def update_fn(setup: StageSetup, spec: StageSpec):
    trainable_units = spec.trainable(setup.parts.learned_positions)
    m = spec.microbatches

    def update(params, opt_state, acc, sq_norms, metrics: Sequence[Metrics]):
        grads = jax.tree.map(lambda a: a / m, acc)
        norm = jnp.sqrt(sum(sq_norms)[0])
        if setup.grad_clip > 0:
            # clip_by_global_norm's formula with the norm of every stage's gradients; the
            # optimizer's own clip then sees a norm <= grad_clip and leaves them as they are.
            clip = setup.grad_clip
            grads = jax.tree.map(lambda g: jnp.where(norm < clip, g, (g / norm) * clip), grads)
        trainable = select(params, trainable_units)
        trainable, opt_state = update_trainable(setup.optimizer, grads, opt_state, trainable)
        folded = fold_microbatches(metrics, setup.parts.cfg.hooks)
        folded["grad_norm"] = norm
        loads = None
        if "moe/group_loads" in folded:
            loads = jnp.sum(folded["moe/group_loads"], axis=1)  # [Ls, E]
        trainable = update_layer_state(
            trainable,
            params,
            spec.layers,
            spec.options,
            hook_metrics(folded),
            loads,
            setup.parts.cfg.hooks,
        )
        zeros = jax.tree.map(jnp.zeros_like, acc)
        folded["layer_grad_norm"] = layer_grad_norms(grads, spec.layers)  # before clipping
        return overlay(params, trainable), opt_state, zeros, folded

    return update


def evaluate_fn(setup: StageSetup, spec: StageSpec, mesh: Mesh):
    def evaluate(params, x, ctx, targets):
        ctx = {**ctx, "targets": targets}
        logits, _, _, _ = apply_stage(setup, spec, mesh, params, x, ctx, None)
        return lm_loss(logits, targets)

    return evaluate


@dataclasses.dataclass(frozen=True)
class StageShapes:
    """Abstract inputs of one stage's programs (shapes, dtypes, shardings on its sub-mesh)."""

    params: Any
    opt_state: Any
    acc: Any
    x: jax.ShapeDtypeStruct  # the stage input: tokens on the first stage, activations after
    y: jax.ShapeDtypeStruct | None  # the stage output (None on the last stage)
    ctx: dict[str, Any]  # what the stage's wrappers read beside x (module docstring)
    carry: dict[str, jax.ShapeDtypeStruct]  # the carry the stage outputs (empty on the last)
    racc: dict[str, Any]  # the readout-gradient accumulator (empty unless needs_readout)
    targets: jax.ShapeDtypeStruct
    cached: jax.ShapeDtypeStruct | None
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
    cached = None
    if spec.cached_routing and spec.moe:
        shape = (len(spec.moe), b, seq_len, cfg.top_k)
        cached = jax.ShapeDtypeStruct(
            shape, jnp.int32, sharding=NamedSharding(mesh, P(None, TOKEN_AXES))
        )
    x = tokens if spec.first else acts
    carry = {
        k: jax.ShapeDtypeStruct((b, seq_len), d, sharding=rows)
        for k, d in setup.parts.cfg.hooks.carry_dtypes(spec.carry).items()
    }
    ctx: dict[str, Any] = {} if spec.first or not carry else {"carry": carry}
    replicated = NamedSharding(mesh, P())
    if spec.ragged_totals:
        shape = (len(spec.moe), cfg.num_experts)
        ctx["capacities"] = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=replicated)
    if spec.needs_targets:
        ctx["targets"] = tokens
    racc: dict[str, Any] = {}
    if spec.needs_readout:
        ctx["readout"] = with_sharding(select(full_params, READOUT_UNITS))
        racc = ctx["readout"]
    if spec.last:
        fn = backward_fn(setup, spec, mesh)
        metrics = jax.eval_shape(fn, params, acc, racc, x, ctx, tokens, cached)[3]
    else:
        metrics = jax.eval_shape(forward_fn(setup, spec, mesh), params, x, ctx, cached)[2]
    metrics = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), metrics
    )
    return StageShapes(
        params=params,
        opt_state=opt_state,
        acc=acc,
        x=x,
        y=None if spec.last else acts,
        ctx=ctx,
        carry={} if spec.last else carry,
        racc=racc,
        targets=tokens,
        cached=cached,
        metrics=metrics,
    )


def lower_stage(
    kind: str, setup: StageSetup, spec: StageSpec, mesh: Mesh, shapes: StageShapes
) -> jax.stages.Lowered:
    """Trace and lower one program of a stage from abstract values."""
    sharding = lambda tree: jax.tree.map(lambda a: a.sharding, tree)
    replicated = NamedSharding(mesh, P())
    metrics = sharding(shapes.metrics)
    if kind == "fwd":
        outs = (shapes.y.sharding, sharding(shapes.carry), metrics)
        jitted = jax.jit(forward_fn(setup, spec, mesh), out_shardings=outs)
        return jitted.lower(shapes.params, shapes.x, shapes.ctx, shapes.cached)
    if kind == "bwd":
        g_x = shapes.x.sharding if spec.input_grads else replicated
        outs = (sharding(shapes.acc), g_x, sharding(shapes.racc))
        outs += (metrics,) if spec.last else ()
        jitted = jax.jit(
            backward_fn(setup, spec, mesh), out_shardings=outs, donate_argnums=(1, 2)
        )
        seed = shapes.targets if spec.last else shapes.y
        return jitted.lower(
            shapes.params, shapes.acc, shapes.racc, shapes.x, shapes.ctx, seed, shapes.cached
        )
    if kind == "sqnorm":
        return jax.jit(sqnorm_fn(spec), out_shardings=replicated).lower(shapes.acc)
    if kind == "update":
        state = (sharding(shapes.params), sharding(shapes.opt_state), sharding(shapes.acc))
        jitted = jax.jit(
            update_fn(setup, spec),
            out_shardings=(*state, None),
            donate_argnums=(0, 1, 2),
        )
        sq = (jax.ShapeDtypeStruct((1,), jnp.float32, sharding=replicated),) * spec.num_stages
        per_mb = (shapes.metrics,) * spec.microbatches
        return jitted.lower(shapes.params, shapes.opt_state, shapes.acc, sq, per_mb)
    if kind == "eval":
        jitted = jax.jit(evaluate_fn(setup, spec, mesh), out_shardings=replicated)
        return jitted.lower(shapes.params, shapes.x, shapes.ctx, shapes.targets)
    raise ValueError(f"unknown stage program {kind!r}")
