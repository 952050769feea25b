"""A pipeline stage's update as small programs: one per signature of a few layers, shared.

Why: a stage's update held every leaf of its layers' parameters, gradients and optimizer
moments in one program, a few fused kernels per leaf, so its XLA compile grew with the
stage's depth (48 quickstart layers on 4 stages: 15.4 of the pipeline's 34 compile seconds,
issue 33 §3) and every Plan change that touched a stage compiled all of it again. Equal
layers run the same arithmetic, so the stage's trainable layers update in groups of
`GROUP_LAYERS` consecutive ones, one compiled program per group signature (the leaves' shapes
and shardings, the layers' update options) and stage, each call on its group's leaves; the
stage's other trainable units (embedding, positions, final norm, head) update in one program
of their own, and a fold program before them reduces the microbatches' metrics and the global
norm. The price is a dispatch per group a step: one a layer cost 7-14% of the 48-layer
quickstart pipeline's step on 8 fake CPU devices (docs/benchmarks.md, "First compile against
depth"). A run over several processes traces the same functions into one program a stage
(`lower_stage_update`'s ``whole``).

The arithmetic is `stage.update_fn`'s: the gradient clipped by the global norm here (the
optimizer's own clip then sees a unit's norm, within its bound), the optimizer on each unit's
slice of the stage's optimizer state (scalars every unit shares, Adam's count, are read by every
call and written by each alike), the unit's state rules, and the step kept whole where the
global norm is not finite under ``train.nonfinite="skip"``.
"""

from __future__ import annotations

import dataclasses
import functools
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
GROUP_LAYERS = 4  # layers a call updates: compile grows with it, dispatches a step fall with it


def _unit_of(path: tuple) -> Unit | None:
    """The parameter unit a leaf of a parameter or optimizer-state tree belongs to: its first
    dict key names it (``("layers", i)`` with the next); None for a leaf no unit owns (Adam's
    count)."""
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    if not keys:
        return None
    return ("layers", keys[1]) if keys[0] == "layers" else (keys[0],)


def _local(unit: Unit, at: int) -> Unit:
    """The units as their group's program sees them: layers re-keyed to 0, 1, ... in order,
    so that equal groups trace one program."""
    return ("layers", at) if unit[0] == "layers" else unit


@dataclasses.dataclass(frozen=True)
class _Group:
    """Trainable units updated by one call, as positions in the stage's flattened trees."""

    units: tuple[Unit, ...]
    layers: tuple[int, ...]  # the group's layers; empty: the stage's other units
    params: tuple[int, ...]
    acc: tuple[int, ...]
    own: tuple[int, ...]  # optimizer-state leaves of these units
    shared: tuple[int, ...]  # optimizer-state leaves of no unit, in the group's template order
    order: tuple[tuple[bool, int], ...]  # template leaf -> (shared?, position in own/shared)


def _groups(setup: StageSetup, spec: StageSpec, params: Any, opt_state: Any) -> list[_Group]:
    """Groups of up to `GROUP_LAYERS` consecutive trainable layers, then one of the stage's
    other trainable units (if any)."""
    trainable = spec.trainable(setup.parts.learned_positions)
    layers = [u for u in trainable if u[0] == "layers"]
    rest = tuple(u for u in trainable if u[0] != "layers")
    param_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    state_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]]
    state_at = {p: i for i, p in enumerate(state_paths)}
    acc_units = [_unit_of(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        select(params, trainable))[0]]
    out = []
    chunks = [tuple(layers[i : i + GROUP_LAYERS]) for i in range(0, len(layers), GROUP_LAYERS)]
    for units in chunks + ([rest] if rest else []):
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
            layers=tuple(u[1] for u in units if u[0] == "layers"),
            params=tuple(i for i, p in enumerate(param_paths) if _unit_of(p) in units),
            acc=tuple(i for i, u in enumerate(acc_units) if u in units),
            own=tuple(own), shared=tuple(shared), order=tuple(order),
        ))
    return out


