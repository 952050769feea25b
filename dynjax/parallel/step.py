"""The jitted training and evaluation steps of one static configuration (one Plan).

The step is a pure function ``(params, opt_state, batch) -> (params, opt_state, metrics)`` over
plain pytrees; the model graph is merged inside so ``jax.jit`` caches on array shapes only
(measured: ``jax.jit`` over split/merge is ~2x faster per call than ``nnx.jit`` on small models).
Everything that changes the compiled program (capacities, cached routing, microbatches, dtype) is
a static argument, so a different Plan is a different executable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dynjax.model import ExpertParallel, RaggedCapacities, lm_loss
from dynjax.model.hooks import MOE_LOADS, NO_HOOKS, Hooks, LayerOptions
from dynjax.parallel.layout import by_path, fill, select
from dynjax.parallel.metrics import fold_stacked, moe_metrics, moe_totals, stack_layers

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The static knobs of a compiled step (filled from a Plan)."""

    capacities: tuple[tuple[int, ...], ...] = ()  # the static MoE path's; () on the ragged one
    # The ragged MoE path's static buffer per MoE layer (`RaggedCapacities.shard_total`); its
    # per-expert capacities come with the batch, as ``capacities`` [L, E] int32.
    ragged_totals: tuple[int, ...] = ()
    cached_routing: bool = False
    microbatches: int = 1
    dtype: str = "float32"
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.0
    return_assignments: bool = False  # add the router's top-k per token to the metrics
    # Layers that get no gradient and no update (layer 0 freezes the embedding with it): a
    # frozen prefix of the model runs no backward (seed 000 §4.2.3).
    frozen_layers: tuple[int, ...] = ()
    layer_options: tuple[LayerOptions, ...] = ()  # each layer's plugin records; () = none
    # The forward evaluates rather than trains: block wrappers run causally (`LayerContext`).
    inference: bool = False
    hooks: Hooks = NO_HOOKS  # what the records run, and how their metrics fold (`GPTConfig.hooks`)


def cast_floats(tree, dtype, hooks: Hooks):
    """Floating leaves in the compute ``dtype``, but a state rule's variables of ``hooks``
    (`Hooks.full_precision`): a rule's steps (the routed bias's 1e-3) are below bfloat16's
    resolution at their magnitude."""

    def cast(path, a):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            return a
        return a if hooks.full_precision(getattr(path[-1], "key", None)) else a.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, tree)


def forward_loss(
    graphdef, params, inputs, targets, cached, opts: StepOptions, parallel, capacities=None
):
    """Loss to minimise and its parts for one (micro)batch: (total, (ce, aux, z, MoE stats,
    the layers' hook metrics stacked by name)). ``capacities``: the ragged path's runtime
    per-expert capacities [L, E] (with ``opts.ragged_totals``)."""
    model = nnx.merge(graphdef, cast_floats(params, DTYPES[opts.dtype], opts.hooks))
    logits, stats, layer_metrics = model.forward(
        inputs,
        capacities=moe_capacities(opts, capacities),
        parallel=parallel,
        cached=cached,
        options=opts.layer_options or None,
        targets=targets,
        inference=opts.inference,
        frozen=opts.frozen_layers,
    )
    ce = lm_loss(logits, targets)
    aux = sum((jnp.mean(s.aux_loss) for s in stats), jnp.float32(0))
    z = sum((jnp.mean(s.z_loss) for s in stats), jnp.float32(0))
    total = ce + opts.aux_loss_weight * aux + opts.z_loss_weight * z
    total = total + opts.hooks.loss(layer_metrics)
    return total, (ce, aux, z, stats, stack_layers(layer_metrics))


def moe_capacities(opts: StepOptions, capacities: jax.Array | None) -> tuple:
    """What each MoE layer's block takes: the static ints, or the runtime row and the static
    buffer of the ragged path."""
    if not opts.ragged_totals:
        return opts.capacities
    return tuple(RaggedCapacities(capacities[j], t) for j, t in enumerate(opts.ragged_totals))


