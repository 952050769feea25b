"""A pipeline stage's update as small programs: one per layer signature, shared by its layers.

Why: a stage's update held every leaf of its layers' parameters, gradients and optimizer
moments in one program, a few fused kernels per leaf, so its XLA compile grew with the
stage's depth (48 quickstart layers on 4 stages: 15.4 of the pipeline's 34 compile seconds,
issue 33 §3) and every Plan change that touched a stage compiled all of it again. Equal
layers run the same arithmetic, so one compiled program per signature (the layer's leaves'
shapes and shardings, its update options) and stage updates each of them in turn, called on
that layer's leaves; the stage's other trainable units (embedding, positions, final norm,
head) update in one program of their own, and a fold program before them reduces the
microbatches' metrics and the global norm. The price is a dispatch per trainable layer a step.

The arithmetic is `stage.update_fn`'s: the gradient clipped by the global norm here (the
optimizer's own clip then sees a unit's norm, within its bound), the optimizer on each unit's
slice of the stage's optimizer state (scalars every unit shares, Adam's count, are read by every
call and written by each alike), the unit's state rules, and the step kept whole where the
global norm is not finite under ``train.nonfinite="skip"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dynjax.parallel.layout import select
from dynjax.parallel.metrics import fold_microbatches, hook_metrics
from dynjax.parallel.stage import Metrics, StageSetup, rule_metrics
from dynjax.parallel.stages import StageSpec

Unit = tuple  # ("layers", i) or ("embed",), ...


def _unit_of(path: tuple) -> Unit | None:
    """The parameter unit a leaf of a parameter or optimizer-state tree belongs to: its first
    dict key names it (``("layers", i)`` with the next); None for a leaf no unit owns (Adam's
    count)."""
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    if not keys:
        return None
    return ("layers", keys[1]) if keys[0] == "layers" else (keys[0],)


def _local(unit: Unit) -> Unit:
    """The unit as its group's program sees it: a layer re-keyed to index 0, so that equal
    layers trace one program."""
    return ("layers", 0) if unit[0] == "layers" else unit


@dataclasses.dataclass(frozen=True)
class _Group:
    """Trainable units updated by one call, as positions in the stage's flattened trees."""

    units: tuple[Unit, ...]
    layer: int | None  # the layer of a one-layer group; None: the stage's other units
    params: tuple[int, ...]
    acc: tuple[int, ...]
    own: tuple[int, ...]  # optimizer-state leaves of these units
    shared: tuple[int, ...]  # optimizer-state leaves of no unit, in the group's template order
    order: tuple[tuple[bool, int], ...]  # template leaf -> (shared?, position in own/shared)


def _groups(setup: StageSetup, spec: StageSpec, params: Any, opt_state: Any) -> list[_Group]:
    """One group per trainable layer, then one of the stage's other trainable units (if any)."""
    trainable = spec.trainable(setup.parts.learned_positions)
    layers = [u for u in trainable if u[0] == "layers"]
    rest = tuple(u for u in trainable if u[0] != "layers")
    param_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    state_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]]
    state_at = {p: i for i, p in enumerate(state_paths)}
    acc_units = [_unit_of(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        select(params, trainable))[0]]
    out = []
    for units in [(u,) for u in layers] + ([rest] if rest else []):
        template = jax.eval_shape(setup.optimizer.init, select(params, units))
        own, shared, order = [], [], []
        for path, _ in jax.tree_util.tree_flatten_with_path(template)[0]:
            at = state_at.get(path)
            if at is None:
                raise KeyError(f"stage {spec.index}: no optimizer state at "
                               f"{jax.tree_util.keystr(path)}")
            mine = _unit_of(path) is not None
            (own if mine else shared).append(at)
            order.append((not mine, (len(own) if mine else len(shared)) - 1))
        out.append(_Group(
            units=units,
            layer=units[0][1] if units[0][0] == "layers" else None,
            params=tuple(i for i, p in enumerate(param_paths) if _unit_of(p) in units),
            acc=tuple(i for i, u in enumerate(acc_units) if u in units),
            own=tuple(own), shared=tuple(shared), order=tuple(order),
        ))
    return out