def _unit_update_fn(setup: StageSetup, spec: StageSpec, group: _Group, local_params: Any,
                    options: Any):
    """``update(params, own, shared, acc, norm, finite, rows) -> (params, own, shared, zeros,
    each layer's gradient norm)`` on one group's flattened leaves (`_Group`)."""
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
        if rows:
            new = {**new, "layers": {
                j: hooks.apply_state_rules(layer, rows[j], options[j]) if j in rows else layer
                for j, layer in new["layers"].items()
            }}
        if setup.skip_nonfinite:
            keep = lambda n, o: jax.tree.map(lambda a, b: jnp.where(finite, a, b), n, o)
            new, new_state = keep(new, p), keep(new_state, state)
        leaves = jax.tree.leaves(new_state)
        new_own = [leaves[k] for k, (s, _) in enumerate(group.order) if not s]
        new_shared = [leaves[k] for k, (s, _) in enumerate(group.order) if s]
        zeros = [jnp.zeros_like(a) for a in acc]
        norms = tuple(optax.tree.norm(grads["layers"][j]) for j in range(len(group.layers)))
        return jax.tree.leaves(new), new_own, new_shared, zeros, norms

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


def _rows_of(group: _Group, rows: dict) -> dict:
    """The state-rule metrics of ``group``'s layers, keyed as its program sees them (0, 1, ...)."""
    return {j: rows[i] for j, i in enumerate(group.layers) if i in rows}


def _apply(treedefs, groups, fold, units, finish, params, opt_state, acc, sq_norms,
           per_microbatch):
    """One update: ``fold``, then each group's ``units`` program on its leaves, then ``finish``
    (compiled programs called in turn, or functions traced into one program)."""
    metrics, norm, finite, rows = fold(per_microbatch, sq_norms)
    p, s, a = (jax.tree.leaves(t) for t in (params, opt_state, acc))
    before = list(s)  # every group reads the shared leaves (the count) as they were
    norms = {}
    for group, program in zip(groups, units, strict=True):
        new_p, new_own, new_shared, zeros, norm_of_group = program(
            [p[i] for i in group.params], [s[i] for i in group.own],
            [before[i] for i in group.shared], [a[i] for i in group.acc], norm, finite,
            _rows_of(group, rows),
        )
        for target, index, values in ((p, group.params, new_p), (s, group.own, new_own),
                                      (s, group.shared, new_shared), (a, group.acc, zeros)):
            for i, v in zip(index, values, strict=True):
                target[i] = v
        norms.update(zip(group.layers, norm_of_group, strict=True))
    metrics = finish(metrics, finite, norms)
    p_def, s_def, a_def = treedefs
    return p_def.unflatten(p), s_def.unflatten(s), a_def.unflatten(a), metrics


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
    per_microbatch) -> (params, opt_state, zeroed acc, metrics)``, the ``update`` of
    `stage_programs`' module docstring, as its calls in turn."""

    def __init__(self, treedefs, groups, fold, units, finish) -> None:
        self.treedefs, self.groups = treedefs, groups
        self.fold, self.units, self.finish = fold, units, finish

    def __call__(self, params, opt_state, acc, sq_norms, per_microbatch):
        return _apply(self.treedefs, self.groups, self.fold, self.units, self.finish, params,
                      opt_state, acc, sq_norms, per_microbatch)

    @property
    def calls(self) -> tuple:
        """The compiled programs one update calls, in order (a shared one once per call)."""
        return (self.fold, *self.units, self.finish)

    def cost_analysis(self) -> dict[str, float]:
        """XLA's cost counts of one update, summed over its calls (a program shared by several
        groups counts once per call): what a single program's ``cost_analysis()`` gives."""
        out: dict[str, float] = {}
        for program in self.calls:
            cost = program.cost_analysis()
            for key, value in (cost[0] if isinstance(cost, list | tuple) else cost or {}).items():
                out[key] = out.get(key, 0.0) + float(value)
        return out

    def memory_analysis(self) -> _Memory | None:
        out = _Memory()
        for program in self.calls:
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


