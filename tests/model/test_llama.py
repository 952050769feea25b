"""The Llama family's block against a NumPy reference written the way Hugging Face's Llama
computes it (separate q/k/v projections, ``repeat_kv``, ``rotate_half``), its RoPE scaling,
grouped-query attention against multi-head attention, the MoE gate conventions and the shared
expert, and the FLOPs it is counted at."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dynjax.flops import model_flops_per_token
from dynjax.model import GPT, Block, GPTConfig, MoE, route
from dynjax.model.attention import CausalSelfAttention, Rope, qkv_per_head, rotary
from dynjax.model.mlp import SwiGLU
from dynjax.model.pruned import SparseLinears, column_counts
from dynjax.model.sparse_linear import group_widths

D, HEADS, KV, MLP, S, B = 32, 4, 2, 48, 8, 2
LLAMA = GPTConfig(
    vocab_size=64, num_layers=2, d_model=D, num_heads=HEADS, mlp_dim=MLP, max_len=S,
    family="llama", num_kv_heads=KV, norm_eps=1e-5, rope=Rope(base=500_000.0),
)


def rms_norm(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def silu(x):
    return x / (1 + np.exp(-x))


def rope_ref(x, base, inv_freq=None):
    """HF's ``apply_rotary_pos_emb`` at positions 0..S-1: x [B, S, H, Dh]."""
    dh = x.shape[-1]
    if inv_freq is None:
        inv_freq = 1.0 / base ** (np.arange(0, dh, 2) / dh)
    angles = np.arange(x.shape[1])[:, None] * inv_freq[None, :]
    emb = np.concatenate([angles, angles], -1)[None, :, None, :]
    rotated = np.concatenate([-x[..., dh // 2 :], x[..., : dh // 2]], -1)
    return x * np.cos(emb) + rotated * np.sin(emb)


def attention_ref(x, wq, wk, wv, wo, heads, kv, base):
    """Causal GQA: query head i reads key/value head i // (heads / kv) (HF's ``repeat_kv``)."""
    b, s, d = x.shape
    dh = d // heads
    q = rope_ref((x @ wq).reshape(b, s, heads, dh), base)
    k = rope_ref((x @ wk).reshape(b, s, kv, dh), base)
    v = (x @ wv).reshape(b, s, kv, dh)
    k, v = np.repeat(k, heads // kv, axis=2), np.repeat(v, heads // kv, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
    logits = np.where(np.tril(np.ones((s, s), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d) @ wo


def separate_projections(rng, heads, kv, d=D):
    dh = d // heads
    wq, wk, wv = (rng.normal(0, 0.2, (d, n * dh)) for n in (heads, kv, kv))
    return wq, wk, wv


def test_a_llama_block_matches_a_numpy_reference():
    rng = np.random.default_rng(0)
    block = Block(LLAMA, 0, rngs=nnx.Rngs(0))
    wq, wk, wv = separate_projections(rng, HEADS, KV)
    wo = rng.normal(0, 0.2, (D, D))
    gate, up, down = rng.normal(0, 0.2, (D, MLP)), rng.normal(0, 0.2, (D, MLP)), rng.normal(
        0, 0.2, (MLP, D)
    )
    s1, s2 = rng.normal(1, 0.1, D), rng.normal(1, 0.1, D)
    # The fused projection as HF's q, k, v stacked, then stored per group.
    block.attn.qkv.kernel[...] = jnp.asarray(
        qkv_per_head(np.concatenate([wq, wk, wv], -1), HEADS, KV), jnp.float32
    )
    for var, value in ((block.attn.out.kernel, wo), (block.mlp.gate.kernel, gate),
                       (block.mlp.up.kernel, up), (block.mlp.down.kernel, down),
                       (block.norm1.scale, s1), (block.norm2.scale, s2)):
        var[...] = jnp.asarray(value, jnp.float32)
    assert {"bias"}.isdisjoint(jax.tree_util.keystr(p) for p, _ in
                               jax.tree_util.tree_leaves_with_path(nnx.state(block)))
    x = rng.normal(size=(B, S, D))
    y, _, _ = block(jnp.asarray(x, jnp.float32))

    h = x + attention_ref(rms_norm(x, s1, 1e-5), wq, wk, wv, wo, HEADS, KV, 500_000.0)
    n = rms_norm(h, s2, 1e-5)
    want = h + (silu(n @ gate) * (n @ up)) @ down
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)


def test_grouped_query_attention_is_multi_head_attention_with_shared_keys_and_values():
    """Key/value head j served to its group equals multi-head attention whose group heads hold
    copies of head j's key and value weights; num_kv_heads == num_heads is multi-head."""
    rng = np.random.default_rng(1)
    wq, wk, wv = separate_projections(rng, HEADS, KV)
    wo = rng.normal(0, 0.2, (D, D))
    dh, group = D // HEADS, HEADS // KV
    repeat = lambda w: np.repeat(w.reshape(D, KV, dh), group, axis=1).reshape(D, HEADS * dh)
    x = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)

    def run(kv, kernel):
        attn = CausalSelfAttention(D, HEADS, rope=True, out_std=0.02, rngs=nnx.Rngs(0),
                                   num_kv_heads=kv, bias=False)
        attn.qkv.kernel[...] = jnp.asarray(qkv_per_head(kernel, HEADS, kv), jnp.float32)
        attn.out.kernel[...] = jnp.asarray(wo, jnp.float32)
        return np.asarray(attn(x)[0])

    gqa = run(KV, np.concatenate([wq, wk, wv], -1))
    mha = run(HEADS, np.concatenate([wq, repeat(wk), repeat(wv)], -1))
    mha0 = run(0, np.concatenate([wq, repeat(wk), repeat(wv)], -1))
    np.testing.assert_allclose(gqa, mha, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(mha, mha0)
    # And the keys do differ per group: GQA is not the same as one shared head.
    assert not np.allclose(gqa, run(KV, np.concatenate([wq, wk, np.roll(wv, dh, -1)], -1)))


def test_attention_over_a_context_splits_grouped_projections_like_the_whole():
    """Early exit's path (queries of a subset, keys and values of the whole sequence) reads the
    per-group columns as the fused path does: all queries at their positions equal the block."""
    attn = CausalSelfAttention(D, HEADS, rope=True, out_std=0.02, rngs=nnx.Rngs(2),
                               num_kv_heads=KV, bias=False)
    x = jax.random.normal(jax.random.key(0), (B, S, D))
    whole, _ = attn(x)
    positions = jnp.broadcast_to(jnp.arange(S), (B, S))
    split, _ = attn(x, positions=positions, context=x)
    np.testing.assert_allclose(np.asarray(split), np.asarray(whole), rtol=1e-5, atol=1e-6)


def llama3_inv_freq(base, dh, factor, low, high, original):
    """Hugging Face's ``_compute_llama3_parameters``, in NumPy."""
    inv_freq = 1.0 / base ** (np.arange(0, dh, 2) / dh)
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled)


def test_llama3_rope_scaling_matches_the_reference_frequencies():
    rope = Rope(base=500_000.0, scaling="llama3", factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_len=8192)
    want = llama3_inv_freq(500_000.0, 64, 8.0, 1.0, 4.0, 8192)
    got = np.asarray(rope.frequencies(64))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    plain = np.asarray(Rope(base=500_000.0).frequencies(64))
    assert got[0] == plain[0] and got[-1] < plain[-1] / 7  # high kept, low scaled
    assert ((got > plain / 8 * 0.999) & (got < plain * 1.001)).all()
    x = np.random.default_rng(2).normal(size=(1, S, 2, 64))
    np.testing.assert_allclose(
        np.asarray(rotary(jnp.asarray(x, jnp.float32), rope=rope)),
        rope_ref(x, 500_000.0, want), rtol=1e-4, atol=1e-5,
    )


def test_linear_rope_scaling_is_rope_at_positions_divided_by_the_factor():
    x = jax.random.normal(jax.random.key(1), (1, S, 2, 16))
    positions = jnp.arange(S)[None, :] * 4
    scaled = rotary(x, positions, Rope(scaling="linear", factor=4.0))
    np.testing.assert_allclose(
        np.asarray(scaled), np.asarray(rotary(x)), rtol=1e-5, atol=1e-6
    )


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_router_conventions_match_their_references():
    """Mixtral: softmax over the top-k logits (= renormalised top-k of the softmax);
    OLMoE / Qwen1.5-MoE: top-k of the softmax as they are."""
    logits = np.random.default_rng(3).normal(size=(2, 5, 6)).astype(np.float32)
    k = 2
    top = np.argsort(-logits, -1, kind="stable")[..., :k]
    mixtral = softmax(np.take_along_axis(logits, top, -1))
    olmoe = np.take_along_axis(softmax(logits), top, -1)
    for normalize, want in ((True, mixtral), (False, olmoe)):
        _, gates, experts, _ = route(jnp.asarray(logits), k, normalize=normalize)
        np.testing.assert_array_equal(np.asarray(experts), top)
        np.testing.assert_allclose(np.asarray(gates), want, rtol=1e-6)
    assert not np.allclose(mixtral, olmoe)


def experts_ref(moe, x):
    """Every expert takes every token (top_k = E, capacities = S): gates times SwiGLU experts."""
    router, w_in, w_out = (np.asarray(v[...], np.float64) for v in (moe.router, moe.w_in,
                                                                     moe.w_out))
    probs = softmax(x @ router)
    h = w_out.shape[1]
    y = np.zeros_like(x)
    for e in range(w_in.shape[0]):
        a = x @ w_in[e]
        y += probs[..., e : e + 1] * ((silu(a[..., :h]) * a[..., h:]) @ w_out[e])
    return y


@pytest.mark.parametrize("gated_shared", [False, True], ids=["deepseek", "qwen"])
def test_swiglu_experts_and_the_shared_expert_match_a_reference(gated_shared):
    """The shared expert's output is added to the routed experts' (DeepSeekMoE), scaled per
    token by a sigmoid gate first with ``shared_gate`` (Qwen-MoE's ``shared_expert_gate``)."""
    d, h, e, shared = 16, 8, 4, 12
    moe = MoE(d, h, e, e, out_std=0.2, rngs=nnx.Rngs(4), gated=True, shared_dim=shared,
              shared_gate=gated_shared)
    assert moe.w_in.shape == (e, d, 2 * h) and moe.w_out.shape == (e, h, d)
    rng = np.random.default_rng(5)
    m = moe.shared
    variables = [moe.router, moe.w_in, moe.w_out, m.gate.kernel, m.up.kernel, m.down.kernel]
    for var in variables + ([moe.shared_gate] if gated_shared else []):
        var[...] = jnp.asarray(rng.normal(0, 0.3, var.shape), jnp.float32)
    x = rng.normal(size=(2, S, d))
    y, _ = moe(jnp.asarray(x, jnp.float32), capacities=(S,) * e)
    gate, up, down = (np.asarray(v.kernel[...], np.float64) for v in (m.gate, m.up, m.down))
    dense = (silu(x @ gate) * (x @ up)) @ down
    if gated_shared:
        dense = dense / (1 + np.exp(-(x @ np.asarray(moe.shared_gate[...], np.float64))))
    np.testing.assert_allclose(np.asarray(y), experts_ref(moe, x) + dense, rtol=1e-4, atol=1e-5)
    assert np.abs(dense).max() > 0.3  # the shared expert adds something


def forward_flops(cfg: GPTConfig) -> float:
    model = GPT(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((1, cfg.max_len), jnp.int32)
    fn = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0])
    return fn.lower(state, tokens).compile().cost_analysis()["flops"] / cfg.max_len


@pytest.mark.parametrize("family, kv", [("gpt", 0), ("llama", 0), ("llama", 2)])
def test_model_flops_count_swiglu_and_grouped_heads_as_the_compiler_does(family, kv):
    cfg = GPTConfig(vocab_size=256, num_layers=1, d_model=256, num_heads=8, mlp_dim=1024,
                    max_len=16, family=family, num_kv_heads=kv)
    count = model_flops_per_token(
        d_model=256, num_layers=1, num_heads=8, mlp_dim=1024, vocab_size=256, seq_len=16,
        num_kv_heads=kv, gated=family == "llama", training=False,
    )
    # The compiler also counts norms, softmax and activations: a few per cent at this size.
    assert count <= forward_flops(cfg) <= 1.04 * count
    mha = dataclasses.replace(cfg, num_kv_heads=0)
    if kv:  # 2 of 8 key/value heads: K and V projections a quarter of multi-head's
        assert count == model_flops_per_token(
            d_model=256, num_layers=1, num_heads=8, mlp_dim=1024, vocab_size=256, seq_len=16,
            gated=True, training=False,
        ) - 2 * 2 * 256 * 256 * 3 / 4
        assert forward_flops(cfg) < forward_flops(mha)


def test_a_block_pruned_swiglu_multiplies_block_sparsely_as_it_does_densely():
    """The block-sparse path (pruning's `SparseLinears`) covers SwiGLU's gate like up and down."""
    mlp = SwiGLU(D, MLP, out_std=0.1, rngs=nnx.Rngs(6))
    rng = np.random.default_rng(6)
    widths = []
    for name in ("gate", "up", "down"):
        kernel = getattr(mlp, name).kernel
        mask = rng.random((kernel.shape[0] // 8, kernel.shape[1] // 8)) < 0.5
        kernel[...] = kernel[...] * jnp.asarray(np.kron(mask, np.ones((8, 8))), jnp.float32)
        counts = np.asarray(column_counts(kernel[...], 8, kernel.shape[1] // 8))
        widths.append((f"mlp/{name}", group_widths(counts, 2)))
    x = jax.random.normal(jax.random.key(3), (B, S, D))
    sparse = SparseLinears(block_size=8, widths=tuple(widths))
    np.testing.assert_allclose(
        np.asarray(mlp(x, sparse)), np.asarray(mlp(x)), rtol=1e-5, atol=1e-6
    )
