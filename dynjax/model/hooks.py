"""Per-layer static options and the block hooks that read them (DESIGN.md "Dynamism plugins").

A dynamism plugin gives each layer a frozen record (its *layer options*, computed once per
Plan); a `Block` receives the records of all plugins as `LayerOptions` and runs the hook
registered under each record's name on its output. A hook may change the block's output and
returns named metrics, which the steps fold generically by the reduction registered with
them. A *weight hook* runs before the block instead, on the block's parameters (e.g. pruning
masks the gradients of its pruned weights and reports their density). Schemes that change the
inside of a block (e.g. sparse matmuls) read their record there; their metrics still go
through `register_metrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx

# (plugin name, its per-layer record), sorted by name; hashable, so specs that hold it key
# the compile cache.
LayerOptions = tuple[tuple[str, Any], ...]
BlockHook = Callable[[jax.Array, Any], tuple[jax.Array, dict[str, jax.Array]]]
REDUCTIONS = ("mean", "sum", "rows")  # over microbatches: average, add, or rows in batch order

# (the block's weights by "/"-joined path inside it, record) -> (replaced weights, metrics)
WeightHook = Callable[[dict[str, jax.Array], Any], tuple[dict[str, jax.Array], dict]]

_HOOKS: dict[str, BlockHook] = {}
_WEIGHT_HOOKS: dict[str, WeightHook] = {}
_REDUCTIONS: dict[str, str] = {}


def layer_options(records: Mapping[str, Any]) -> LayerOptions:
    """``{plugin: record}`` -> `LayerOptions` (records of None are left out)."""
    return tuple(sorted((k, v) for k, v in records.items() if v is not None))


def register_block_hook(
    name: str, hook: BlockHook, metrics: Mapping[str, str] | None = None
) -> None:
    """Run ``hook(block_output, record)`` on every layer whose options hold a record ``name``;
    it returns ``(output, metrics)``, metrics named ``"<name>/<metric>"``. ``metrics`` gives
    each metric's reduction over microbatches (`REDUCTIONS`)."""
    _HOOKS[name] = hook
    register_metrics(metrics or {})


def register_weight_hook(
    name: str, hook: WeightHook, metrics: Mapping[str, str] | None = None
) -> None:
    """Run ``hook(weights, record)`` before every block whose options hold a record ``name``:
    ``weights`` maps the block's parameter paths (``"attn/qkv/kernel"``, ``"moe/w_in"``) to
    arrays; it returns ``(replacements, metrics)``, the block then runs with the replaced
    weights (what it does to them is part of the differentiated forward)."""
    _WEIGHT_HOOKS[name] = hook
    register_metrics(metrics or {})


def register_metrics(metrics: Mapping[str, str]) -> None:
    """Declare how per-layer metrics fold over microbatches (default: "mean")."""
    bad = {k: v for k, v in metrics.items() if v not in REDUCTIONS}
    if bad:
        raise ValueError(f"unknown reductions {bad}: use one of {REDUCTIONS}")
    _REDUCTIONS.update(metrics)


def reduction(metric: str) -> str:
    return _REDUCTIONS.get(metric, "mean")


def apply_block_hooks(x: jax.Array, options: LayerOptions) -> tuple[jax.Array, dict]:
    """The block output after every hook its options name, and the hooks' metrics."""
    metrics: dict[str, jax.Array] = {}
    for name, record in options:
        hook = _HOOKS.get(name)
        if hook is None:
            continue
        x, out = hook(x, record)
        metrics.update(out)
    return x, metrics


def apply_weight_hooks(block: nnx.Module, options: LayerOptions) -> tuple[nnx.Module, dict]:
    """A copy of ``block`` whose weights went through every weight hook its options name
    (``block`` itself when none does), and the hooks' metrics."""
    hooked = [(_WEIGHT_HOOKS[name], record) for name, record in options if name in _WEIGHT_HOOKS]
    if not hooked:
        return block, {}
    graphdef, state = nnx.split(block)
    paths, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
    names = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in paths]
    weights = dict(zip(names, (leaf for _, leaf in paths), strict=True))
    metrics: dict[str, jax.Array] = {}
    for hook, record in hooked:
        replaced, out = hook(dict(weights), record)
        weights.update(replaced)
        metrics.update(out)
    pure = jax.tree_util.tree_unflatten(treedef, [weights[n] for n in names])
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state), metrics
