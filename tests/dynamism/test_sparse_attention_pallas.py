"""The Pallas path of hash-based sparse attention (interpret mode on CPU): the kernel against a
dense masked float64 reference built from the same buckets and positions (outputs and gradients),
against the XLA path with an ample budget, the blocks it visits against the needed-block rule,
its configuration errors and a short training run."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynjax.config import validate_config
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.model.hashed_attention import (
    NEEDED_HIST,
    OVERFLOW,
    PAIR_FRACTION,
    HashedAttention,
    hashed_attention,
    needed_blocks,
)
from dynjax.parallel import expert_parallel, make_mesh
from dynjax.train import train
from dynjax.writers import read_jsonl
from pallas_kernels import hashed_block_sparse_attention

from ..helpers import qkv, sorted_blocks
from ..tiny import tiny_config

SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def sorted_ids(rng, b, h, s, buckets):
    """Random buckets per token, sorted by (bucket, position) as the model sorts them: each
    sorted token's (original position, bucket), [B, H, S] int32 each."""
    bucket = rng.integers(0, buckets, (b, h, s))
    perm = np.argsort(bucket * s + np.arange(s), axis=-1, kind="stable")
    return perm.astype(np.int32), np.take_along_axis(bucket, perm, -1).astype(np.int32)


def reference(q, k, v, do, q_pos, q_bucket, k_pos, k_bucket):
    """Dense masked softmax attention and its VJP in float64: a query sees the keys of its own
    bucket at positions not after its own; a row without keys gives zeros."""
    allowed = (q_bucket[..., :, None] == k_bucket[..., None, :]) & (
        k_pos[..., None, :] <= q_pos[..., :, None]
    )
    with jax.enable_x64(True):
        q, k, v, do = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, do))

        def attend(q, k, v):
            s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
            s = jnp.where(allowed, s, -jnp.inf)
            m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
            p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
            denom = jnp.sum(p, axis=-1, keepdims=True)
            return jnp.einsum("bhqk,bhkd->bhqd", p / jnp.where(denom == 0, 1.0, denom), v)

        out, vjp = jax.vjp(attend, q, k, v)
        return [np.asarray(x) for x in (out, *vjp(do))], allowed


@functools.partial(jax.jit, static_argnames="block")
def kernel_vjp(q, k, v, do, ids, block):
    attend = lambda q, k, v: hashed_block_sparse_attention(
        q, k, v, *ids, block_size=block, interpret=True
    )
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(do))


@pytest.mark.slow
@settings(max_examples=10, **SETTINGS)
@given(
    blocks=st.integers(2, 5),
    block=st.sampled_from([4, 8, 16]),
    buckets=st.sampled_from([1, 2, 4, 8]),
    heads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_kernel_outputs_and_gradients_equal_the_dense_masked_reference(
    blocks, block, buckets, heads, seed
):
    rng = np.random.default_rng(seed)
    s = blocks * block
    q, k, v, do = (jnp.asarray(rng.standard_normal((2, heads, s, 8)), jnp.float32)
                   for _ in range(4))
    ids = (*sorted_ids(rng, 2, heads, s, buckets), *sorted_ids(rng, 2, heads, s, buckets))
    got = kernel_vjp(q, k, v, do, tuple(jnp.asarray(x) for x in ids), block)
    want, _ = reference(q, k, v, do, *ids)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert np.isfinite(g).all(), f"{name}: unwritten (NaN) entries"
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)


