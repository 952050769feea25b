"""How training state is laid out in a checkpoint: three items, whatever the layers x rows
(layout 2, since issue 15 §2; docs/checkpointing.md "What a checkpoint holds").

- ``dense``: every leaf that is not row-stacked (`rows.RowStacks`), under its ``"/"``-joined
  path (``params/layers/1/attn/qkv/kernel``, ``opt_state/1/0/mu/...``);
- `rows.ROWS_ITEM`: every row-stacked leaf (stacked expert weights [E, ...], with their Adam
  moments and pruning masks) as the state holds it, stored one chunk per row, so any subset of
  rows of any stack restores alone (`read_rows`);
- ``meta``: JSON: step, Plan, config, ``layout`` (2), ``qkv_columns`` and the checksums.

``qkv_columns`` (`QKV_COLUMNS`) says the fused attention projection's columns are stored per
head; a checkpoint without it is reordered as it is restored (`read.qkv_columns_per_head`). A
partial save (seed 004 §3) writes the chosen rows only ([K, ...], `take_rows`) and records
which in ``meta`` (`rows.ROWS_META`, `held_rows`); `rows.row_group` says whether a leaf is a
row's weights or its optimizer state (PEC_W / PEC_O). `checksums`: two position-weighted sums
of each array's 32-bit words mod 2^32 (per row for row-stacked arrays), reduced on the devices
and independent of the sharding (docs/checkpointing.md "Checksums"). Layout 1 (before issue
15: an item per (stack, row), `rows.V1_ROW_NAME`, host Adler-32) still restores
(`read_layout1`).
"""

from __future__ import annotations

import functools
import json
import re
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from dynjax.checkpoint.rows import ROWS_ITEM, ROWS_META, V1_ROW_ITEM, V1_ROW_NAME, RowStacks

LAYOUT = 2
QKV_COLUMNS = "per head"  # meta["qkv_columns"]: the fused projection's columns, per head
QKV_LEAVES = ("attn/qkv/kernel", "attn/qkv/bias")  # with their Adam moments and pruning masks
DENSE, ROWS = "dense", ROWS_ITEM
_V1_ROW_ITEM = re.compile(V1_ROW_ITEM)


def key_of(path: tuple) -> str:
    """A stable string for a pytree path: ``params/layers/1/attn/qkv/kernel``."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return "/".join(parts)


def flatten(tree: Any) -> dict[str, Any]:
    return {key_of(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def unflatten_like(template: Any, flat: Mapping[str, Any]) -> Any:
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    return jax.tree_util.tree_unflatten(treedef, [flat[key_of(p)] for p, _ in paths])


def split(tree: Any, rows: RowStacks) -> dict[str, dict[str, Any]]:
    """The leaves of ``tree`` (arrays or ShapeDtypeStructs) as the `DENSE` and `ROWS` items,
    each ``{key: leaf}``; ``rows`` says which leaves are row-stacked."""
    items: dict[str, dict[str, Any]] = {DENSE: {}, ROWS: {}}
    for key, leaf in flatten(tree).items():
        items[ROWS if rows.stacked(key) else DENSE][key] = leaf
    return items


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}`` (Orbax stores nested dicts of arrays)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def denest(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(denest(v, key + "/"))
        else:
            out[key] = v
    return out


# -- checksums on device ---------------------------------------------------------------------

_GOLDEN = np.uint32(0x9E3779B9)


def _words(x: jax.Array) -> jax.Array:
    """The array's bits as uint32 words of its own shape (8-byte dtypes add a trailing 2)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _sums(x: jax.Array, rows: bool) -> jax.Array:
    """[2] (or [rows, 2]) position-weighted uint32 sums of ``x``'s words (module docstring)."""
    w = _words(x)
    inner = w.shape[1:] if rows else w.shape
    idx = jnp.arange(int(np.prod(inner)), dtype=jnp.uint32).reshape(inner)
    axes = tuple(range(1 if rows else 0, w.ndim))
    s1 = jnp.sum(w * (2 * idx + 1), axis=axes, dtype=jnp.uint32)
    s2 = jnp.sum(w * ((idx * _GOLDEN) | 1), axis=axes, dtype=jnp.uint32)
    return jnp.stack([s1, s2], axis=-1)