def _unit_update_fn(setup: StageSetup, spec: StageSpec, group: _Group, local_params: Any,
                    options: Any):
    """``update(params, own, shared, acc, norm, finite, rows) -> (params, own, shared, zeros,
    grad norm)`` on one group's flattened leaves (`_Group`)."""
    param_def = jax.tree.structure(local_params)
    state_def = jax.tree.structure(jax.eval_shape(setup.optimizer.init, local_params))
    hooks, m, clip = setup.parts.cfg.hooks, spec.microbatches, setup.grad_clip

    def update(params, own, shared, acc, norm, finite, rows):
        state = jax.tree.unflatten(
            state_def, [(shared if s else own)[i] for s, i in group.order]
        )
        p = jax.tree.unflatten(param_def, params)
        grads = jax.tree.map(lambda a: a / m, jax.tree.unflatten(param_def, acc))
        if clip > 0:
            grads = jax.tree.map(lambda g: jnp.where(norm < clip, g, (g / norm) * clip), grads)
        updates, new_state = setup.optimizer.update(grads, state, p)
        new = optax.apply_updates(p, updates)
        if group.layer is not None and rows:
            new = {"layers": {0: hooks.apply_state_rules(new["layers"][0], rows, options)}}
        if setup.skip_nonfinite:
            keep = lambda n, o: jax.tree.map(lambda a, b: jnp.where(finite, a, b), n, o)
            new, new_state = keep(new, p), keep(new_state, state)
        leaves = jax.tree.leaves(new_state)
        new_own = [leaves[k] for k, (s, _) in enumerate(group.order) if not s]
        new_shared = [leaves[k] for k, (s, _) in enumerate(group.order) if s]
        zeros = [jnp.zeros_like(a) for a in acc]
        return jax.tree.leaves(new), new_own, new_shared, zeros, optax.tree.norm(grads)

    return update


def _fold_fn(setup: StageSetup, spec: StageSpec):
    """``fold(per_microbatch, sq_norms) -> (metrics, norm, finite, rows)``: the step's
    metrics folded over the microbatches with ``grad_norm``, the global norm, whether it is
    finite and each ruled layer's metrics for its state rules (`stage.rule_metrics`)."""
    hooks = setup.parts.cfg.hooks
    trainable = {u[1] for u in spec.trainable(setup.parts.learned_positions) if u[0] == "layers"}

    def fold(per_microbatch: Sequence[Metrics], sq_norms):
        norm = jnp.sqrt(sum(sq_norms)[0])
        folded = {**fold_microbatches(per_microbatch, hooks), "grad_norm": norm}
        rows = rule_metrics(spec.layers, spec.options, hook_metrics(folded, hooks), hooks)
        return folded, norm, jnp.isfinite(norm), {i: r for i, r in rows.items() if i in trainable}

    return fold


def _finish_fn(setup: StageSetup, spec: StageSpec):
    """``finish(metrics, finite, norms) -> metrics`` with ``layer_grad_norm`` (NaN for a layer
    without a gradient) and, under ``nonfinite="skip"``, ``skipped``."""

    def finish(metrics, finite, norms: dict[int, jax.Array]):
        out = dict(metrics)
        out["layer_grad_norm"] = jnp.stack(
            [norms.get(i, jnp.float32(jnp.nan)) for i in spec.layers]
        ) if spec.layers else jnp.zeros((0,), jnp.float32)
        if setup.skip_nonfinite:
            out["skipped"] = jnp.logical_not(finite).astype(jnp.float32)
        return out

    return finish


@dataclasses.dataclass
class _Memory:
    """`memory_analysis()` of the update's calls together: every call's arguments, outputs and
    aliases (the stage's state passes through once), the largest call's temporaries."""

    argument_size_in_bytes: int = 0
    output_size_in_bytes: int = 0
    alias_size_in_bytes: int = 0
    temp_size_in_bytes: int = 0


class StageUpdate:
    """The compiled update of one stage: ``update(params, opt_state, acc, sq_norms,
    per_microbatch) -> (params, opt_state, zeroed acc, metrics)``, as `stage_programs`'
    ``update`` program was."""

    def __init__(self, treedefs, groups, fold, units, finish) -> None:
        self.treedefs, self.groups = treedefs, groups
        self.fold, self.units, self.finish = fold, units, finish

    def __call__(self, params, opt_state, acc, sq_norms, per_microbatch):
        metrics, norm, finite, rows = self.fold(per_microbatch, sq_norms)
        p, s, a = (jax.tree.leaves(t) for t in (params, opt_state, acc))
        before = list(s)  # every group reads the shared leaves (the count) as they were
        norms = {}
        for group, program in zip(self.groups, self.units, strict=True):
            new_p, new_own, new_shared, zeros, norm_of_group = program(
                [p[i] for i in group.params], [s[i] for i in group.own],
                [before[i] for i in group.shared], [a[i] for i in group.acc], norm, finite,
                rows.get(group.layer, {}),
            )
            for target, index, values in ((p, group.params, new_p), (s, group.own, new_own),
                                          (s, group.shared, new_shared), (a, group.acc, zeros)):
                for i, v in zip(index, values, strict=True):
                    target[i] = v
            if group.layer is not None:
                norms[group.layer] = norm_of_group
        metrics = self.finish(metrics, finite, norms)
        p_def, s_def, a_def = self.treedefs
        return p_def.unflatten(p), s_def.unflatten(s), a_def.unflatten(a), metrics

    def memory_analysis(self) -> _Memory | None:
        out = _Memory()
        for program in (self.fold, *self.units, self.finish):
            m = program.memory_analysis()
            if m is None:
                return None
            out.argument_size_in_bytes += m.argument_size_in_bytes
            out.output_size_in_bytes += m.output_size_in_bytes
            out.alias_size_in_bytes += m.alias_size_in_bytes
            out.temp_size_in_bytes = max(out.temp_size_in_bytes, m.temp_size_in_bytes)
        return out


