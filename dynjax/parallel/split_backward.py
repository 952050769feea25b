"""ZB-H1's split backward: a stage's backward cut into ``B`` (the input gradient) and ``W``.

Zero-bubble pipelining (Qi et al. 2024 §2, not in the seeds) runs a backward as two tasks: ``B``
computes what the previous stage waits for (the input gradient), ``W`` the weight gradients,
later, in the pipeline's bubbles. It only pays if ``W`` reuses what ``B`` computed: a weight
gradient ``x^T dy`` needs the cotangent ``dy`` of its matmul's output, which the input-gradient
chain produces; differentiating twice (once for the input, once for the weights) would run that
chain in both.

So the cut is made in the backward's program, not in the model: the backward is traced once to
a jaxpr and its equations are split. ``B`` gets every equation the input gradient (and the last
stage's metrics) depends on, ``W`` the rest of what the weight gradients depend on (the weight
matmuls and their accumulation). The values ``W`` reads that ``B`` computes (the cotangents and
recomputed activations the weight matmuls consume) are ``B``'s extra outputs, the *boundary*,
kept for ``W`` like a forward's residuals. Nothing is computed twice. An equation with a nested
program (a scanned stack, a rematerialised block, a kernel's custom gradient) is cut as a whole:
if the input gradient needs it, all of it runs in ``B``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
from jax.sharding import Mesh

from dynjax.parallel.residuals import residual_shapes
from dynjax.parallel.stage import add_weight_grads, done_with
from dynjax.parallel.stages import StageSpec


@dataclasses.dataclass(frozen=True, eq=False)
class SplitBackward:
    """A function of flat inputs cut in two: ``b(*inputs) -> (b_outputs, boundary)`` and
    ``w(*read, *boundary) -> w_outputs`` (flat lists), where ``read`` are the inputs at the
    indices ``w_reads`` (what W reads of them: the rest can be freed once B ran)."""

    b: Callable[..., tuple[list[Any], list[Any]]]
    w: Callable[..., list[Any]]
    w_reads: tuple[int, ...]
    boundary: tuple[jax.ShapeDtypeStruct, ...]


def split_backward(
    fn: Callable[..., Any], args: Sequence[Any], for_b: Callable[[Any], Sequence[bool]]
) -> tuple[SplitBackward, Any]:
    """Trace ``fn(*args)`` and cut it: ``for_b(output_tree)`` marks, per flat output of ``fn``,
    those ``B`` computes; ``W`` computes the others. Returns the split and ``fn``'s output
    tree (abstract)."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    outs_b = list(for_b(out_shape))
    if len(outs_b) != len(jax.tree.leaves(out_shape)):
        raise ValueError("for_b must mark every flat output of fn")
    return _cut(closed, outs_b), out_shape


def _cut(closed: jcore.ClosedJaxpr, outs_b: Sequence[bool]) -> SplitBackward:
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    b_out = [v for v, b in zip(jaxpr.outvars, outs_b, strict=True) if b]
    w_out = [v for v, b in zip(jaxpr.outvars, outs_b, strict=True) if not b]
    # Effects run once: in B, or in W where B computes nothing (a stage passing nothing back).
    in_b = _needed(eqns, b_out, keep_effects=bool(b_out))
    for_w = _needed(eqns, w_out, keep_effects=not b_out)
    in_w = [w and not b for w, b in zip(for_w, in_b, strict=True)]
    w_eqns = [e for e, w in zip(eqns, in_w, strict=True) if w]
    read = _read(w_eqns, w_out)  # every variable W reads, in order of first use
    made_in_b = {v for e, b in zip(eqns, in_b, strict=True) if b for v in e.outvars}
    cut = [v for v in read if v in made_in_b]
    w_reads = tuple(i for i, v in enumerate(jaxpr.invars) if v in read)
    b_eqns = [e for e, b in zip(eqns, in_b, strict=True) if b]
    b_jaxpr = _jaxpr("B", jaxpr.constvars, jaxpr.invars, b_out + cut, b_eqns)
    w_in = [jaxpr.invars[i] for i in w_reads] + cut
    w_jaxpr = _jaxpr("W", jaxpr.constvars, w_in, w_out, w_eqns)
    run_b = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(b_jaxpr, closed.consts))
    run_w = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(w_jaxpr, closed.consts))

    def b(*inputs):
        outs = run_b(*inputs)
        return list(outs[: len(b_out)]), list(outs[len(b_out) :])

    def w(*inputs):
        return list(run_w(*inputs))

    shapes = tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in cut)
    return SplitBackward(b, w, w_reads, shapes)


def _read(eqns: Sequence[jcore.JaxprEqn], outs: Sequence[Any]) -> dict[jcore.Var, None]:
    """The variables ``eqns`` and ``outs`` read (ordered: first use first)."""
    read: dict[jcore.Var, None] = {}
    for v in [*(v for e in eqns for v in e.invars), *outs]:
        if isinstance(v, jcore.Var):
            read.setdefault(v)
    return read


