"""Every use of JAX's private API in dynjax, in one place (STYLE habit 7: JaxPP keeps its
``jax._src`` imports in one compat module), each with the public way it stands in for and what
happens where a JAX version lacks it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

try:  # checked on jax 0.10.2 and 0.12.0.1
    from jax._src.config import explicit_device_put_scope as _explicit_transfer
    from jax._src.lib import xla_client as _xc

    _BATCHED_COPY = _xc.batched_copy_array_to_devices_with_sharding
    _REUSE_INPUT = _xc.ArrayCopySemantics.REUSE_INPUT
except (ImportError, AttributeError):  # another JAX: every copy through jax.device_put
    _BATCHED_COPY = _REUSE_INPUT = _explicit_transfer = None


def distributed_client() -> Any:
    """The coordinator's client of ``jax.distributed`` (its key-value store): JAX has no public
    handle on it."""
    from jax._src.distributed import global_state

    return global_state.client


def direct_copies_available() -> bool:
    """Whether `copy_to` can skip ``jax.device_put``'s Python for copies that keep their shards'
    positions (False on a JAX whose private copy call moved: then every copy is a device_put)."""
    return _BATCHED_COPY is not None


def copy_to(arrays: Sequence[jax.Array], shardings: Sequence[NamedSharding]) -> list[jax.Array]:
    """``jax.device_put(arrays, shardings)``, the same arrays, for less host time.

    A copy whose shards keep their positions (the same partition spec over a mesh of the same
    axes on other devices: one pipeline stage's sub-mesh to another's) ends inside
    ``jax.device_put`` in one C++ call, ``batched_copy_array_to_devices_with_sharding``, after
    0.2-0.5 ms of Python per ``device_put`` on CPU (issue 15 §7). Such copies of committed
    arrays go to that call directly, with the copy semantics ``device_put`` uses
    (``REUSE_INPUT``) and as explicit transfers (what the transfer guard allows of
    ``device_put``); every other array (host values, a reshard, an uncommitted array, an array
    of other processes' devices) goes through ``jax.device_put``, in one call: on CPU one call
    of many copies costs far less host time than one call each. Both are asynchronous: nothing
    waits for the copies."""
    direct, rest = [], []
    for i, (x, sharding) in enumerate(zip(arrays, shardings, strict=True)):
        (direct if _keeps_positions(x, sharding) else rest).append(i)
    out: list[Any] = [None] * len(arrays)
    if direct:
        with _explicit_transfer():
            copied = _BATCHED_COPY(
                [arrays[i] for i in direct],
                [shardings[i]._internal_device_list.addressable_device_list for i in direct],
                [shardings[i] for i in direct],
                [_REUSE_INPUT] * len(direct),
            )
        for i, y in zip(direct, copied, strict=True):
            out[i] = y
    if rest:
        for i, y in zip(rest, jax.device_put([arrays[i] for i in rest],
                                             [shardings[i] for i in rest]), strict=True):
            out[i] = y
    return out


def _keeps_positions(x: Any, sharding: NamedSharding) -> bool:
    """Whether ``x`` reaches ``sharding`` by copying each shard to the device at its position
    on devices it is not on, and the copy is what ``jax.device_put`` returns: the C++ call
    takes the result's type and committed flag from ``x``, so the meshes' axis types must
    match and ``x`` be committed; no logical device order may reorder the shards."""
    if _BATCHED_COPY is None or not isinstance(x, jax.Array):
        return False
    here = x.sharding
    return (
        x.committed
        and x.is_fully_addressable
        and sharding.is_fully_addressable
        and isinstance(here, NamedSharding)
        and isinstance(sharding, NamedSharding)
        and here.spec == sharding.spec
        and tuple(here.mesh.shape.items()) == tuple(sharding.mesh.shape.items())
        and here.mesh.axis_types == sharding.mesh.axis_types
        and getattr(here, "_logical_device_ids", None) is None
        and getattr(sharding, "_logical_device_ids", None) is None
        and here.memory_kind == sharding.memory_kind
        and here.device_set.isdisjoint(sharding.device_set)
    )