@functools.cache
def _sums_to(out: jax.sharding.Sharding, rows: bool) -> Any:
    """`_sums` jitted with its sums replicated on ``out``'s devices: in a multi-process run
    every process then reads the same sums of the global arrays from a device of its own."""
    return jax.jit(functools.partial(_sums, rows=rows), out_shardings=out)


def _replicated_on(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """A sharding replicating over ``sharding``'s devices."""
    mesh = getattr(sharding, "mesh", None)
    if not isinstance(mesh, jax.sharding.Mesh):
        mesh = jax.sharding.Mesh(np.array(sorted(sharding.device_set, key=lambda d: d.id)), ("d",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def describe_shape(dtype: Any, shape: tuple[int, ...]) -> str:
    """``"float32[4, 8]"``: how every checksum begins."""
    return f"{np.dtype(dtype)}{list(shape)}"


def _describe(dtype: Any, shape: tuple[int, ...], words: np.ndarray) -> str:
    return f"{describe_shape(dtype, shape)}:{int(words[0]):08x}{int(words[1]):08x}"


def shapes(flat: Mapping[str, Any], rows: RowStacks) -> dict[str, str]:
    """Per key ``"<dtype>[shape]"`` as its checksum begins (a row-stacked leaf: of one row), to
    tell from the metadata alone whether a checkpoint fits a model."""
    return {
        k: describe_shape(a.dtype, a.shape[1:] if rows.stacked(k) else a.shape)
        for k, a in flat.items()
    }


def checksums(flat: Mapping[str, jax.Array], rows: RowStacks) -> dict[str, str | list[str]]:
    """Per key: ``"<dtype>[shape]:<sums>"``; for row-stacked leaves one such string per row.

    One jitted reduction per leaf, on the devices holding it, each device reducing the shards
    it holds; only the sums are copied to host. One program per leaf, not one for all: the
    reductions' temporaries then never exceed one leaf's (one program over a 1B-parameter
    state held about 1.3x the state in temporaries). The sums are replicated over the leaf's
    devices, so in a multi-process run every process gets the same values for the global
    arrays (the metadata that process 0 writes is every process's).
    """
    out: dict[str, str | list[str]] = {}
    for key, a in flat.items():
        a = a if isinstance(a, jax.Array) else jnp.asarray(a)
        # Each leaf's sums read before the next is dispatched: XLA:CPU aborted on many of these
        # small programs' cross-device reductions in flight at once.
        got = jax.device_get(_sums_to(_replicated_on(a.sharding), rows.stacked(key))(a))
        if rows.stacked(key):
            out[key] = [_describe(a.dtype, a.shape[1:], row) for row in got]
        else:
            out[key] = _describe(a.dtype, a.shape, got)
    return out


def _row_sharding(sharding: jax.sharding.Sharding, rows: int) -> jax.sharding.Sharding:
    """Where ``rows`` rows cut from an array in ``sharding`` go: the same spec when the
    leading axis's mesh axes still divide them (each device keeps its own rows), else that
    axis replicated; the other axes (data, tensor) stay split."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    spec = list(sharding.spec) or [None]
    lead = spec[0]
    names = lead if isinstance(lead, tuple) else (lead,) if lead is not None else ()
    if rows % int(np.prod([sharding.mesh.shape[n] for n in names])):
        spec[0] = None
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


@functools.partial(jax.jit, static_argnums=2)
def _take(a: jax.Array, idx: jax.Array, out: jax.sharding.Sharding) -> jax.Array:
    return jax.lax.with_sharding_constraint(a[idx], out)


def take_rows(a: jax.Array, rows: Sequence[int], *, everywhere: bool = False) -> jax.Array:
    """Rows ``rows`` of a row-stacked array, [len(rows), ...], gathered on the devices that
    hold them (no host copy of the whole array); ``everywhere``: replicated over them, so that
    every process of a program over several can read the rows whole."""
    out = _replicated_on(a.sharding) if everywhere else _row_sharding(a.sharding, len(rows))
    return _take(a, jnp.asarray(rows, jnp.int32), out)


def held_rows(meta: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Per row-stacked leaf, the rows (ascending) a layout-2 checkpoint holds, in the order its
    stored array holds them; a checkpoint written before partial saves holds all rows. Empty
    for other layouts."""
    if meta.get("layout") != LAYOUT:
        return {}
    recorded = meta.get(ROWS_META)
    if recorded is not None:
        return {k: tuple(v["rows"]) for k, v in recorded.items()}
    sums = meta.get("checksums", {})
    return {k: tuple(range(len(v))) for k, v in sums.items() if isinstance(v, list)}


def row_count(meta: Mapping[str, Any], key: str) -> int:
    """Rows of the row-stacked leaf ``key`` in a layout-2 checkpoint (its stored array may hold
    fewer)."""
    recorded = meta.get(ROWS_META)
    if recorded is not None:
        return int(recorded[key]["of"])
    return len(meta["checksums"][key])


def read_rows(item_dir: Path, key: str, rows: Sequence[int]) -> np.ndarray:
    """Rows ``rows`` of the array ``key`` of an Orbax item, [len(rows), ...], read through
    tensorstore from Orbax's own spec of that array: only the chunks holding those rows are
    read (one chunk per row in `ROWS`)."""
    return np.asarray(_open_array(item_dir, key)[list(rows)].read().result())


def read_array(item_dir: Path, key: str) -> np.ndarray:
    """The whole array ``key`` of an Orbax item (`read_rows`' way), as a host array."""
    return np.asarray(_open_array(item_dir, key).read().result())


def _open_array(item_dir: Path, key: str) -> ts.TensorStore:
    stored = json.loads((item_dir / "_METADATA").read_text())
    context = ocp.type_handlers.get_ts_context(use_ocdbt=stored["use_ocdbt"])
    info = ocp.type_handlers.ParamInfo(
        name=key.replace("/", "."),
        parent_dir=epath.Path(item_dir),
        use_zarr3=stored["use_zarr3"],
        ts_context=context,
    )
    spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=stored["use_ocdbt"])
    return ts.open(spec, open=True, context=context).result()


# -- layout 1: one item per (stack, row), host Adler-32 checksums -------------------------------


def parse_v1_row_item(name: str) -> tuple[int, int] | None:
    """(stack, row) of a layout-1 row item's name, else None."""
    match = _V1_ROW_ITEM.match(name)
    return (int(match[1]), int(match[2])) if match else None


def v1_items(template: Any, rows: RowStacks) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
    """The items a layout-1 checkpoint of ``template``'s model holds, with their shapes."""
    items: dict[str, dict[str, jax.ShapeDtypeStruct]] = {DENSE: {}}
    for key, leaf in flatten(template).items():
        stack = rows.stack_of(key)
        if stack is None:
            items[DENSE][key] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
            continue
        for r in range(leaf.shape[0]):
            row = jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)
            items.setdefault(V1_ROW_NAME.format(stack=stack, row=r), {})[key] = row
    return items


def v1_join(items: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Flat host arrays from layout-1 items: row slices stacked back in row order."""
    flat: dict[str, np.ndarray] = dict(items[DENSE])
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, item in items.items():
        parsed = parse_v1_row_item(name)
        if parsed is None:
            continue
        for key, arr in item.items():
            stacks.setdefault(key, {})[parsed[1]] = arr
    for key, by_row in stacks.items():
        flat[key] = np.stack([by_row[r] for r in range(len(by_row))])
    return flat


def v1_checksum(arr: np.ndarray) -> str:
    """Layout 1's checksum: Adler-32 of the bytes plus shape and dtype."""
    arr = np.ascontiguousarray(arr)
    return f"{arr.dtype}{list(arr.shape)}:{zlib.adler32(arr.tobytes()):08x}"
