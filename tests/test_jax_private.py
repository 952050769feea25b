"""`copy_to`: the same arrays as ``jax.device_put``, by JAX's own batched copy where it can."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_private
from dynjax.parallel import make_mesh
from dynjax.parallel.mesh import stage_mesh

MESH = make_mesh(4, 2, 1)
STAGE = [stage_mesh(MESH, s) for s in range(4)]


def on(stage: int, spec: P) -> NamedSharding:
    return NamedSharding(STAGE[stage], spec)


def arrays_and_targets():
    """Stage-to-stage copies (rows split, replicated, a weakly typed scalar, bf16), a host
    array, and a reshard (another spec), in one call."""
    rows = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), on(0, P("data")))
    whole = jax.device_put(np.arange(6, dtype=np.int32), on(1, P()))
    scalar = jax.device_put(jnp.asarray(2.5), on(2, P()))  # weakly typed, as a Python float
    half = jax.device_put(jnp.ones((4, 2), jnp.bfloat16), on(3, P("data")))
    host = np.full((4, 2), 7.0, np.float32)
    reshard = jax.device_put(np.arange(8.0).reshape(4, 2), on(0, P("data")))
    arrays = [rows, whole, scalar, half, host, reshard]
    targets = [on(3, P("data")), on(0, P()), on(1, P()), on(2, P("data")), on(1, P("data")),
               on(2, P(None, "data"))]
    return arrays, targets


def test_copies_equal_device_put_in_values_shardings_and_types():
    arrays, targets = arrays_and_targets()
    got = jax_private.copy_to(arrays, targets)
    want = jax.device_put(arrays, targets)
    for g, w, t in zip(got, want, targets, strict=True):
        assert g.sharding == t and g.sharding == w.sharding
        assert g.aval == w.aval  # shape, dtype and weak type
        assert g.committed and w.committed
        for a, b in zip(g.addressable_shards, w.addressable_shards, strict=True):
            assert a.device == b.device and a.index == b.index
            np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))


@pytest.fixture
def count_device_puts(monkeypatch):
    """Call it to start counting: it returns the list of the lengths of every later
    ``jax.device_put`` call's list of arrays, in order."""

    def start() -> list[int]:
        calls, real = [], jax.device_put

        def device_put(some, shardings):
            calls.append(len(some))
            return real(some, shardings)

        monkeypatch.setattr(jax_private.jax, "device_put", device_put)
        return calls

    return start


def test_stage_to_stage_copies_skip_device_put_and_others_take_it_once(count_device_puts):
    """Issue 15 §7: the copies between stage sub-meshes are one call of JAX's batched copy;
    what cannot go there (the host array, the reshard) is one ``device_put`` call."""
    assert jax_private.direct_copies_available()  # on every JAX dynjax is tested with
    arrays, targets = arrays_and_targets()
    calls = count_device_puts()
    jax_private.copy_to(arrays[:4], targets[:4])
    assert calls == []
    jax_private.copy_to(arrays, targets)
    assert calls == [2]


def other_cases():
    """Copies the direct call would get wrong (it takes the result's type and committed flag
    from the source, and copies each shard to the same position): each must go through
    ``jax.device_put``."""
    x = jax.device_put(np.arange(16.0).reshape(8, 2), on(0, P("data")))
    axes = STAGE[1].axis_names
    explicit = Mesh(STAGE[1].devices, axes, axis_types=(AxisType.Explicit,) * len(axes))
    reversed_here = Mesh(STAGE[0].devices[::-1], axes, axis_types=STAGE[0].axis_types)
    return {
        "logical device order": (x, NamedSharding(STAGE[1], P("data"),
                                                  _logical_device_ids=(1, 0))),
        "explicit axis types": (x, NamedSharding(explicit, P("data"))),
        "the devices it is on, reordered": (x, NamedSharding(reversed_here, P("data"))),
        # on the default device, not committed to it
        "uncommitted source": (jnp.arange(8.0), NamedSharding(STAGE[1], P())),
    }


@pytest.mark.parametrize("case", list(other_cases()))
def test_what_the_direct_copy_would_get_wrong_goes_through_device_put(case, count_device_puts):
    x, target = other_cases()[case]
    want = jax.device_put(x, target)
    calls = count_device_puts()
    (got,) = jax_private.copy_to([x], [target])
    assert calls == [1]
    assert got.sharding == want.sharding and got.aval == want.aval
    assert got.committed == want.committed
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_direct_copies_are_explicit_transfers_as_device_puts_are():
    """The transfer guard treats them as ``jax.device_put``: allowed where implicit
    device-to-device transfers are not."""
    arrays, targets = arrays_and_targets()
    with jax.transfer_guard_device_to_device("disallow"):
        got = jax_private.copy_to(arrays[:4], targets[:4])
    assert [g.sharding for g in got] == targets[:4]


def test_lengths_must_match():
    x = jax.device_put(np.zeros(2), on(0, P()))
    with pytest.raises(ValueError):
        jax_private.copy_to([x, x], [on(1, P())])


def test_device_put_copies_sends_every_copy_through_device_put_until_the_block_ends(
    count_device_puts,
):
    """What `benchmarks/pipeline.py` compares against: inside the block the stage-to-stage
    copies take ``jax.device_put`` too, after it the direct call again."""
    arrays, targets = arrays_and_targets()
    calls = count_device_puts()
    with jax_private.device_put_copies():
        got = jax_private.copy_to(arrays[:4], targets[:4])
    assert calls == [4]
    assert [g.sharding for g in got] == targets[:4]
    jax_private.copy_to(arrays[:4], targets[:4])
    assert calls == [4]