class LoweredStageUpdate:
    """A stage's update lowered: `compile()` compiles each distinct program once, reusing those
    ``cache`` holds (by stage and signature, across Plans) and storing the new ones there."""

    def __init__(self, treedefs, groups, fold, units, finish, cache) -> None:
        self.treedefs, self.groups = treedefs, groups
        self.fold, self.units, self.finish = fold, units, finish  # units: (key, lowered | None)
        self.cache = cache

    def compile(self) -> StageUpdate:
        compiled = []
        for key, lowered in self.units:
            hit = self.cache.get(key)
            if hit is None:
                hit = self.cache.setdefault(key, lowered.compile())
            compiled.append(hit)
        return StageUpdate(self.treedefs, self.groups, self.fold.compile(), compiled,
                           self.finish.compile())


def lower_stage_update(setup: StageSetup, spec: StageSpec, mesh: Mesh, shapes, cache: dict
                       ) -> LoweredStageUpdate:
    """Lower a stage's update programs (``shapes``: its `StageShapes`); a group whose program
    ``cache`` holds, or an earlier group of this stage has, is not lowered again."""
    replicated = NamedSharding(mesh, P())
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=replicated)  # noqa: E731
    sharding = lambda tree: jax.tree.map(lambda a: a.sharding, tree)  # noqa: E731
    fold = _fold_fn(setup, spec)
    sq = (jax.ShapeDtypeStruct((1,), jnp.float32, sharding=replicated),) * spec.num_stages
    per_mb = (shapes.metrics,) * spec.microbatches
    folded, _, _, rows = jax.eval_shape(fold, per_mb, sq)
    rows = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
                        rows)
    fold_lowered = jax.jit(fold, out_shardings=replicated).lower(per_mb, sq)
    p, s, a = (jax.tree.leaves(t) for t in (shapes.params, shapes.opt_state, shapes.acc))
    groups = _groups(setup, spec, shapes.params, shapes.opt_state)
    options = dict(zip(spec.layers, setup.parts.cfg.hooks.update_options(
        spec.options or ((),) * len(spec.layers)), strict=True))
    units, lowered_here = [], {}
    for group in groups:
        local = select(shapes.params, group.units)
        if group.layer is not None:
            local = {"layers": {0: local["layers"][group.layer]}}
        args = ([p[i] for i in group.params], [s[i] for i in group.own],
                [s[i] for i in group.shared], [a[i] for i in group.acc],
                scalar(jnp.float32), scalar(jnp.bool_), rows.get(group.layer, {}))
        opts = options.get(group.layer, ())
        avals = tuple((x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(args))
        key = (spec.index, tuple(map(_local, group.units)), opts, group.order,
               jax.tree.structure(args), avals, spec.microbatches)
        if key not in cache and key not in lowered_here:
            jitted = jax.jit(
                _unit_update_fn(setup, spec, group, local, opts),
                out_shardings=(sharding(args[0]), sharding(args[1]), sharding(args[2]),
                               sharding(args[3]), replicated),
                donate_argnums=(0, 1, 3),
            )
            lowered_here[key] = jitted.lower(*args)
        units.append((key, lowered_here.get(key)))
    finish = _finish_fn(setup, spec)
    norms = {g.layer: scalar(jnp.float32) for g in groups if g.layer is not None}
    finish_lowered = jax.jit(finish, out_shardings=replicated).lower(
        folded_with_sharding(folded, replicated), scalar(jnp.bool_), norms
    )
    treedefs = tuple(jax.tree.structure(t) for t in (shapes.params, shapes.opt_state, shapes.acc))
    return LoweredStageUpdate(treedefs, groups, fold_lowered, units, finish_lowered, cache)


def folded_with_sharding(tree: Any, sharding: NamedSharding) -> Any:
    """Abstract ``tree`` with every leaf on ``sharding``."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)
