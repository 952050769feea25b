"""One stage of the model: its forward and loss terms, its gradients, its update, its evaluation.

Both runtimes train with these functions. A pipeline stage (`StageSpec`) holds consecutive
layers, the embedding if it is the first and the final norm, head and loss if it is the last;
the single-program step is the one-stage case, a spec with ``first`` and ``last`` over every
layer (`dynjax.parallel.step`), run as one jitted program with its microbatch loop inside. The
pipeline compiles each function below as a program of its own per stage
(`dynjax.parallel.stage_programs`), with the microbatch loop in its schedule:

* `forward_loss`: the stage's layers on one microbatch, and its terms of the loss to minimise
  (the cross entropy on the last stage, every stage's hook sets' stage losses and its block
  hooks' loss terms) with the metrics of that microbatch;
* `backward_fn`: the gradients of those terms, added to the float32 accumulator of the
  trainable units, seeded with the loss on the last stage and with the next stage's input
  gradient on the others;
* `sqnorm_fn` and `update_fn`: the squared norm of the stage's gradient, then the update:
  global-norm clipping (the sum of every stage's squared norms), the optimizer on the
  trainable units only, and the state rules of the stage's layers (`HookSet.state_rule`) on
  its metrics, folded over the microbatches by their declared reductions
  (`dynjax.parallel.metrics`);
* `evaluate_fn`: the last stage's loss as at inference.

``ctx`` holds what the stage's block wrappers read of the `LayerContext` beyond activations
(`HookSet` ``needs`` and ``carry``), only what they need, and ``inputs``, the step inputs of
its layers (`StageSpec.step_inputs`, each name [its layers, ...]: runtime inputs, issue 12
§1); the batch inputs of a microbatch (`StageSpec.batch_inputs`) come as their own argument,
``batch_in`` (None: none): ``carry``, the per-token arrays the previous stage's layers left (a
stage input and output beside the activations, never differentiated); ``targets`` [b, S] (the
last stage's loss takes them from here too); and ``readout``, the last stage's norm and head
parameters, for a stage before the last whose wrappers read the model's readout: its loss terms
differentiate through those parameters too, and that gradient goes to ``racc``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dynjax.model import ExpertParallel, ModelParts, lm_loss
from dynjax.model.gpt import run_layers
from dynjax.model.hooks import Hooks, LayerContext, LayerOptions
from dynjax.parallel.layout import by_path, fill, select
from dynjax.parallel.metrics import hook_metrics, stack_layers
from dynjax.parallel.stages import StageSpec
from dynjax.parallel.step_inputs import layer_rows

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
READOUT_UNITS = (("norm",), ("head",))  # the parameter units of `GPT.readout`

Metrics = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class StageSetup:
    """What every stage of a run shares: the model's units and optimizer."""

    parts: ModelParts
    optimizer: optax.GradientTransformation
    grad_clip: float  # the optimizer's global-norm bound, applied globally here; 0 = no clipping
    fsdp: bool = False  # parameters and optimizer state split over the stage's data devices
    # ``train.nonfinite="skip"``: a step whose global gradient norm is not finite keeps the
    # parameters and optimizer state it had (`update_fn`), and says so in ``skipped``.
    skip_nonfinite: bool = False
    # ``pipeline.recompute``: a pipeline stage's backward recomputes its forward from the
    # stored stage input; False: its forward keeps the VJP's residuals for it instead
    # (`dynjax.parallel.residuals`).
    recompute: bool = True


def cast_floats(tree, dtype, hooks: Hooks):
    """Floating leaves in the compute ``dtype``, but a state rule's variables of ``hooks``
    (`Hooks.full_precision`): a rule's steps (the routed bias's 1e-3) are below bfloat16's
    resolution at their magnitude."""

    def cast(path, a):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            return a
        return a if hooks.full_precision(getattr(path[-1], "key", None)) else a.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, tree)


