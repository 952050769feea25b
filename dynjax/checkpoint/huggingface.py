"""Where each dynjax parameter lives in a Hugging Face checkpoint, read slice by slice.

Every leaf of the model's parameters is a concatenation of row ranges of Hugging Face tensors
(`Part`), transposed where HF stores ``[out, in]`` and dynjax (flax) ``[in, out]``: the fused
attention projection is each key/value group's query, key and value rows side by side
(`dynjax.model.attention.qkv_per_head`), a gated expert's ``w_in`` its gate then up rows. So a
device's slice of a leaf is read as the rows of the few tensors it covers
(`jax.make_array_from_callback` asks for exactly that slice), and no host ever holds a leaf it
does not place: a 7B model is never gathered (docs/models.md#hugging-face-checkpoints).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np

from dynjax.errors import ConfigError
from dynjax.model.gpt import GPTConfig

Path_ = tuple[Any, ...]  # a leaf's key path in the parameters, e.g. ("layers", 0, "mlp", ...)


@dataclasses.dataclass(frozen=True)
class Part:
    """Rows ``[start, stop)`` of the HF tensor ``name`` (a vector's entries); None: to the end."""

    name: str
    start: int = 0
    stop: int | None = None


@dataclasses.dataclass(frozen=True)
class Leaf:
    """How a dynjax leaf is made of HF tensors.

    ``linear``: ``[in, out]``, its columns the ``parts``' rows, transposed; ``vector``: its
    entries the parts' entries; ``plain``: one tensor as it is; ``stacked``: ``[E, in, out]``,
    expert ``e`` a linear leaf of ``experts[e]``."""

    kind: Literal["linear", "vector", "plain", "stacked"]
    parts: tuple[Part, ...] = ()
    experts: tuple[tuple[Part, ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class Layout:
    """What of the model decides the HF names: its sizes and options (from the dynjax config)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    moe_layers: tuple[int, ...]
    num_experts: int
    expert_style: Literal["mixtral", "qwen"]
    qkv_bias: bool
    qk_norm: str  # "none" | "head" | "full"
    shared_expert: bool
    shared_expert_gate: bool
    tied: bool  # the HF model ties lm_head to the embedding: the head is read from it


def leaves(layout: Layout) -> dict[Path_, Leaf]:
    """Every parameter of the model and where it lives in the HF checkpoint."""
    out: dict[Path_, Leaf] = {
        ("embed", "embedding"): Leaf("plain", (Part("model.embed_tokens.weight"),)),
        ("norm", "scale"): Leaf("vector", (Part("model.norm.weight"),)),
        ("head", "kernel"): Leaf(
            "linear", (Part("model.embed_tokens.weight" if layout.tied else "lm_head.weight"),)
        ),
    }
    for i in range(layout.num_layers):
        out.update({("layers", i, *k): v for k, v in _layer(layout, i).items()})
    return out


def _layer(layout: Layout, i: int) -> dict[Path_, Leaf]:
    p = f"model.layers.{i}."
    a = p + "self_attn."
    out = {
        ("norm1", "scale"): Leaf("vector", (Part(p + "input_layernorm.weight"),)),
        ("norm2", "scale"): Leaf("vector", (Part(p + "post_attention_layernorm.weight"),)),
        ("attn", "qkv", "kernel"): Leaf("linear", _qkv_parts(layout, a, "weight")),
        ("attn", "out", "kernel"): Leaf("linear", (Part(a + "o_proj.weight"),)),
    }
    if layout.qkv_bias:
        out["attn", "qkv", "bias"] = Leaf("vector", _qkv_parts(layout, a, "bias"))
    if layout.qk_norm != "none":
        out["attn", "q_norm", "scale"] = Leaf("vector", (Part(a + "q_norm.weight"),))
        out["attn", "k_norm", "scale"] = Leaf("vector", (Part(a + "k_norm.weight"),))
    if i not in layout.moe_layers:
        for name in ("gate", "up", "down"):
            out["mlp", name, "kernel"] = Leaf("linear", (Part(f"{p}mlp.{name}_proj.weight"),))
        return out
    mixtral = layout.expert_style == "mixtral"
    m = p + ("block_sparse_moe." if mixtral else "mlp.")
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    experts = range(layout.num_experts)
    out["moe", "router"] = Leaf("linear", (Part(m + "gate.weight"),))
    out["moe", "w_in"] = Leaf("stacked", experts=tuple(
        (Part(f"{m}experts.{e}.{gate}.weight"), Part(f"{m}experts.{e}.{up}.weight"))
        for e in experts
    ))
    out["moe", "w_out"] = Leaf(
        "stacked", experts=tuple((Part(f"{m}experts.{e}.{down}.weight"),) for e in experts)
    )
    if layout.shared_expert:
        for name in ("gate", "up", "down"):
            out["moe", "shared", name, "kernel"] = Leaf(
                "linear", (Part(f"{m}shared_expert.{name}_proj.weight"),)
            )
    if layout.shared_expert_gate:
        gate_weight = Part(m + "shared_expert_gate.weight")
        out["moe", "shared_gate"] = Leaf("linear", (gate_weight,))
    return out


def _qkv_parts(layout: Layout, prefix: str, what: str) -> tuple[Part, ...]:
    """One run per key/value head: its group's query heads, its key head, its value head."""
    g, dh = layout.num_heads // layout.num_kv_heads, layout.head_dim
    return tuple(
        part
        for j in range(layout.num_kv_heads)
        for part in (
            Part(f"{prefix}q_proj.{what}", j * g * dh, (j + 1) * g * dh),
            Part(f"{prefix}k_proj.{what}", j * dh, (j + 1) * dh),
            Part(f"{prefix}v_proj.{what}", j * dh, (j + 1) * dh),
        )
    )


class SafeTensors:
    """The tensors of a HF model directory (``model.safetensors`` or the shards its
    ``model.safetensors.index.json`` lists), opened lazily, read a slice at a time."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open  # the [hf] extra

        self._open = lambda f: safe_open(str(f), framework="numpy")
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: directory / f for name, f in weight_map.items()}
        elif (directory / "model.safetensors").is_file():
            with self._open(directory / "model.safetensors") as f:
                self.files = {name: directory / "model.safetensors" for name in f.keys()}
        else:
            raise ConfigError(
                f"{directory} holds no model.safetensors nor model.safetensors.index.json: "
                "give a Hugging Face model directory saved with safetensors"
            )
        self._handles: dict[Path, Any] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return np.asarray(self._slice(name)[index])

    def _slice(self, name: str) -> Any:
        if name not in self.files:
            raise ConfigError(f"the checkpoint has no tensor {name!r} that the model needs")
        f = self.files[name]
        if f not in self._handles:
            self._handles[f] = self._open(f).__enter__()
        return self._handles[f].get_slice(name)


def read_slice(
    leaf: Leaf, shape: tuple[int, ...], index: tuple[slice, ...], src: SafeTensors
) -> np.ndarray:
    """The part ``index`` of a leaf of ``shape``, read from ``src`` (only the rows it covers)."""
    index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape, strict=True))
    if leaf.kind == "plain":
        return src.read(leaf.parts[0].name, index)
    if leaf.kind == "stacked":
        experts = range(*index[0].indices(shape[0]))
        return np.stack([_columns(leaf.experts[e], index[1], index[2], src) for e in experts])
    if leaf.kind == "vector":
        return np.concatenate(list(_runs(leaf.parts, index[0], src, None)))
    return _columns(leaf.parts, index[0], index[1], src)


def _columns(parts: tuple[Part, ...], rows: slice, cols: slice, src: SafeTensors) -> np.ndarray:
    return np.concatenate([r.T for r in _runs(parts, cols, src, rows)], axis=1)


def _runs(
    parts: tuple[Part, ...], want: slice, src: SafeTensors, rows: slice | None
) -> Iterator[np.ndarray]:
    """The HF rows behind positions ``want`` of the concatenated parts (with columns
    ``rows``, the dynjax leaf's input rows, for a matrix)."""
    offset = 0
    for part in parts:
        stop = part.stop if part.stop is not None else src.shape(part.name)[0]
        size = stop - part.start
        lo, hi = max(want.start, offset), min(want.stop, offset + size)
        if lo < hi:
            first = part.start + lo - offset
            index = (slice(first, first + hi - lo),) + ((rows,) if rows is not None else ())
            yield src.read(part.name, index)
        offset += size


def layout_of(model: GPTConfig, hf: Mapping[str, Any]) -> Layout:
    """Where ``model``'s parameters are in a checkpoint of the HF config ``hf``."""
    return Layout(
        num_layers=model.num_layers,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads or model.num_heads,
        head_dim=model.d_model // model.num_heads,
        moe_layers=tuple(model.moe_layers),
        num_experts=model.num_experts,
        expert_style="mixtral" if hf.get("model_type") == "mixtral" else "qwen",
        qkv_bias=model.qkv_bias,
        qk_norm=model.qk_norm,
        shared_expert=bool(model.shared_expert_dim),
        shared_expert_gate=model.shared_expert_gate,
        tied=bool(hf.get("tie_word_embeddings", False)),
    )


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory).expanduser() / "config.json"
    if not path.is_file():
        raise ConfigError(f"{directory} has no config.json: give a Hugging Face model directory")
    return json.loads(path.read_text())


def initial_params(model: GPTConfig, source: str, abstract: Any) -> Any:
    """``train.init_from``'s weights as ``abstract``'s arrays (shapes and shardings), each
    device reading its own slice; the config must be the directory's (`dynjax_overrides`)."""
    hf = read_hf_config(source)
    return load_params(abstract, layout_of(model, hf), SafeTensors(Path(source).expanduser()))


def load_params(
    abstract: Any, layout: Layout, src: SafeTensors, dtype: Any = None
) -> Any:
    """``abstract`` (the parameters' ``ShapeDtypeStruct``s with shardings) filled from ``src``:
    each device reads its own slice."""
    table = leaves(layout)
    flat, tree = jax.tree_util.tree_flatten_with_path(abstract)
    missing = [p for p, _ in flat if _key(p) not in table]
    if missing:
        raise ConfigError(
            "the model has parameters no Hugging Face tensor gives: "
            + ", ".join(jax.tree_util.keystr(p) for p in missing[:4])
        )
    arrays = []
    for path, a in flat:
        leaf = table[_key(path)]
        _check_shape(leaf, a.shape, src, path)
        read = lambda index, leaf=leaf, a=a: read_slice(leaf, a.shape, index, src).astype(
            dtype or a.dtype
        )
        arrays.append(jax.make_array_from_callback(a.shape, a.sharding, read))
    return jax.tree_util.tree_unflatten(tree, arrays)


def to_hf(params: Any, layout: Layout) -> dict[str, np.ndarray]:
    """The host parameters as the HF tensors they came from (the inverse of `read_slice` over
    whole leaves). A tied model's head is written as ``lm_head.weight``."""
    table = leaves(dataclasses.replace(layout, tied=False))
    pieces: dict[str, list[tuple[int, np.ndarray]]] = {}
    for path, value in jax.tree_util.tree_flatten_with_path(params)[0]:
        leaf, value = table[_key(path)], np.asarray(value)
        if leaf.kind == "plain":
            pieces.setdefault(leaf.parts[0].name, []).append((0, value))
        elif leaf.kind == "stacked":
            for e, parts in enumerate(leaf.experts):
                _split(parts, value[e].T, pieces)
        else:
            _split(leaf.parts, value.T if leaf.kind == "linear" else value, pieces)
    return {
        name: np.concatenate([v for _, v in sorted(runs, key=lambda r: r[0])])
        for name, runs in pieces.items()
    }


def _split(parts: tuple[Part, ...], rows: np.ndarray, pieces: dict) -> None:
    """``rows`` cut into ``parts``; parts to their tensor's end share what the others leave
    equally (a gated expert's gate and up)."""
    fixed = sum(p.stop - p.start for p in parts if p.stop is not None)
    open_ended = sum(p.stop is None for p in parts)
    offset = 0
    for part in parts:
        if part.stop is not None:
            size = part.stop - part.start
        else:
            size = (rows.shape[0] - fixed) // open_ended
        pieces.setdefault(part.name, []).append((part.start, rows[offset : offset + size]))
        offset += size


def _check_shape(leaf: Leaf, shape: tuple[int, ...], src: SafeTensors, path: Any) -> None:
    parts = leaf.experts[0] if leaf.kind == "stacked" else leaf.parts
    rows = sum(((p.stop if p.stop is not None else src.shape(p.name)[0]) - p.start) for p in parts)
    other = {"linear": 0, "stacked": 1}.get(leaf.kind)
    cols = src.shape(parts[0].name)[1] if other is not None else None
    if rows != shape[-1 if other is not None else 0] or (
        other is not None and cols != shape[other]
    ):
        raise ConfigError(
            f"{jax.tree_util.keystr(path)} has shape {shape} but the checkpoint's "
            f"{parts[0].name} gives {rows} x {cols}: the config.json does not describe these "
            "weights"
        )


def _key(path: Any) -> Path_:
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
