"""Causal multi-head self-attention with rotary or learned positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dynjax.model.hashed_attention import HashedAttention, hashed_attention
from dynjax.model.pruned import SparseLinears, linear


def rotary(
    x: jax.Array, positions: jax.Array | None = None, base: float = 10_000.0
) -> jax.Array:
    """Rotary position embedding (RoPE) of x: [B, S, H, Dh], rotating feature pairs by position
    (``positions`` [B, S]: each token's position in its sequence; default 0..S-1)."""
    seq, half = x.shape[1], x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if positions is None:
        positions = jnp.arange(seq)[None, :]
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [B or 1, S, half]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


class CausalSelfAttention(nnx.Module):
    def __init__(self, d_model: int, num_heads: int, *, rope: bool, out_std: float, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.num_heads, self.rope = num_heads, rope
        self.qkv = nnx.Linear(d_model, 3 * d_model, kernel_init=init, rngs=rngs)
        self.out = nnx.Linear(
            d_model, d_model, kernel_init=nnx.initializers.normal(out_std), rngs=rngs
        )

    def __call__(
        self,
        x: jax.Array,
        sparse: SparseLinears | None = None,
        positions: jax.Array | None = None,
        hashed: HashedAttention | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(output, metrics). ``sparse``: which of ``attn/qkv``, ``attn/out`` multiply
        block-sparsely; ``positions`` [B, S]: the tokens' positions in their sequence, ascending
        (a subset of a sequence, as mixture of depths runs), for RoPE and the causal mask;
        default 0..S-1; ``hashed``: attend within LSH buckets (`hashed_attention`)."""
        b, s, d = x.shape
        qkv = linear(self.qkv, x, "attn/qkv", sparse)
        q, k, v = jnp.split(qkv.reshape(b, s, 3 * self.num_heads, -1), 3, axis=2)
        if self.rope:
            q, k = rotary(q, positions), rotary(k, positions)
        metrics: dict[str, jax.Array] = {}
        if hashed is not None:
            y, metrics = hashed_attention(q, k, v, hashed)
            return linear(self.out, y.reshape(b, s, d), "attn/out", sparse), metrics
        scale = q.shape[-1] ** -0.5
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
        # Causal in the original order: positions ascend, so a subset keeps the lower triangle.
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))
        logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        y = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
        return linear(self.out, y, "attn/out", sparse), metrics