def overlay(params: Mapping[str, Any], part: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with the units of ``part`` replaced (both keyed by name)."""
    out = dict(params)
    for key, value in part.items():
        out[key] = {**params[key], **value} if key == "layers" else value
    return out


def apply_stage(
    setup: StageSetup,
    spec: StageSpec,
    parallel: ExpertParallel | None,
    params,
    x,
    ctx,
    batch_in,
    *,
    start: int = 0,
    keep: int = 0,
):
    """The stage's slice of ``GPT.forward``: (output, the carry after its layers (empty on the
    last stage), each layer's hook metrics, the hidden state entering its layer ``keep``),
    through the model's own layer loop with the `LayerContext` built from ``ctx`` and each
    layer's rows of the step inputs (``ctx["inputs"]``) and the batch inputs ``batch_in``
    (module docstring).

    The first stage takes tokens [b, S] and embeds them; the last returns float32 logits.
    ``start`` > 0: ``x`` is the hidden state entering the stage's layer ``start`` and only the
    layers from there run (the metrics are theirs); ``keep`` > 0: also return the hidden state
    entering layer ``keep`` (else None): a frozen prefix's output (`frozen_prefix`).
    """
    parts, dtype = setup.parts, DTYPES[spec.dtype]
    hooks = parts.cfg.hooks
    p = cast_floats(params, dtype, hooks)
    if spec.first and not start:
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
    inputs = layer_rows(ctx.get("inputs", {}), spec.step_inputs, spec.layers)
    for one, more in zip(
        inputs, layer_rows(batch_in or {}, spec.batch_inputs, spec.layers), strict=True
    ):
        one.update(more)
    blocks = [nnx.merge(parts.layers[i], p["layers"][i]) for i in spec.layers]
    options, frozen = spec.layer_options(), [i in spec.frozen for i in spec.layers]
    remat = spec.layer_remat()

    def layers(a: int, b: int, x: jax.Array) -> tuple[jax.Array, tuple]:
        x, _, metrics = run_layers(
            blocks[a:b],
            x,
            options=options[a:b],
            parallel=parallel,
            inputs=inputs[a:b],
            context=context,
            scan_from=parts.cfg.scan_from,
            frozen=frozen[a:b],
            remat=remat[a:b],
        )
        return x, metrics

    kept, layer_metrics = None, ()
    if keep:
        kept, layer_metrics = layers(start, keep, x)
        x = kept
    x, more = layers(max(start, keep), len(blocks), x)
    layer_metrics = (*layer_metrics, *more)
    if spec.last:
        return readout(x), {}, layer_metrics, kept
    # The activation a stage sends is in the compute dtype, as the next stage was lowered for
    # (`stage_shapes`): layers may hand back a wider residual (float32 norms in a bfloat16 step).
    carry = {k: context.carry[k] for k in hooks.carry_dtypes(spec.carry)}
    return x.astype(dtype), carry, layer_metrics, kept


def forward_loss(
    setup: StageSetup,
    spec: StageSpec,
    parallel: ExpertParallel | None,
    params,
    x,
    ctx,
    batch_in,
    *,
    start: int = 0,
    keep: int = 0,
) -> tuple[jax.Array, dict[str, jax.Array], jax.Array, Metrics, jax.Array | None]:
    """The stage's forward on one microbatch and its terms of the loss to minimise: (output,
    carry, loss terms, metrics, the hidden state `apply_stage` kept). On the last stage the
    output are the logits and the loss terms start with the cross entropy against
    ``ctx["targets"]`` (the metric ``loss``); every stage adds its hook sets' stage losses
    (`Hooks.stage_loss`) and its hooks' loss terms. The metrics: the stage losses' step metrics
    and the hook metrics stacked over the layers reporting each (``start``: of the layers that
    ran)."""
    out, carry, layer_metrics, kept = apply_stage(
        setup, spec, parallel, params, x, ctx, batch_in, start=start, keep=keep
    )
    hooks = setup.parts.cfg.hooks
    term, step_metrics = hooks.stage_loss(layer_metrics, spec.layer_options()[start:])
    hook_loss = hooks.loss(layer_metrics)
    local = hook_loss if term is None else term + hook_loss
    metrics: Metrics = {**step_metrics, **stack_layers(layer_metrics)}
    if spec.last:
        metrics["loss"] = ce = lm_loss(out, ctx["targets"])
        local = ce + local
    return out, carry, local, metrics, kept


def frozen_prefix(setup: StageSetup, spec: StageSpec) -> int:
    """How many leading layers of ``spec`` its backward can skip entirely: frozen layers that
    nothing before them trains (no input gradient, the embedding frozen on the first stage) and
    whose loss terms are constants. Its forward keeps their output as the microbatch's stage
    input, so its backward recomputes the trainable rest only (seed 000 §4.2.3: a frozen
    layer costs its forward alone; recomputing the prefix cost a second forward of it).

    0 where it does not apply: a stage whose layers pass a carry, read step or batch inputs,
    the readout or a stage loss (their values or rows would have to be cut at the prefix), the
    last stage (its backward returns every layer's metrics), a stage without backward, and a
    run whose forward keeps the VJP's residuals (``recompute`` off: nothing is recomputed)."""
    if not setup.recompute or spec.last or spec.input_grads or spec.needs_readout or spec.carry:
        return 0
    if (spec.first and not spec.embed_frozen) or spec.step_inputs or spec.batch_inputs:
        return 0
    if setup.parts.cfg.hooks.has_stage_loss(spec.layer_options()):
        return 0
    k = 0
    while k < len(spec.layers) and spec.layers[k] in spec.frozen:
        k += 1
    return k if k < len(spec.layers) else 0


def backward_fn(setup: StageSetup, spec: StageSpec, parallel: ExpertParallel | None):
    """``bwd(params, acc, racc, x, ctx, seed, batch_in) -> (acc, g_x, racc, [metrics])``.

    Runs the stage forward on one microbatch (the pipeline recomputes it from the stored stage
    input: activation checkpointing at stage boundaries), then adds the weight gradients of the
    trainable units to the accumulator ``acc`` (float32) and those of a read readout to
    ``racc``, and returns the input gradient if an earlier stage needs it (else a scalar that is
    ready with the backward). The last stage's ``seed`` is the targets, its gradient seeded
    with the loss, and it returns the microbatch's metrics; the others are seeded with the next
    stage's input gradient. Frozen units are constants: XLA keeps no backward for a frozen
    prefix at all."""
    gradients = gradients_fn(setup, spec, parallel)

    def bwd(params, acc, racc, x, ctx, seed, batch_in):
        grads, metrics = gradients(params, x, ctx, seed, batch_in)
        acc, g_x, racc = accumulate(spec, acc, racc, grads)
        return (acc, g_x, racc) + ((metrics,) if spec.last else ())

    return bwd


def gradients_fn(setup: StageSetup, spec: StageSpec, parallel: ExpertParallel | None):
    """``grads(params, x, ctx, seed, batch_in) -> (gradients, metrics)``: `backward_fn` before
    accumulating (the gradients of `stage_vjp`; the metrics on the last stage, else None)."""
    start = frozen_prefix(setup, spec)  # x: the frozen prefix's output (`frozen_prefix`)

    def grads(params, x, ctx, seed, batch_in):
        if spec.last:
            ctx = {**ctx, "targets": seed}
        _, vjp, (metrics, _) = stage_vjp(
            setup, spec, parallel, params, x, ctx, batch_in, start=start
        )
        one = jnp.ones((), jnp.float32)
        return vjp(one if spec.last else (seed, one)), (metrics if spec.last else None)

    return grads


def stage_vjp(
    setup: StageSetup,
    spec: StageSpec,
    parallel: ExpertParallel | None,
    params,
    x,
    ctx,
    batch_in,
    *,
    start: int = 0,
):
    """``jax.vjp`` of the stage's differentiated outputs (its loss terms on the last stage,
    else its output and loss terms) in the trainable units, the read readout and, where an
    earlier stage needs it, the input: returns (outputs, vjp, (metrics, carry))."""

    def f(trainable, readout, x):
        out, carry, local, metrics, _ = forward_loss(
            setup,
            spec,
            parallel,
            overlay(params, trainable),
            x,
            {**ctx, **readout},
            batch_in,
            start=start,
        )
        return (local if spec.last else (out, local)), (metrics, carry)

    readout = {"readout": ctx["readout"]} if spec.needs_readout else {}
    args = (select(params, spec.trainable(setup.parts.learned_positions)), readout, x)
    argnums = (0, 1, 2) if spec.input_grads else (0, 1)
    fixed = lambda *a: f(*a, *args[len(argnums) :])
    return jax.vjp(fixed, *args[: len(argnums)], has_aux=True)


def accumulate(spec: StageSpec, acc: Any, racc: Any, grads: tuple) -> tuple[Any, Any, Any]:
    """(acc, g_x, racc) after a backward's ``grads`` of `stage_vjp`: the weight gradients added
    in float32, the input gradient (or, without one, a scalar that is ready with the backward:
    something to wait on that the stage's next backward does not donate,
    `Pipeline.timed_step`)."""
    acc, racc = add_weight_grads(acc, racc, grads[:2])
    return acc, (grads[2] if spec.input_grads else done_with(acc)), racc


def add_weight_grads(acc: Any, racc: Any, grads: tuple) -> tuple[Any, Any]:
    """(acc, racc) with the units' and the read readout's gradients (``grads[:2]`` of
    `stage_vjp`) added in float32."""
    add = lambda a, g: a + g.astype(jnp.float32)
    return jax.tree.map(add, acc, grads[0]), jax.tree.map(add, racc, grads[1].get("readout", {}))


def done_with(acc: Any) -> jax.Array:
    """A float32 zero computed from the accumulator, so it is ready only when it is."""
    leaves = jax.tree.leaves(acc)
    return leaves[0].reshape(-1)[0] * 0 if leaves else jnp.zeros((), jnp.float32)


def sqnorm_fn(spec: StageSpec):
    """``sqnorm(acc) -> [1]``: the squared norm of the stage's mean gradient."""

    def sqnorm(acc):
        total = sum(
            (jnp.sum(jnp.square(a / spec.microbatches)) for a in jax.tree.leaves(acc)),
            jnp.float32(0),
        )
        return jnp.reshape(total, (1,))

    return sqnorm


def layer_grad_norms(grads: Mapping[str, Any], layers: Sequence[int]) -> jax.Array:
    """[len(layers)] global norm of each layer's gradient; NaN for a layer without one (frozen):
    what gradient-based freezing measures (seed 000 §4.2.3)."""
    got = grads.get("layers", {})
    return jnp.stack(
        [optax.tree.norm(got[i]) if i in got else jnp.float32(jnp.nan) for i in layers]
    ) if layers else jnp.zeros((0,), jnp.float32)


def update_trainable(optimizer, grads, opt_state, trainable):
    """Apply ``optimizer`` to the ``trainable`` units only: the others keep their parameters
    and optimizer state (their moments are not decayed, their slots not touched).

    Returns (new trainable units, full new optimizer state)."""
    template = jax.eval_shape(optimizer.init, trainable)
    sub_state = fill(template, by_path(opt_state))
    updates, sub_state = optimizer.update(grads, sub_state, trainable)
    trainable = optax.apply_updates(trainable, updates)
    return trainable, fill(opt_state, {**by_path(opt_state), **by_path(sub_state)})


def update_layer_state(
    units: Mapping[str, Any],
    layers: Sequence[int],
    options: Sequence[LayerOptions],
    layer_metrics: Mapping[str, jax.Array],
    hooks: Hooks,
) -> dict[str, Any]:
    """``units`` (the trainable units after the optimizer update) with the state rules of
    ``hooks`` of each of their layers applied (`HookSet.state_rule`; frozen layers keep their
    state). ``layers``, ``options`` and ``layer_metrics`` as `rule_metrics` takes them."""
    options = options or ((),) * len(layers)
    ruled = rule_metrics(layers, options, layer_metrics, hooks)
    if not ruled:
        return dict(units)
    got = dict(units.get("layers", {}))
    for i, opts in zip(layers, options, strict=True):
        if i in got and i in ruled:
            got[i] = hooks.apply_state_rules(got[i], ruled[i], opts)
    return {**units, "layers": got}


def rule_metrics(
    layers: Sequence[int],
    options: Sequence[LayerOptions],
    layer_metrics: Mapping[str, jax.Array],
    hooks: Hooks,
) -> dict[int, dict[str, jax.Array]]:
    """Each layer with a state rule (`HookSet.state_rule`) -> the step metrics its rules read.

    ``layers``: the stage's layers in order, ``options`` their `LayerOptions` (empty: none);
    ``layer_metrics`` the step's hook metrics stacked over the layers that report each
    (``[Lr, ...]``): a metric ``"<name>/..."`` has a row for every layer holding a record
    ``name``. A rule gets every metric of its layer's records."""
    options = options or ((),) * len(layers)
    ruled = [(i, o) for i, o in zip(layers, options, strict=True) if hooks.state_rules(o)]
    if not ruled:
        return {}
    holders = {
        name: [i for i, o in zip(layers, options, strict=True) if name in dict(o)]
        for _, o in ruled
        for name, _ in o
    }
    rules = {name for _, o in ruled for name, _, _ in hooks.state_rules(o)}
    out = {}
    for i, _ in ruled:
        metrics = {}
        for name, rows in holders.items():
            for metric, stacked in layer_metrics.items():
                if metric.startswith(f"{name}/") and i in rows:
                    if len(stacked) != len(rows):
                        if name not in rules:  # not every holder reports it: not a row each
                            continue
                        raise ValueError(
                            f"state rule {name!r} reads {metric!r}, reported by "
                            f"{len(stacked)} layers, but {len(rows)} layers hold its record"
                        )
                    metrics[metric] = stacked[rows.index(i)]
        out[i] = metrics
    return out


def update_fn(setup: StageSetup, spec: StageSpec):
    """``update(params, opt_state, acc, sq_norms, metrics) -> (params, opt_state, metrics)``.

    ``acc``: the stage's gradient summed over the step's microbatches; ``sq_norms``: every
    stage's squared norm [1] (`sqnorm_fn`) in stage order, so every stage computes the same
    global norm; ``metrics``: the stage's metrics of the step, folded over its microbatches by
    their declared reductions (`metrics.fold_stacked`). Clips with the global norm
    (clip_by_global_norm's formula; the optimizer's own clip then sees a norm within its bound,
    and with one stage it is the global clip already, so the single program leaves clipping to
    it), applies the optimizer to the trainable units and runs the state rules of the stage's
    layers on the metrics. Returns the metrics with ``grad_norm`` (before clipping) and
    ``layer_grad_norm`` of the gradient the optimizer gets: on a pipeline clipped here, in the
    single program before its optimizer clips (as the two runtimes have always reported it)."""
    trainable_units = spec.trainable(setup.parts.learned_positions)
    hooks = setup.parts.cfg.hooks
    m = spec.microbatches

    def update(params, opt_state, acc, sq_norms, metrics: Metrics):
        grads = jax.tree.map(lambda a: a / m, acc)
        norm = jnp.sqrt(sum(sq_norms)[0])
        if setup.grad_clip > 0 and spec.num_stages > 1:
            clip = setup.grad_clip
            grads = jax.tree.map(lambda g: jnp.where(norm < clip, g, (g / norm) * clip), grads)
        trainable, before = select(params, trainable_units), opt_state
        trainable, opt_state = update_trainable(setup.optimizer, grads, opt_state, trainable)
        folded = {**metrics, "grad_norm": norm}
        trainable = update_layer_state(
            trainable, spec.layers, spec.options, hook_metrics(folded, hooks), hooks
        )
        folded["layer_grad_norm"] = layer_grad_norms(grads, spec.layers)
        if setup.skip_nonfinite:  # the global norm: every stage decides alike
            finite = jnp.isfinite(norm)
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
            trainable = keep(trainable, select(params, trainable_units))
            opt_state = keep(opt_state, before)
            folded["skipped"] = jnp.logical_not(finite).astype(jnp.float32)
        return overlay(params, trainable), opt_state, folded

    return update


def evaluate_fn(setup: StageSetup, spec: StageSpec, parallel: ExpertParallel | None):
    """``evaluate(params, x, ctx, targets) -> loss`` of the last stage: the mean next-token
    loss, the forward run as ``spec`` says (at inference: `StageSpec.inference`)."""

    def evaluate(params, x, ctx, targets):
        ctx = {**ctx, "targets": targets}
        logits, _, _, _ = apply_stage(setup, spec, parallel, params, x, ctx, None)
        return lm_loss(logits, targets)

    return evaluate