def layer_grad_norms(grads: Mapping[str, Any], layers: Sequence[int]) -> jax.Array:
    """[len(layers)] global norm of each layer's gradient; NaN for a layer without one (frozen):
    what gradient-based freezing measures (seed 000 §4.2.3)."""
    got = grads.get("layers", {})
    return jnp.stack(
        [optax.tree.norm(got[i]) if i in got else jnp.float32(jnp.nan) for i in layers]
    ) if layers else jnp.zeros((0,), jnp.float32)


def update_layer_state(
    units: Mapping[str, Any],
    params: Mapping[str, Any],
    layers: Sequence[int],
    options: Sequence[LayerOptions],
    layer_metrics: Mapping[str, jax.Array],
    moe_loads: jax.Array | None,
    hooks: Hooks,
) -> dict[str, Any]:
    """``units`` (the trainable units after the optimizer update) with the state rules of
    ``hooks`` of each of their layers applied (`HookSet.state_rule`; frozen layers keep their
    state).

    ``layers``: the program's layers in order, ``options`` their `LayerOptions` (empty: none);
    ``layer_metrics`` the step's hook metrics stacked over the layers that report each
    (``[Lr, ...]``): a metric ``"<rule>/..."`` has a row for every layer holding the rule's
    record; ``moe_loads`` [Lm, E] the step's routed pairs of each MoE layer of ``params`` among
    ``layers`` (`hooks.MOE_LOADS`)."""
    options = options or ((),) * len(layers)
    ruled = [(i, o) for i, o in zip(layers, options, strict=True) if hooks.state_rules(o)]
    if not ruled:
        return dict(units)
    moe = [i for i in layers if "moe" in params["layers"][i]]
    holders = {
        name: [i for i, o in zip(layers, options, strict=True) if name in dict(o)]
        for _, o in ruled
        for name, _, _ in hooks.state_rules(o)
    }
    got = dict(units.get("layers", {}))
    for i, opts in ruled:
        if i not in got:
            continue
        metrics = {MOE_LOADS: moe_loads[moe.index(i)]} if i in moe else {}
        for name, rows in holders.items():
            for metric, stacked in layer_metrics.items():
                if metric.startswith(f"{name}/") and i in rows:
                    if len(stacked) != len(rows):
                        raise ValueError(
                            f"state rule {name!r} reads {metric!r}, reported by {len(stacked)} "
                            f"layers, but {len(rows)} layers hold its record"
                        )
                    metrics[metric] = stacked[rows.index(i)]
        got[i] = hooks.apply_state_rules(got[i], metrics, opts)
    return {**units, "layers": got}


