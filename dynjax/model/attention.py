"""Causal multi-head self-attention with rotary or learned positions."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.nn.initializers import Initializer

from dynjax.model.hashed_attention import HashedAttention, hashed_attention
from dynjax.model.moe import ExpertParallel
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


def qkv_per_head(x: Any, num_heads: int) -> Any:
    """The fused projection's columns (last axis) from (q/k/v, head, Dh) order to (head, q/k/v,
    Dh): each head's query, key and value side by side, so that a contiguous split of the
    columns over the ``tensor`` devices gives each device whole heads (Megatron-LM §3: a
    head-aligned split needs no exchange between the projection and the attention). A NumPy
    or jax array of any leading shape."""
    *lead, n = x.shape
    return x.reshape(*lead, 3, num_heads, n // (3 * num_heads)).swapaxes(-3, -2).reshape(*lead, n)


def _per_head_init(init: Initializer, num_heads: int) -> Initializer:
    """``init`` of the fused [D, 3D] kernel, drawn in (q/k/v, head, Dh) column order and stored
    per head: a seed gives the model it gave when the columns were (q/k/v, head, Dh)."""

    def draw(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        return qkv_per_head(init(key, shape, dtype), num_heads)

    return draw


class CausalSelfAttention(nnx.Module):
    def __init__(self, d_model: int, num_heads: int, *, rope: bool, out_std: float, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.num_heads, self.rope = num_heads, rope
        # Columns per head (`qkv_per_head`): [D, H x (q, k, v) x Dh].
        self.qkv = nnx.Linear(
            d_model, 3 * d_model, kernel_init=_per_head_init(init, num_heads), rngs=rngs
        )
        self.out = nnx.Linear(
            d_model, d_model, kernel_init=nnx.initializers.normal(out_std), rngs=rngs
        )

    def __call__(
        self,
        x: jax.Array,
        sparse: SparseLinears | None = None,
        positions: jax.Array | None = None,
        hashed: HashedAttention | None = None,
        context: jax.Array | None = None,
        parallel: ExpertParallel | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(output, metrics). ``sparse``: which of ``attn/qkv``, ``attn/out`` multiply
        block-sparsely; ``positions`` [B, S]: the tokens' positions in their sequence, ascending
        (a subset of a sequence, as mixture of depths runs), for RoPE and the causal mask;
        default 0..S-1; ``hashed``: attend within LSH buckets (`hashed_attention`).
        ``context`` [B, T, D]: the whole sequence (positions 0..T-1) whose keys and values the
        tokens ``x`` at ``positions`` attend to, so a subset of queries still sees every
        earlier token (early exit's state propagation, CALM §3.2); default ``x`` itself.
        ``parallel``: the mesh a hashed attention kernel splits the batch over."""
        b, s, d = x.shape
        if context is None:
            qkv = linear(self.qkv, x, "attn/qkv", sparse).reshape(b, s, self.num_heads, 3, -1)
            q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
            key_positions = positions
        else:
            q, k, v = self._split_projection(x, context, sparse)
            key_positions = jnp.arange(context.shape[1])[None, :]
        if self.rope:
            q, k = rotary(q, positions), rotary(k, key_positions)
        metrics: dict[str, jax.Array] = {}
        if hashed is not None:
            if context is not None:
                raise ValueError("hashed attention attends within its own tokens: no context")
            y, metrics = hashed_attention(q, k, v, hashed, parallel)
            return linear(self.out, y.reshape(b, s, d), "attn/out", sparse), metrics
        scale = q.shape[-1] ** -0.5
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
        if context is None:
            # Causal in the original order: positions ascend, so a subset keeps the triangle.
            causal = jnp.tril(jnp.ones((s, s), dtype=bool))
        else:  # queries at ``positions`` of the context's 0..T-1
            query_positions = jnp.arange(s)[None, :] if positions is None else positions
            causal = (query_positions[:, None, :, None] >= key_positions[:, None, None, :])
        logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        y = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
        return linear(self.out, y, "attn/out", sparse), metrics

    def _split_projection(
        self, x: jax.Array, context: jax.Array, sparse: SparseLinears | None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries of ``x``, keys and values of ``context`` [B, T, H, Dh]: only the query
        columns of the projection multiply the subset (a block-sparse projection multiplies
        whole, then splits)."""
        b, s, d = x.shape
        t, h = context.shape[1], self.num_heads
        if sparse is not None and sparse.width("attn/qkv") is not None:
            q = linear(self.qkv, x, "attn/qkv", sparse).reshape(b, s, h, 3, -1)[:, :, :, 0]
            kv = linear(self.qkv, context, "attn/qkv", sparse).reshape(b, t, h, 3, -1)[:, :, :, 1:]
        else:  # the columns per head (`qkv_per_head`): [D, H, (q, k, v), Dh]
            w = self.qkv.kernel[...].reshape(d, h, 3, -1)
            bias = self.qkv.bias[...].reshape(h, 3, -1)
            q = jnp.einsum("bsd,dhe->bshe", x, w[:, :, 0]) + bias[:, 0]
            kv = jnp.einsum("btd,dhce->bthce", context, w[:, :, 1:]) + bias[:, 1:]
        return q, kv[:, :, :, 0], kv[:, :, :, 1]
