"""How training state is laid out in a checkpoint: one item for dense state, one per expert.

Parameters and optimizer state are flattened to ``"/"``-joined path keys. Leaves of stacked expert
weights (``.../moe/w_in`` [E, ...], including their Adam moments) are cut into one item per
(layer, expert) so that a later partial checkpoint can save and restore any subset of experts
(MoC-System, seed 004 §4); everything else is the ``dense`` item.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

import jax
import numpy as np

from dynjax.parallel import is_expert_param

DENSE = "dense"
_EXPERT_ITEM = re.compile(r"^expert_l(\d+)_e(\d+)$")


def key_of(path: tuple) -> str:
    """A stable string for a pytree path: ``params/layers/1/moe/w_in``."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return "/".join(parts)


def flatten(tree: Any) -> dict[str, Any]:
    return {key_of(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def unflatten_like(template: Any, flat: dict[str, Any]) -> Any:
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    return jax.tree_util.tree_unflatten(treedef, [flat[key_of(p)] for p, _ in paths])


def expert_item(layer: int, expert: int) -> str:
    return f"expert_l{layer}_e{expert}"


def parse_expert_item(name: str) -> tuple[int, int] | None:
    match = _EXPERT_ITEM.match(name)
    return (int(match[1]), int(match[2])) if match else None


def _expert_layer(path: tuple) -> int | None:
    """Model layer index of an expert leaf (the key after ``layers``), else None."""
    if not is_expert_param(path):
        return None
    keys = key_of(path).split("/")
    return int(keys[keys.index("layers") + 1])


def split_items(tree: Any) -> dict[str, dict[str, np.ndarray]]:
    """Host arrays of ``tree`` grouped into checkpoint items (``dense`` and one per expert)."""
    items: dict[str, dict[str, np.ndarray]] = {DENSE: {}}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        layer, arr = _expert_layer(path), np.asarray(leaf)
        if layer is None:
            items[DENSE][key_of(path)] = arr
            continue
        for e in range(arr.shape[0]):
            items.setdefault(expert_item(layer, e), {})[key_of(path)] = arr[e]
    return items


def join_items(template: Any, items: dict[str, dict[str, np.ndarray]]) -> Any:
    """Inverse of :func:`split_items`: stack expert slices back and rebuild ``template``'s tree."""
    flat: dict[str, np.ndarray] = dict(items[DENSE])
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, item in items.items():
        parsed = parse_expert_item(name)
        if parsed is None:
            continue
        for key, arr in item.items():
            stacks.setdefault(key, {})[parsed[1]] = arr
    for key, by_expert in stacks.items():
        flat[key] = np.stack([by_expert[e] for e in range(len(by_expert))])
    return unflatten_like(template, flat)


def checksum(arr: np.ndarray) -> str:
    """Adler-32 of the bytes plus shape and dtype: cheap, and catches torn or swapped data."""
    arr = np.ascontiguousarray(arr)
    return f"{arr.dtype}{list(arr.shape)}:{zlib.adler32(arr.tobytes()):08x}"


def checksums(items: dict[str, dict[str, np.ndarray]]) -> dict[str, dict[str, str]]:
    return {name: {k: checksum(v) for k, v in item.items()} for name, item in items.items()}


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}`` (Orbax stores nested dicts of arrays)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def denest(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(denest(v, key + "/"))
        else:
            out[key] = v
    return out