def _split_microbatches(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [m, B/m, ...] taking every m-th row, so each device keeps its share of each."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def _join_microbatches(x: jax.Array) -> jax.Array:
    """Inverse of _split_microbatches on a leading [m, B/m, ...] (or [m, L, B/m, ...]) array."""
    return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def trainable_units(params: Mapping[str, Any], frozen_layers: Iterable[int]) -> list[tuple]:
    """The units of ``params`` (``("embed",)``, ``("layers", i)``, ...) that train: all but
    the frozen layers, and the embedding and positions when layer 0 is frozen."""
    frozen = {("layers", i) for i in frozen_layers}
    if ("layers", 0) in frozen:
        frozen |= {("embed",), ("pos",)}
    units = [(k,) for k in params if k != "layers"]
    units += [("layers", i) for i in params.get("layers", {})]
    return [u for u in units if u not in frozen]


def overlay(params: Mapping[str, Any], part: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with the units of ``part`` replaced (both keyed by name)."""
    out = dict(params)
    for key, value in part.items():
        out[key] = {**params[key], **value} if key == "layers" else value
    return out


def update_trainable(optimizer, grads, opt_state, trainable):
    """Apply ``optimizer`` to the ``trainable`` units only: the others keep their parameters
    and optimizer state (their moments are not decayed, their slots not touched).

    Returns (new trainable units, full new optimizer state)."""
    template = jax.eval_shape(optimizer.init, trainable)
    sub_state = fill(template, by_path(opt_state))
    updates, sub_state = optimizer.update(grads, sub_state, trainable)
    trainable = optax.apply_updates(trainable, updates)
    return trainable, fill(opt_state, {**by_path(opt_state), **by_path(sub_state)})


def make_train_step(
    graphdef,
    optimizer: optax.GradientTransformation,
    opts: StepOptions,
    parallel: ExpertParallel | None,
):
    """Build ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` (not jitted).

    ``batch`` holds ``inputs``/``targets`` [B, S], with cached routing ``cached`` [L, B, S, k],
    on the ragged MoE path ``capacities`` [L, E] int32 (a runtime input: no recompile).
    Only the trainable units are differentiated: the frozen layers are constants of the
    program, so XLA keeps no backward for a frozen prefix at all.
    """

    def loss(trainable, frozen, inputs, targets, cached, caps):
        return forward_loss(
            graphdef, overlay(frozen, trainable), inputs, targets, cached, opts, parallel, caps
        )

    grad_fn = jax.value_and_grad(loss, has_aux=True)

    def step(params, opt_state, batch: dict[str, Any]):
        inputs, targets = batch["inputs"], batch["targets"]
        cached = batch.get("cached") if opts.cached_routing else None
        caps = batch["capacities"] if opts.ragged_totals else None

        def one(params, inputs, targets, cached):
            trainable = select(params, trainable_units(params, opts.frozen_layers))
            (_, parts), grads = grad_fn(trainable, params, inputs, targets, cached, caps)
            return grads, *parts

        m = opts.microbatches
        if m == 1:
            grads, ce, aux, z, stats, layer_metrics = one(params, inputs, targets, cached)
        else:
            xs = (
                _split_microbatches(inputs, m),
                _split_microbatches(targets, m),
                None
                if cached is None
                else jnp.swapaxes(jax.vmap(lambda c: _split_microbatches(c, m))(cached), 0, 1),
            )

            def body(acc, x):
                g, *parts = one(params, x[0], x[1], x[2])
                acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g)
                return acc, tuple(parts)

            trainable = select(params, trainable_units(params, opts.frozen_layers))
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trainable)
            grads, (ce, aux, z, st, lm) = jax.lax.scan(body, zeros, xs)
            grads = jax.tree.map(lambda g: g / m, grads)
            stats = [type(s)(*(_join_microbatches(f) for f in s)) for s in st]
            folded = fold_stacked({"loss": ce, "aux_loss": aux, "z_loss": z, **lm}, opts.hooks)
            ce, aux, z = folded.pop("loss"), folded.pop("aux_loss"), folded.pop("z_loss")
            layer_metrics = folded
        trainable = select(params, trainable_units(params, opts.frozen_layers))
        trainable, opt_state = update_trainable(optimizer, grads, opt_state, trainable)
        loads = jnp.stack([jnp.sum(s.group_loads, axis=0) for s in stats]) if stats else None
        trainable = update_layer_state(
            trainable,
            params,
            range(len(params["layers"])),
            opts.layer_options,
            layer_metrics,
            loads,
            opts.hooks,
        )
        params = overlay(params, trainable)
        metrics = {"loss": ce, "aux_loss": aux, "z_loss": z, "grad_norm": optax.tree.norm(grads)}
        metrics["layer_grad_norm"] = layer_grad_norms(grads, range(len(params["layers"])))
        metrics.update(layer_metrics)
        metrics.update(moe_metrics(stats, opts.return_assignments))
        metrics.update(moe_totals(metrics))
        return params, opt_state, metrics

    return step


def make_eval_step(graphdef, opts: StepOptions, parallel: ExpertParallel | None):
    """``eval(params, batch) -> mean next-token loss`` under the same static options, the
    forward run as at inference (`StepOptions.inference`): the loss causal sampling would see."""

    def evaluate(params, batch):
        _, (ce, *_rest) = forward_loss(
            graphdef,
            params,
            batch["inputs"],
            batch["targets"],
            None,
            dataclasses.replace(opts, cached_routing=False, inference=True),
            parallel,
            batch["capacities"] if opts.ragged_totals else None,
        )
        return ce

    return evaluate
