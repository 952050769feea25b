"""Dense causal attention (dynjax.model.dense_attention): the function against a NumPy reference,
its gradients against jax.nn.dot_product_attention's XLA implementation, the layer's wiring of
grouped heads, and the cuDNN route's fallback when cuDNN refuses to compile."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dynjax.model import dense_attention
from dynjax.model.attention import CausalSelfAttention


def reference(q, k, v, mask=None):
    """float64 NumPy attention: grouped key/value heads, causal unless ``mask`` [B, 1, S, T]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    s, t = q.shape[1], k.shape[1]
    visible = np.tril(np.ones((s, t), bool))[None, None] if mask is None else np.asarray(mask)
    logits = np.where(visible, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", probs, v)


def qkv(heads: int, kv_heads: int, s: int = 12, t: int = 12, dh: int = 16, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (2, s, heads, dh)),
            jax.random.normal(keys[1], (2, t, kv_heads, dh)),
            jax.random.normal(keys[2], (2, t, kv_heads, dh)))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_causal_equals_numpy_and_its_gradients_jax_own(heads, kv_heads):
    q, k, v = qkv(heads, kv_heads)
    np.testing.assert_allclose(dense_attention.causal(q, k, v), reference(q, k, v), atol=2e-5)
    jax_own = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, implementation="xla")
    cotangent = jax.random.normal(jax.random.key(3), q.shape)
    grads = [jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v) * cotangent), argnums=(0, 1, 2))
             (q, k, v) for f in (dense_attention.causal, jax_own)]
    for new, old in zip(*grads, strict=True):
        np.testing.assert_allclose(new, old, atol=2e-5)


def test_a_mask_replaces_the_causal_rule():
    """Queries at positions 3, 5, 9 of a 12-token context (early exit's state propagation)."""
    q, k, v = qkv(4, 2, s=3)
    positions = jnp.array([[3, 5, 9]] * 2)
    mask = positions[:, None, :, None] >= jnp.arange(12)[None, None, None, :]
    out = dense_attention.causal(q, k, v, mask)
    np.testing.assert_allclose(out, reference(q, k, v, mask), atol=2e-5)


def test_the_layer_attends_with_its_grouped_heads():
    """CausalSelfAttention (GQA) is its output projection of the causal attention of its heads,
    on all tokens and on an ascending subset of them (mixture of depths' routed tokens)."""
    layer = CausalSelfAttention(32, 4, num_kv_heads=2, rope=True, out_std=0.02, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 10, 32))
    y, _ = layer(x)
    q, k, v = layer._heads(layer.qkv(x))
    q, k = layer._positioned(q, None), layer._positioned(k, None, keys=True)
    expected = jnp.asarray(reference(q, k, v), jnp.float32).reshape(2, 10, 32)
    np.testing.assert_allclose(y, layer.out(expected), atol=2e-5)
    subset = jnp.array([[0, 2, 3, 7]] * 2)
    y_sub, _ = layer(x[:, :4], positions=subset)
    assert y_sub.shape == (2, 4, 32) and bool(jnp.all(jnp.isfinite(y_sub)))


def test_a_cudnn_that_does_not_compile_falls_back_to_xla_with_a_warning(monkeypatch):
    """On a CPU, a 'gpu' backend whose cuDNN attention cannot compile: XLA's route, one warning
    naming the dtype and head dimension, and the same result."""
    dense_attention._cudnn_compiles.cache_clear()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.warns(RuntimeWarning, match="cuDNN attention does not compile here"):
        assert dense_attention.route(jnp.bfloat16, 16) == "einsum"
    assert dense_attention.route(jnp.float32, 16) == "einsum"  # cuDNN not asked: no probe
    q, k, v = (a.astype(jnp.bfloat16) for a in qkv(4, 2))
    out = dense_attention.causal(q, k, v).astype(jnp.float32)
    np.testing.assert_allclose(out, reference(q, k, v), atol=3e-2)
    dense_attention._cudnn_compiles.cache_clear()


def test_doctests():
    assert doctest.testmod(dense_attention).failed == 0
