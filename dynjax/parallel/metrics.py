"""The one metric folder of both runtimes: a step's metrics, folded by declared reductions.

Every metric a step reports is named, and its name says how it folds: over the microbatches of
a step (`fold_microbatches`, inside the compiled programs) and over the stages of a pipeline
(`fold_stages`, on the host). The step's own metrics declare theirs in `STEP_REDUCTIONS`, a hook
set's step metrics (its stage loss's) in its `HookSet.step_metrics`; a block hook's metric (per
layer) declares its microbatch reduction in its `HookSet` and folds over stages by
concatenating layers, since stages hold consecutive layers. What follows from the folded
metrics of the whole model (`HookSet.derived`) is computed after the fold. So the single
program (one stage, the whole batch) and the pipeline (per stage, per microbatch) fold with the
same code and report the same values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dynjax.model.hooks import NO_HOOKS, Hooks

# name -> (over microbatches, over stages). Over microbatches: "mean", "sum", or "rows" back in
# batch order (`hooks.REDUCTIONS`); over stages: "last" (the stage holding the loss), "first"
# (equal on every stage), "sum", or "layers" (concatenated in layer order).
STEP_REDUCTIONS: dict[str, tuple[str, str]] = {
    "loss": ("mean", "last"),
    "grad_norm": ("mean", "first"),  # the global norm: every stage computes it
    "layer_grad_norm": ("mean", "layers"),  # [L]
    "skipped": ("mean", "first"),  # 1: the update was skipped (non-finite norm, every stage)
}


def stack_layers(layer_metrics: Sequence[Mapping[str, jax.Array]]) -> dict[str, jax.Array]:
    """Each hook metric stacked over the layers that report it, in layer order: [Lr, ...]."""
    names = sorted({name for m in layer_metrics for name in m})
    return {n: jnp.stack([m[n] for m in layer_metrics if n in m]) for n in names}


def step_reductions(hooks: Hooks) -> dict[str, tuple[str, str]]:
    """The step metrics' reductions: the step's own and the hook sets'."""
    return {**hooks.step_metrics, **STEP_REDUCTIONS}


def reduction(name: str, hooks: Hooks) -> str:
    """How metric ``name`` folds over microbatches."""
    step = step_reductions(hooks)
    return step[name][0] if name in step else hooks.reduction(name)


def fold_stacked(stacked: Mapping[str, jax.Array], hooks: Hooks) -> dict[str, jax.Array]:
    """Metrics stacked over microbatches ([M, ...] each) -> the step's, by each metric's
    reduction: "mean" and "sum" over microbatches, "rows" back in batch order (microbatch j
    holds rows j, j+M, ... of the batch, as `step._split_microbatches` cuts them)."""
    out = {}
    for name, a in stacked.items():
        kind = reduction(name, hooks)
        if kind == "rows":
            moved = jnp.moveaxis(a, 0, 2)  # [L, b, M, ...]
            out[name] = moved.reshape(moved.shape[0], -1, *moved.shape[3:])
        else:
            out[name] = jnp.sum(a, 0) if kind == "sum" else jnp.mean(a, 0)
    return out


def fold_microbatches(
    per_microbatch: Sequence[Mapping[str, jax.Array]], hooks: Hooks
) -> dict[str, jax.Array]:
    """`fold_stacked` of one metrics dict per microbatch."""
    names = per_microbatch[0]
    return fold_stacked({n: jnp.stack([mb[n] for mb in per_microbatch]) for n in names}, hooks)


def hook_metrics(metrics: Mapping[str, Any], hooks: Hooks = NO_HOOKS) -> dict[str, Any]:
    """The block hooks' metrics among a step's (what the state rules read)."""
    step = step_reductions(hooks)
    return {k: v for k, v in metrics.items() if k not in step}


def fold_stages(stages: Sequence[Mapping[str, np.ndarray]], hooks: Hooks) -> dict[str, Any]:
    """Host copies of every stage's step metrics, in stage order -> the single program's,
    with what the hook sets derive from them (`Hooks.derived`)."""
    f32 = np.float32
    step = step_reductions(hooks)
    out: dict[str, Any] = {}
    for name in sorted({n for s in stages for n in s}):
        kind = step[name][1] if name in step else "layers"
        have = [s[name] for s in stages if name in s]
        if kind == "last":
            out[name] = stages[-1][name]
        elif kind == "first":
            out[name] = stages[0][name]
        elif kind == "sum":
            out[name] = f32(sum(f32(a) for a in have))
        else:
            out[name] = np.concatenate(have)
    return {**out, **hooks.derived(out, np)}
