"""Parallel equals sequential: expert/data sharding and microbatching against one device, for
both model families."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from dynjax.model import GPT, GPTConfig
from dynjax.parallel import (
    batch_sharding,
    expert_parallel,
    make_mesh,
    make_train_step,
    param_shardings,
    whole_model,
)

from ..helpers import assert_close, loss_terms, moe_options, stage_setup

CFG = GPTConfig(
    vocab_size=64,
    num_layers=3,
    d_model=32,
    num_heads=2,
    mlp_dim=64,
    max_len=16,
    moe_layers=(0, 2),
    num_experts=8,
    top_k=2,
)
CAPS = ((3, 5, 4, 6, 2, 4, 7, 3), (4,) * 8)  # uneven, and small enough to drop tokens
# Both block families (docs/models.md); the Llama one with grouped-query attention (one key/value
# head for two query heads), SwiGLU experts, unnormalised gates and a gated shared expert
# (Qwen-MoE's conventions).
FAMILIES = {
    "gpt": CFG,
    "llama": dataclasses.replace(
        CFG,
        family="llama",
        num_kv_heads=1,
        normalize_topk=False,
        shared_expert_dim=16,
        shared_expert_gate=True,
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def setup(request):
    cfg = FAMILIES[request.param]
    model = GPT(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    batch = {k: rng.integers(0, 64, (8, 16)).astype(np.int32) for k in ("inputs", "targets")}
    return graphdef, nnx.to_pure_dict(state), batch, cfg


def spec(**kw):
    """The single program's one stage of CFG on a batch of 8."""
    options = moe_options(CFG, kw.pop("capacities"))
    return whole_model(CFG.num_layers, batch_size=8, options=options, **kw)


def loss_and_grads(setup, mesh_shape, opts, tensor=1, fsdp=False):
    _, params, batch, cfg = setup
    mesh = make_mesh(*mesh_shape, tensor=tensor)
    par = expert_parallel(mesh)
    params = jax.device_put(params, param_shardings(params, mesh, fsdp=fsdp))
    batch = jax.device_put(batch, batch_sharding(mesh))
    fn = jax.jit(
        jax.value_and_grad(
            lambda p, b: loss_terms(stage_setup(cfg), opts, par, p, b["inputs"], b["targets"])[0]
        )
    )
    return jax.device_get(fn(params, batch))


@pytest.mark.slow
def test_expert_and_data_parallel_match_one_device(setup):
    opts = spec(capacities=CAPS)
    loss1, grads1 = loss_and_grads(setup, (1, 1, 1), opts)
    loss8, grads8 = loss_and_grads(setup, (1, 2, 4), opts)
    assert abs(loss8 - loss1) <= 1e-5 * abs(loss1)
    assert_close(grads1, grads8, 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape, tensor", [((1, 4, 1), 2), ((1, 2, 2), 2), ((1, 1, 2), 4)])
def test_fsdp_and_tensor_parallel_gradients_match_one_device(setup, mesh_shape, tensor):
    """Parameters split over 'data' (FSDP) and Megatron-style over 'tensor', MoE layers too."""
    opts = spec(capacities=CAPS)
    loss1, grads1 = loss_and_grads(setup, (1, 1, 1), opts)
    loss8, grads8 = loss_and_grads(setup, mesh_shape, opts, tensor=tensor, fsdp=True)
    assert abs(loss8 - loss1) <= 1e-5 * abs(loss1)
    assert_close(grads1, grads8, 1e-5)


@pytest.mark.slow
def test_train_step_microbatches_and_sharding_match_one_device(setup):
    """A full optimizer step (SGD: parameters move by the gradient), sharded and microbatched."""
    _, params, batch, cfg = setup
    results = []
    for mesh_shape, micro in (((1, 1, 1), 1), ((1, 2, 2), 2), ((1, 2, 4), 1)):
        mesh = make_mesh(*mesh_shape)
        opts = spec(capacities=CAPS, microbatches=micro)
        opt = optax.sgd(0.5)
        step = jax.jit(make_train_step(stage_setup(cfg, opt), opts, expert_parallel(mesh)))
        p = jax.device_put(params, param_shardings(params, mesh))
        new, _, metrics = step(p, opt.init(p), jax.device_put(batch, batch_sharding(mesh)))
        results.append(jax.device_get((new, metrics)))
    (ref, ref_m), *others = results
    for new, metrics in others:
        assert_close(ref, new, 1e-5)
        np.testing.assert_allclose(metrics["loss"], ref_m["loss"], rtol=1e-5)
        np.testing.assert_array_equal(metrics["moe/group_loads"], ref_m["moe/group_loads"])
        np.testing.assert_array_equal(metrics["moe/dropped"], ref_m["moe/dropped"])
    assert ref_m["moe/dropped"].sum() > 0  # the capacities above really drop tokens


@pytest.mark.slow
def test_bfloat16_compute_tracks_float32(setup):
    loss32, _ = loss_and_grads(setup, (1, 1, 1), spec(capacities=((16,) * 8,) * 2))
    loss16, grads16 = loss_and_grads(
        setup, (1, 1, 1), spec(capacities=((16,) * 8,) * 2, dtype="bfloat16")
    )
    assert abs(loss16 - loss32) < 2e-2 * loss32
    assert all(g.dtype == np.float32 for g in jax.tree.leaves(grads16))  # master weights stay fp32
