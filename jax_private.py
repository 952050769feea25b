"""Every use of JAX's (and Orbax's) private API in this repository, in one place (STYLE habit
7: JaxPP keeps its ``jax._src`` imports in one compat module), each with the public way it
stands in for and what happens where a JAX version lacks it.

Why a top-level module: both packages touch JAX internals, and the dependencies point one way,
``dynjax`` -> ``pallas_kernels``. A home inside ``dynjax`` would make ``pallas_kernels`` import
``dynjax`` (a cycle, and the kernels would no longer stand alone); a home inside
``pallas_kernels`` would put dynjax's copies and coordinator client in the kernel package. So
this module sits below both, imports neither, and is all either of them (and the tests and
benchmarks) reach into JAX through. A JAX upgrade that moves an internal is fixed here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
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


def array_metadata_store() -> Any:
    """Orbax's array metadata store, which a ``PyTreeCheckpointHandler`` needs to write each
    array's metadata (for replica-parallel saves): Orbax exposes no public constructor."""
    from orbax.checkpoint._src.metadata import array_metadata_store as store

    return store.Store()


def pallas_triton_lowering(deprecation: str) -> bool:
    """Whether this jax lowers ``pl.pallas_call`` through Triton without raising: it has the
    lowering, and has not accelerated its deprecation ``deprecation`` into an error (a jax
    from before that deprecation has not)."""
    try:
        from jax._src import deprecations
        from jax._src.pallas.triton import pallas_call_registration  # noqa: F401
    except ImportError:
        return False
    try:
        return not deprecations.is_accelerated(deprecation)
    except ValueError:  # not registered: a jax from before the deprecation
        return True


@contextlib.contextmanager
def deprecation_accelerated(deprecation: str) -> Iterator[bool]:
    """Within the block, jax's deprecation ``deprecation`` is accelerated into the error a
    later jax raises (how the tests run as that jax); restored after. Yields whether this jax
    registers it (False: nothing changed, a jax from before the deprecation)."""
    from jax._src import deprecations

    state = deprecations._registered_deprecations.get(deprecation)
    if state is None:
        yield False
        return
    saved, state.accelerated = state.accelerated, True
    try:
        yield True
    finally:
        state.accelerated = saved


@contextlib.contextmanager
def device_put_copies() -> Iterator[None]:
    """Within the block, `copy_to` makes every copy through ``jax.device_put``, as on a JAX
    without the direct call (what a benchmark compares against); restored after."""
    global _BATCHED_COPY
    saved, _BATCHED_COPY = _BATCHED_COPY, None
    try:
        yield
    finally:
        _BATCHED_COPY = saved


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
