"""Per-layer static options and the block hooks that read them (DESIGN.md "Dynamism plugins").

A dynamism plugin gives each layer a frozen record (its *layer options*, computed once per
Plan); a `Block` receives the records of all plugins as `LayerOptions` and runs the hook
registered under each record's name on its output. A hook may change the block's output and
returns named metrics, which the steps fold generically by the reduction registered with
them. Schemes that change the inside of a block (e.g. sparse matmuls) read their record there
instead; their metrics still go through `metric_reductions`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

# (plugin name, its per-layer record), sorted by name; hashable, so specs that hold it key
# the compile cache.
LayerOptions = tuple[tuple[str, Any], ...]
BlockHook = Callable[[jax.Array, Any], tuple[jax.Array, dict[str, jax.Array]]]
REDUCTIONS = ("mean", "sum", "rows")  # over microbatches: average, add, or rows in batch order

_HOOKS: dict[str, BlockHook] = {}
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