def lower_stage_update(setup: StageSetup, spec: StageSpec, mesh: Mesh, shapes, cache: dict,
                       *, whole: bool = False) -> LoweredStageUpdate | jax.stages.Lowered:
    """Lower a stage's update programs (``shapes``: its `StageShapes`); a group whose program
    ``cache`` holds, or an earlier group of this stage has, is not lowered again.

    ``whole``: the same arithmetic traced into one program, for runs over several processes.
    Why: there every process's devices also run the transfers across processes, and on the
    CPU backend the group programs' extra dispatches each step (the in-process collectives of
    their norms among them) let a process run far enough ahead to hang its transfers, as
    tests/launch/test_preemption.py's stage-per-process run did in CI and here."""
    replicated = NamedSharding(mesh, P())
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=replicated)  # noqa: E731
    sharding = lambda tree: jax.tree.map(lambda a: a.sharding, tree)  # noqa: E731
    fold = _fold_fn(setup, spec)
    sq = (jax.ShapeDtypeStruct((1,), jnp.float32, sharding=replicated),) * spec.num_stages
    per_mb = (shapes.metrics,) * spec.microbatches
    folded, _, _, rows = jax.eval_shape(fold, per_mb, sq)
    rows = _abstract_on(rows, replicated)
    p, s, a = (jax.tree.leaves(t) for t in (shapes.params, shapes.opt_state, shapes.acc))
    groups = _groups(setup, spec, shapes.params, shapes.opt_state)
    options = dict(zip(spec.layers, setup.parts.cfg.hooks.update_options(
        spec.options or ((),) * len(spec.layers)), strict=True))
    group_options = [tuple(options[i] for i in g.layers) for g in groups]
    treedefs = tuple(jax.tree.structure(t) for t in (shapes.params, shapes.opt_state, shapes.acc))
    finish = _finish_fn(setup, spec)

    def unit_fn(group: _Group, opts: tuple):
        local = select(shapes.params, group.units)
        if group.layers:
            local = {"layers": {j: local["layers"][i] for j, i in enumerate(group.layers)}}
        return _unit_update_fn(setup, spec, group, local, opts)

    if whole:
        fns = [unit_fn(g, opts) for g, opts in zip(groups, group_options, strict=True)]
        state = (sharding(shapes.params), sharding(shapes.opt_state), sharding(shapes.acc))
        jitted = jax.jit(functools.partial(_apply, treedefs, groups, fold, fns, finish),
                         out_shardings=(*state, replicated), donate_argnums=(0, 1, 2))
        return jitted.lower(shapes.params, shapes.opt_state, shapes.acc, sq, per_mb)
    fold_lowered = jax.jit(fold, out_shardings=replicated).lower(per_mb, sq)
    units, lowered_here = [], {}
    for group, opts in zip(groups, group_options, strict=True):
        args = ([p[i] for i in group.params], [s[i] for i in group.own],
                [s[i] for i in group.shared], [a[i] for i in group.acc],
                scalar(jnp.float32), scalar(jnp.bool_), _rows_of(group, rows))
        avals = tuple((x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(args))
        local_units = tuple(_local(u, j) for j, u in enumerate(group.units))
        key = (spec.index, local_units, opts, group.order,
               jax.tree.structure(args), avals, spec.microbatches)
        if key not in cache and key not in lowered_here:
            jitted = jax.jit(
                unit_fn(group, opts),
                out_shardings=(sharding(args[0]), sharding(args[1]), sharding(args[2]),
                               sharding(args[3]), (replicated,) * len(group.layers)),
                donate_argnums=(0, 1, 3),
            )
            lowered_here[key] = jitted.lower(*args)
        units.append((key, lowered_here.get(key)))
    norms = {i: scalar(jnp.float32) for g in groups for i in g.layers}
    finish_lowered = jax.jit(finish, out_shardings=replicated).lower(
        _abstract_on(folded, replicated), scalar(jnp.bool_), norms
    )
    return LoweredStageUpdate(treedefs, groups, fold_lowered, units, finish_lowered, cache)


def _abstract_on(tree: Any, sharding: NamedSharding) -> Any:
    """Abstract ``tree`` with every leaf on ``sharding``."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)