def test_rows_without_a_visible_key_give_zeros_and_no_gradient():
    rng = np.random.default_rng(3)
    q, k, v, do = (jnp.asarray(rng.standard_normal((1, 1, 16, 8)), jnp.float32) for _ in range(4))
    pos = np.arange(16, dtype=np.int32)[None, None]
    q_bucket = np.zeros((1, 1, 16), np.int32)
    q_bucket[..., 12:] = 1  # bucket 1 holds no key: the last 4 queries see nothing
    ids = (pos, q_bucket, pos, np.zeros_like(q_bucket))
    out, dq, dk, dv = kernel_vjp(q, k, v, do, tuple(map(jnp.asarray, ids)), 8)
    np.testing.assert_array_equal(out[..., 12:, :], 0.0)
    np.testing.assert_array_equal(dq[..., 12:, :], 0.0)
    want, allowed = reference(q, k, v, do, *ids)
    assert not allowed[..., 12:, :].any() and allowed[..., :12, :].any()
    for g, w in zip((out, dq, dk, dv), want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_a_jax_without_the_triton_lowering_computes_it_with_xla(without_pallas_triton):
    """What a GPU gets once jax drops the Pallas Triton backend: the same values and gradients
    from plain XLA ops (dense cost), and a warning saying so."""
    rng = np.random.default_rng(5)
    q, k, v, do = (jnp.asarray(rng.standard_normal((1, 2, 32, 16)), jnp.float32)
                   for _ in range(4))
    ids = (*sorted_ids(rng, 1, 2, 32, 4), *sorted_ids(rng, 1, 2, 32, 4))
    attend = lambda q, k, v: hashed_block_sparse_attention(
        q, k, v, *map(jnp.asarray, ids), block_size=16, interpret=False
    )
    with pytest.warns(RuntimeWarning, match="no usable Pallas Triton lowering"):
        out, vjp = jax.vjp(attend, q, k, v)
    want, _ = reference(q, k, v, do, *ids)
    for g, w in zip((out, *vjp(do)), want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_the_kernel_takes_bfloat16():
    rng = np.random.default_rng(6)
    q, k, v, do = (jnp.asarray(rng.standard_normal((1, 2, 32, 16)), jnp.bfloat16)
                   for _ in range(4))
    ids = (*sorted_ids(rng, 1, 2, 32, 2), *sorted_ids(rng, 1, 2, 32, 2))
    got = kernel_vjp(q, k, v, do, tuple(map(jnp.asarray, ids)), 16)
    want, _ = reference(q, k, v, do, *ids)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert g.dtype == jnp.bfloat16
        err = np.max(np.abs(np.asarray(g, np.float64) - w)) / np.max(np.abs(w))
        assert err < 2e-2, f"{name}: relative error {err:.2e}"


def test_bad_ids_are_refused():
    q = jnp.zeros((1, 1, 32, 16))
    pos = jnp.zeros((1, 1, 32), jnp.int32)
    with pytest.raises(ValueError, match="k_buckets must be an int array"):
        hashed_block_sparse_attention(q, q, q, pos, pos, pos, pos[..., :16], block_size=16)
    with pytest.raises(ValueError, match="q_positions must be an int array"):
        hashed_block_sparse_attention(q, q, q, pos.astype(jnp.float32), pos, pos, pos,
                                      block_size=16)


def numpy_needed(q_bucket, q_pos, k_bucket, k_pos, block):
    """The needed-block rule, block by block: overlapping bucket ranges and a key block whose
    first position is not after the query block's last."""
    *lead, s = q_bucket.shape
    n = s // block
    need = np.zeros((*lead, n, n), bool)
    for idx in np.ndindex(*lead):
        for i in range(n):
            qi = slice(i * block, (i + 1) * block)
            for j in range(n):
                kj = slice(j * block, (j + 1) * block)
                need[(*idx, i, j)] = (
                    k_bucket[idx][kj].min() <= q_bucket[idx][qi].max()
                    and q_bucket[idx][qi].min() <= k_bucket[idx][kj].max()
                    and k_pos[idx][kj].min() <= q_pos[idx][qi].max()
                )
    return need


def test_the_kernel_visits_exactly_the_needed_blocks_of_the_xla_path():
    """The block list built on device: a NaN value block poisons exactly the query blocks that
    load it (0 x NaN is NaN in p @ v), so copy j of the batch, whose key block j is NaN, shows
    which query blocks visit key block j. That must be the XLA path's needed blocks, which skip
    no block with a visible pair."""
    block, n, heads = 16, 6, 2
    s = block * n
    q, k, v = qkv(1, s, heads, 16, seed=11)
    rec = HashedAttention(4, block, n, seed=0, layer=0)
    qb, qp, kb, kp = sorted_blocks(q, k, rec)  # [1, H, S] each
    need = np.asarray(needed_blocks(*(jnp.asarray(a) for a in (qb, qp, kb, kp)), block))[0]
    np.testing.assert_array_equal(need, numpy_needed(qb, qp, kb, kp, block)[0])
    pairs = (qb[0, :, :, None] == kb[0, :, None, :]) & (kp[0, :, None, :] <= qp[0, :, :, None])
    real = pairs.reshape(heads, n, block, n, block).any(axis=(2, 4))
    assert np.all(need[real]) and need.sum() < heads * n * (n + 1) // 2  # skips, never wrongly
    sort = lambda x, perm: np.take_along_axis(np.moveaxis(np.asarray(x), 1, 2), perm[..., None], 2)
    qs, ks, vs = sort(q, qp), sort(k, kp), sort(v, kp)  # [1, H, S, Dh]
    copies = lambda x: np.repeat(x, n, axis=0)
    vs = copies(vs)
    for j in range(n):
        vs[j, :, j * block:(j + 1) * block] = np.nan
    out = hashed_block_sparse_attention(
        *(jnp.asarray(x) for x in (copies(qs), copies(ks), vs)),
        *(jnp.asarray(copies(x)) for x in (qp, qb, kp, kb)),
        block_size=block, interpret=True,
    )
    visits = np.isnan(np.asarray(out)).reshape(n, heads, n, block, -1).all(axis=(3, 4))
    np.testing.assert_array_equal(visits, np.moveaxis(need, -1, 0))  # [key block j, H, i]


@pytest.mark.slow
@pytest.mark.parametrize("s, block, buckets, heads", [(64, 16, 4, 2), (96, 16, 8, 1)])
def test_the_pallas_path_equals_the_xla_path_with_an_ample_budget(s, block, buckets, heads):
    q, k, v = qkv(2, s, heads, 16, seed=s + buckets)
    xla = HashedAttention(buckets, block, s // block, seed=0, layer=1)
    pallas = HashedAttention(buckets, block, 1, seed=0, layer=1, kernel="pallas")  # no budget
    loss = lambda rec: lambda *a: jnp.sum(jnp.sin(hashed_attention(*a, rec)[0]))
    (y, got), (want_y, want) = (hashed_attention(q, k, v, r) for r in (pallas, xla))
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    assert float(got[OVERFLOW]) == 0.0
    np.testing.assert_array_equal(got[NEEDED_HIST], want[NEEDED_HIST])
    np.testing.assert_allclose(got[PAIR_FRACTION], want[PAIR_FRACTION])
    assert float(got[PAIR_FRACTION]) < 1.0
    grads = [jax.grad(loss(r), argnums=(0, 1, 2))(q, k, v) for r in (pallas, xla)]
    for g, w in zip(*grads, strict=True):
        assert float(jnp.abs(w).max()) > 0
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_on_a_mesh_each_device_runs_the_kernel_on_its_own_rows_and_heads():
    """8 devices (data 2 x expert 2 x tensor 2): the kernel runs under shard_map, on 1 of the
    4 rows and 1 of the 2 heads per device, and equals the one-device result and gradients."""
    mesh = make_mesh(1, 2, 2, tensor=2)
    parallel = expert_parallel(mesh)
    q, k, v = qkv(4, 32, 2, 16, seed=3)
    record = HashedAttention(4, 16, 1, seed=0, layer=0, kernel="pallas")
    loss = lambda par: lambda *a: jnp.sum(jnp.sin(hashed_attention(*a, record, par)[0]))
    jaxpr = str(jax.make_jaxpr(lambda *a: hashed_attention(*a, record, parallel))(q, k, v))
    assert "shard_map" in jaxpr and "f32[1,1,32,16]" in jaxpr  # one row, one head each
    assert "shard_map" not in str(jax.make_jaxpr(lambda *a: hashed_attention(*a, record))(q, k, v))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "expert")))
    placed = [jax.device_put(x, rows) for x in (q, k, v)]
    (y, got), (want_y, want) = (
        jax.jit(lambda *a, par=par: hashed_attention(*a, record, par))(*placed)
        for par in (parallel, None)
    )
    np.testing.assert_allclose(y, want_y, rtol=1e-6, atol=1e-6)
    for key in (NEEDED_HIST, PAIR_FRACTION):
        np.testing.assert_allclose(got[key], want[key])
    grads = [jax.jit(jax.grad(loss(par), argnums=(0, 1, 2)))(*placed) for par in (parallel, None)]
    for g, w in zip(*grads, strict=True):
        assert float(jnp.abs(w).max()) > 0
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def pallas_config(**overrides):
    base = dict(sparse_attention__enabled=True, sparse_attention__kernel="pallas",
                sparse_attention__block=16, sparse_attention__buckets=4)
    return tiny_config(**{**base, **overrides})