def _needed(
    eqns: Sequence[jcore.JaxprEqn], outs: Sequence[Any], keep_effects: bool
) -> list[bool]:
    """Per equation, whether ``outs`` depend on it or (with ``keep_effects``) it has effects."""
    need = {v for v in outs if isinstance(v, jcore.Var)}
    keep = [False] * len(eqns)
    for i in range(len(eqns) - 1, -1, -1):
        e = eqns[i]
        if any(v in need for v in e.outvars if not isinstance(v, jcore.DropVar)) or (
            keep_effects and e.effects
        ):
            keep[i] = True
            need.update(v for v in e.invars if isinstance(v, jcore.Var))
    return keep


def _jaxpr(
    part: str,
    constvars: Sequence[jcore.Var],
    invars: Sequence[jcore.Var],
    outvars: Sequence[Any],
    eqns: Sequence[jcore.JaxprEqn],
) -> jcore.Jaxpr:
    effects = frozenset().union(*(e.effects for e in eqns))
    info = jcore.DebugInfo("split_backward", part, None, None)
    return jcore.Jaxpr(constvars, invars, outvars, eqns, effects, info)


@dataclasses.dataclass(frozen=True, eq=False)
class StageSplit:
    """A stage's backward cut for ZB-H1: the cut, the trees of its two parts' outputs, the
    boundary ``B`` keeps for ``W`` with the shardings ``B`` returns it in, and how many of the
    cut's flat inputs are parameters (the rest are a microbatch's: `kept_for_w`)."""

    cut: SplitBackward
    weights: Any  # treedef of W's outputs: (the units' gradients, the read readout's)
    inputs: Any  # treedef of B's outputs: (the input gradient or None, the metrics or None)
    boundary: tuple[jax.ShapeDtypeStruct, ...]
    params_leaves: int

    def kept_for_w(self, microbatch: tuple) -> tuple:
        """The leaves of a microbatch's backward inputs ``(x, ctx, stored, seed, batch_in)``
        that ``W`` reads: all a stage keeps of them (with the boundary) after its ``B``."""
        leaves = jax.tree.leaves(microbatch)
        return tuple(leaves[i - self.params_leaves] for i in self.cut.w_reads
                     if i >= self.params_leaves)


def split_stage(
    spec: StageSpec, gradients: Callable[..., Any], args: tuple, mesh: Mesh
) -> StageSplit:
    """Cut ``gradients(params, x, ctx, stored, seed, batch_in) -> (grads, metrics)`` (a stage's
    backward before accumulating, `stage.gradients_fn`) at ``args`` (abstract, sharded)."""

    def parts(*a):
        grads, metrics = gradients(*a)
        return grads[:2], (grads[2] if spec.input_grads else None, metrics)

    def for_b(out):
        return [False] * len(jax.tree.leaves(out[0])) + [True] * len(jax.tree.leaves(out[1]))

    cut, out = split_backward(parts, args, for_b)
    rows = args[1].shape[0]  # the stage input's microbatch rows
    boundary = residual_shapes(cut.boundary, mesh, rows)
    return StageSplit(
        cut, jax.tree.structure(out[0]), jax.tree.structure(out[1]), boundary,
        len(jax.tree.leaves(args[0])),
    )


def input_grad_fn(spec: StageSpec, split: StageSplit):
    """``bwd_b(params, x, ctx, stored, seed, batch_in) -> (g_x, boundary, [metrics])``: ``B``,
    the input gradient and the last stage's metrics, and what ``W`` reads of its work. A stage
    that passes no gradient back and is not the last has no ``B`` program (its ``W`` is its
    whole backward)."""

    def bwd_b(params, x, ctx, stored, seed, batch_in):
        outs, boundary = split.cut.b(*jax.tree.leaves((params, x, ctx, stored, seed, batch_in)))
        g_x, metrics = jax.tree.unflatten(split.inputs, outs)
        g_x = jnp.zeros((), jnp.float32) if g_x is None else g_x  # nothing passed back
        return (g_x, tuple(boundary)) + ((metrics,) if spec.last else ())

    return bwd_b


def weight_grad_fn(split: StageSplit):
    """``bwd_w(params, acc, racc, kept, boundary) -> (acc, done, racc)``: ``W``, the weight
    gradients added to the accumulators (``kept``: `StageSplit.kept_for_w` of the microbatch;
    ``done``: a scalar ready with them, `stage.done_with`)."""

    def bwd_w(params, acc, racc, kept, boundary):
        flat, held = jax.tree.leaves(params), iter(kept)
        reads = [flat[i] if i < split.params_leaves else next(held) for i in split.cut.w_reads]
        grads = jax.tree.unflatten(split.weights, split.cut.w(*reads, *boundary))
        acc, racc = add_weight_grads(acc, racc, grads)
        return acc, done_with(acc), racc

    return bwd_w
