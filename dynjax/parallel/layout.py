"""Per-stage state trees keyed by name: splitting, joining and re-keying the training state.

A pipeline stage holds the parameter *units* of its layers (``("layers", 3)``), plus the
embedding on the first stage and the final norm and head on the last, as a sub-dict of the full
parameter dict with the same keys (``{"layers": {3: ...}}``). Its optimizer state is the
optimizer's state for that sub-dict, so every leaf of a stage's state sits at the same pytree
path as in the full state: splitting, joining and moving layers between stages is a re-keying by
path, never index arithmetic (STYLE.md habit 4). Scalars shared by all parameters (Adam's step
count) have one copy per stage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax

Unit = tuple  # ("embed",), ("pos",), ("layers", i), ("norm",), ("head",)
KeyPath = tuple  # a jax key path, e.g. (DictKey("params"), DictKey("layers"), DictKey(3), ...)


def select(params: Mapping[str, Any], units: Iterable[Unit]) -> dict[str, Any]:
    """The sub-dict of ``params`` holding ``units``, keyed as in ``params``."""
    out: dict[str, Any] = {}
    for unit in units:
        if unit[0] == "layers":
            out.setdefault("layers", {})[unit[1]] = params["layers"][unit[1]]
        else:
            out[unit[0]] = params[unit[0]]
    return out


def by_path(tree: Any) -> dict[KeyPath, Any]:
    """Every leaf of ``tree`` under its key path."""
    return dict(jax.tree_util.tree_flatten_with_path(tree)[0])


def fill(template: Any, values: Mapping[KeyPath, Any], partial: bool = False) -> Any:
    """``template``'s tree with each leaf taken from ``values`` at the same path (``partial``:
    None where ``values`` has none, a leaf that flattens away)."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    missing = [jax.tree_util.keystr(p) for p, _ in paths if p not in values]
    if missing and not partial:
        raise KeyError(f"no value for {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    return jax.tree_util.tree_unflatten(treedef, [values.get(p) for p, _ in paths])


def join(full_template: Any, stage_trees: Iterable[Any], partial: bool = False) -> Any:
    """The full tree from per-stage trees; a shared leaf comes from the first stage holding it.
    ``partial``: the trees of some stages only (a process's), None where none holds a leaf."""
    values: dict[KeyPath, Any] = {}
    for tree in stage_trees:
        for path, leaf in by_path(tree).items():
            values.setdefault(path, leaf)
    return fill(full_template, values, partial)


Move = Callable[[Any, int, int, Any], Any]  # (array, from stage, to stage, sharding) -> array


def relayout(
    old: Mapping[int, Any],
    new_templates: Mapping[int, Any],
    move: Move,
    local: Callable[[int], bool] = lambda stage: True,
) -> tuple[dict[int, Any], int]:
    """Re-key per-stage trees onto new stage templates; returns (new trees, bytes moved).

    A leaf a stage already holds stays where it is; any other leaf comes from the first old
    stage holding its path, through ``move`` (a copy: bit-for-bit). ``new_templates`` leaves
    carry the target ``sharding``. With stages over several processes, ``old`` and
    ``new_templates`` describe every stage (another process's old stage by its abstract
    leaves): every process then makes the same ``move`` calls in the same order (a transfer
    both ends take part in, None where the target is not ``local``) and gets the trees of its
    ``local`` stages.
    """
    old_paths = {s: by_path(tree) for s, tree in old.items()}
    moved_bytes, out = 0, {}
    for s in sorted(new_templates):
        values = {}
        for path, spec in by_path(new_templates[s]).items():
            if path in old_paths.get(s, {}):
                values[path] = old_paths[s][path]
                continue
            src = next((t for t, leaves in old_paths.items() if path in leaves), None)
            if src is None:
                raise KeyError(f"no stage holds {jax.tree_util.keystr(path)}")
            leaf = old_paths[src][path]
            values[path] = move(leaf, src, s, spec.sharding)
            moved_bytes += math.prod(leaf.shape) * jax.numpy.dtype(leaf.dtype).itemsize
        if local(s):
            out[s] = fill(new_templates[s], values)
    return out, moved_bytes


def layer_sizes(tree: Any, num_layers: int, *, nbytes: bool = False) -> list[int]:
    """[num_layers] elements (or bytes) of the leaves under ``["layers"][i]`` of ``tree``.

    On a parameter tree: each layer's parameter count (DeepSpeed's ``parameters`` cost); on the
    whole training state with ``nbytes``: what moving the layer to another stage copies.
    Works on arrays and on `jax.ShapeDtypeStruct`s.
    """
    sizes = [0] * num_layers
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [getattr(k, "key", None) for k in path]
        for a, b in zip(keys, keys[1:], strict=False):
            if a == "layers" and isinstance(b, int):
                n = math.prod(leaf.shape)
                sizes[b] += n * jax.numpy.dtype(leaf.dtype).itemsize if nbytes else n
                break
    return sizes


def layer_device_bytes(state: Any, num_layers: int) -> list[float]:
    """[num_layers] bytes one device holds of each layer's state (`jax.ShapeDtypeStruct`s with
    shardings, e.g. the abstract training state), with the embedding and positions counted in
    layer 0 and the final norm and head in the last layer: the stage that holds that layer
    holds them too. Scalars shared by all parameters (Adam's count) are left out."""
    sizes = [0.0] * num_layers
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = [getattr(k, "key", None) for k in path]
        pairs = zip(keys, keys[1:], strict=False)
        layer = next((b for a, b in pairs if a == "layers" and isinstance(b, int)), None)
        if layer is None:
            if "embed" in keys or "pos" in keys:
                layer = 0
            elif "norm" in keys or "head" in keys:
                layer = num_layers - 1
            else:
                continue
        shape = leaf.sharding.shard_shape(leaf.shape)
        sizes[layer] += math.prod(shape) * jax.numpy.dtype(leaf.dtype).itemsize
    return sizes