@pytest.mark.parametrize(
    "overrides, key",
    [
        (dict(sparse_attention__kernel="triton"), "sparse_attention.kernel"),
        (dict(sparse_attention__block=8), "sparse_attention.block"),
        (dict(data__seq_len=48, sparse_attention__block=24), "sparse_attention.block"),
        (dict(model__num_heads=4), "model.d_model"),  # head_dim 8
    ],
)
def test_settings_the_kernel_cannot_run_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_config(pallas_config(**overrides), 8)


@pytest.mark.slow
def test_training_with_the_kernel_matches_the_xla_path_and_costs_the_needed_pairs(tmp_path):
    """Two steps (interpret mode is slow): the same losses as the XLA path with its starting,
    full budget; no overflow, no budget policy; the balancer's costs from the needed pairs."""
    settings = dict(train__steps=2, train__eval_every=100, train__checkpoint_every=100)
    train(pallas_config(**settings), tmp_path / "pallas", progress=False)
    train(pallas_config(sparse_attention__kernel="xla", **settings), tmp_path / "xla",
          progress=False)
    rows = {d: [r for r in read_jsonl(tmp_path / d / "metrics.jsonl") if "loss" in r]
            for d in ("pallas", "xla")}
    assert len(rows["pallas"]) == 2
    np.testing.assert_allclose([r["loss"] for r in rows["pallas"]],
                               [r["loss"] for r in rows["xla"]], rtol=1e-5)
    assert all(r[OVERFLOW] == [0.0, 0.0] for r in rows["pallas"])
    # The balancer's cost: the needed pairs over all nb x nb = 4 pairs, from the step's metrics.
    costs = read_jsonl(tmp_path / "pallas" / "layer_costs.jsonl")
    for row, cost in zip(rows["pallas"], costs, strict=True):
        np.testing.assert_allclose(cost["layer_cost"], np.multiply(row[PAIR_FRACTION], 3 / 4))
    assert min(costs[0]["layer_cost"]) < 1.0
    cfg = pallas_config(**settings)
    exp = Experiment.from_config(cfg)
    plugin = next(p for p in exp.plugins if p.name == "sparse_attention")
    assert plugin.policies() == []
    assert plugin.layer_costs(exp.initial_plan()) is None


@pytest.mark.slow
def test_the_kernel_on_a_pipeline_and_a_tensor_mesh_equals_one_program(tmp_path):
    settings = dict(train__steps=2, train__eval_every=100, train__checkpoint_every=100,
                    train__microbatches=2)
    layouts = {
        "one": {},
        "pipeline": dict(mesh__stage=2, pipeline__stage_layers="(1,1)",
                         pipeline__profile_on_change=False),
        "tensor": dict(mesh__tensor=2),
    }
    loss = {}
    for name, layout in layouts.items():
        train(pallas_config(**settings, **layout), tmp_path / name, progress=False)
        loss[name] = [r["loss"] for r in read_jsonl(tmp_path / name / "metrics.jsonl")
                      if "loss" in r]
    assert len(loss["one"]) == 2
    np.testing.assert_allclose(loss["pipeline"], loss["one"], rtol=1e-5)
    np.testing.assert_allclose(loss["tensor"], loss["one"], rtol=1e-5)
