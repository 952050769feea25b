"""Causal self-attention with rotary or learned positions: multi-head, or grouped-query
(GQA, Ainslie et al. 2023: ``num_kv_heads`` key/value heads, each shared by a group of
``num_heads / num_kv_heads`` query heads, as Llama 2/3, Mistral and Qwen use)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.nn.initializers import Initializer

from dynjax.model import dense_attention
from dynjax.model.hashed_attention import (
    HashedAttention,
    hashed_attention,
    lsh_buckets,
    rotations,
)
from dynjax.model.moe import ExpertParallel
from dynjax.model.pruned import SparseLinears, linear

ROPE_SCALINGS = ("none", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class Rope:
    """RoPE's frequencies: ``base`` and a long-context ``scaling`` of them (`ROPE_SCALINGS`).

    ``"linear"`` (position interpolation, Chen et al. 2023) divides every frequency by
    ``factor``; ``"llama3"`` (Llama 3.1, Hugging Face's ``rope_type="llama3"``) divides only
    the low frequencies, those whose wavelength exceeds ``original_max_len / low_freq_factor``,
    keeps those whose wavelength is below ``original_max_len / high_freq_factor``, and blends
    linearly in between."""

    base: float = 10_000.0
    scaling: str = "none"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    def frequencies(self, head_dim: int) -> jax.Array:
        """[head_dim // 2] float32 angular frequencies (radians per position)."""
        half = head_dim // 2
        freqs = self.base ** (-jnp.arange(half, dtype=jnp.float32) / half)
        if self.scaling == "linear":
            return freqs / self.factor
        if self.scaling == "llama3":
            wavelen = 2 * math.pi / freqs
            low, high = self.low_freq_factor, self.high_freq_factor
            smooth = (self.original_max_len / wavelen - low) / (high - low)
            blended = (1 - smooth) * freqs / self.factor + smooth * freqs
            scaled = jnp.where(wavelen > self.original_max_len / low, freqs / self.factor, freqs)
            medium = (wavelen >= self.original_max_len / high) & (
                wavelen <= self.original_max_len / low
            )
            return jnp.where(medium, blended, scaled)
        return freqs


def rotary(x: jax.Array, positions: jax.Array | None = None, rope: Rope = Rope()) -> jax.Array:
    """Rotary position embedding (RoPE) of x: [B, S, H, Dh], rotating feature pairs by position
    (``positions`` [B, S]: each token's position in its sequence; default 0..S-1). Pairs are
    (i, i + Dh/2), the GPT-NeoX and Hugging Face Llama convention."""
    seq, half = x.shape[1], x.shape[-1] // 2
    freqs = rope.frequencies(x.shape[-1])
    if positions is None:
        positions = jnp.arange(seq)[None, :]
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [B or 1, S, half]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


def qkv_per_head(x: Any, num_heads: int, num_kv_heads: int = 0) -> Any:
    """The fused projection's columns (last axis) from (q heads, k heads, v heads) order to one
    run per key/value head: its group's queries, its key, its value, each Dh wide (multi-head:
    (head, q/k/v, Dh)). A contiguous split of the columns over the ``tensor`` devices then
    gives each device whole groups (Megatron-LM §3: a head-aligned split needs no exchange
    between the projection and the attention). A NumPy or jax array of any leading shape;
    ``num_kv_heads`` 0: ``num_heads``."""
    *lead, n = x.shape
    kv = num_kv_heads or num_heads
    if kv == num_heads:
        return x.reshape(*lead, 3, kv, n // (3 * kv)).swapaxes(-3, -2).reshape(*lead, n)
    dh = n // (num_heads + 2 * kv)
    q, k, v = x[..., : num_heads * dh], x[..., num_heads * dh : -kv * dh], x[..., -kv * dh :]
    runs = (q.reshape(*lead, kv, -1), k.reshape(*lead, kv, dh), v.reshape(*lead, kv, dh))
    return jnp.concatenate(runs, axis=-1).reshape(*lead, n)


def _per_head_init(init: Initializer, num_heads: int, num_kv_heads: int) -> Initializer:
    """``init`` of the fused kernel, drawn in (q heads, k heads, v heads) column order and
    stored per group (`qkv_per_head`): a seed gives the multi-head model it gave when the
    columns were (q/k/v, head, Dh)."""

    def draw(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        return qkv_per_head(init(key, shape, dtype), num_heads, num_kv_heads)

    return draw


QK_NORMS = ("none", "head", "full")


class CausalSelfAttention(nnx.Module):
    """``num_kv_heads`` (0: ``num_heads``) key/value heads; ``positional``: RoPE's frequencies
    when ``rope``; ``bias``: whether the projections have biases (GPT's do, Llama's do not);
    ``qkv_bias``: the fused query/key/value projection has one all the same (Qwen2's);
    ``qk_norm`` (`QK_NORMS`): queries and keys RMS-normalised before RoPE, per head (Qwen3) or
    over all heads' features together (OLMoE), with epsilon ``norm_eps``."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        rope: bool,
        out_std: float,
        rngs: nnx.Rngs,
        num_kv_heads: int = 0,
        positional: Rope = Rope(),
        bias: bool = True,
        qkv_bias: bool = False,
        qk_norm: str = "none",
        norm_eps: float = 1e-6,
    ):
        init = nnx.initializers.normal(0.02)
        self.num_heads, self.rope, self.positional = num_heads, rope, positional
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
        head_dim = d_model // num_heads
        # Columns per key/value group (`qkv_per_head`): [D, Hkv x (G q, k, v) x Dh].
        self.qkv = nnx.Linear(
            d_model,
            (num_heads + 2 * self.num_kv_heads) * head_dim,
            kernel_init=_per_head_init(init, num_heads, self.num_kv_heads),
            use_bias=bias or qkv_bias,
            rngs=rngs,
        )
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={qk_norm!r} is not one of {QK_NORMS}")
        self.qk_norm = qk_norm
        if qk_norm != "none":
            q_width, k_width = (head_dim, head_dim) if qk_norm == "head" else (
                num_heads * head_dim, self.num_kv_heads * head_dim
            )
            self.q_norm = nnx.RMSNorm(q_width, epsilon=norm_eps, rngs=rngs)
            self.k_norm = nnx.RMSNorm(k_width, epsilon=norm_eps, rngs=rngs)
        self.out = nnx.Linear(
            d_model,
            d_model,
            kernel_init=nnx.initializers.normal(out_std),
            use_bias=bias,
            rngs=rngs,
        )

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    def _heads(self, y: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The fused projection's output [B, S, Hkv x (G + 2) x Dh] as queries [B, S, H, Dh],
        keys and values [B, S, Hkv, Dh]."""
        b, s = y.shape[:2]
        g = self.group
        y = y.reshape(b, s, self.num_kv_heads, g + 2, -1)
        return y[:, :, :, :g].reshape(b, s, self.num_heads, -1), y[:, :, :, g], y[:, :, :, g + 1]

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
            q, k, v = self._heads(linear(self.qkv, x, "attn/qkv", sparse))
            key_positions = positions
        else:
            q, k, v = self._split_projection(x, context, sparse)
            key_positions = jnp.arange(context.shape[1])[None, :]
        q, k = self._positioned(q, positions), self._positioned(k, key_positions, keys=True)
        if hashed is not None:
            if context is not None:
                raise ValueError("hashed attention attends within its own tokens: no context")
            if self.group > 1:  # each key/value head serves its group of query heads
                k, v = jnp.repeat(k, self.group, axis=2), jnp.repeat(v, self.group, axis=2)
            y, metrics = hashed_attention(q, k, v, hashed, parallel)
            return linear(self.out, y.reshape(b, s, d), "attn/out", sparse), metrics
        mask = None  # causal in the original order: positions ascend, so a subset keeps it
        if context is not None:  # queries at ``positions`` of the context's 0..T-1
            query_positions = jnp.arange(s)[None, :] if positions is None else positions
            mask = query_positions[:, None, :, None] >= key_positions[:, None, None, :]
        y = dense_attention.causal(q, k, v, mask).reshape(b, s, d)
        return linear(self.out, y, "attn/out", sparse), {}

    def _positioned(
        self, x: jax.Array, positions: jax.Array | None, *, keys: bool = False
    ) -> jax.Array:
        """Queries (or ``keys``) [B, S, heads, Dh] as attention compares them: RMS-normalised
        (``qk_norm``), then rotated to their ``positions`` (RoPE)."""
        if self.qk_norm != "none":
            x = self._normed(self.k_norm if keys else self.q_norm, x)
        return rotary(x, positions, self.positional) if self.rope else x

    def project(
        self, x: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries [B, S, H, Dh], keys and values [B, S, Hkv, Dh] of ``x`` at ``positions``
        [B, S], normalised and rotated as `__call__` compares them: what a decoder attends
        with and keeps in its cache (`dynjax.model.decode`)."""
        q, k, v = self._heads(self.qkv(x))
        return self._positioned(q, positions), self._positioned(k, positions, keys=True), v

    def project_keys(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Only the keys and values of `project`: a token that skips the layer still leaves
        them for the later tokens (early exit's state propagation while decoding)."""
        k, v = self._keys_values(x)
        return self._positioned(k, positions, keys=True), v

    def attend(
        self,
        q: jax.Array,
        keys: jax.Array,
        values: jax.Array,
        visible: jax.Array,
        hashed: HashedAttention | None = None,
    ) -> jax.Array:
        """The output [B, S, D] of queries ``q`` [B, S, H, Dh] over cached ``keys``, ``values``
        [B, T, Hkv, Dh], each query seeing the keys ``visible`` [B, S, T] marks; ``hashed``:
        only those of its own LSH bucket as well, the rule `hashed_attention` computes (a query
        seeing none gets zeros)."""
        b, s, h, dh = q.shape
        visible = visible[:, None]
        if hashed is not None:
            rot = rotations(hashed, h, dh)
            keys_per_head = jnp.repeat(keys, self.group, axis=2) if self.group > 1 else keys
            q_bucket, k_bucket = lsh_buckets(q, rot), lsh_buckets(keys_per_head, rot)
            same = q_bucket.transpose(0, 2, 1)[..., None] == k_bucket.transpose(0, 2, 1)[:, :, None]
            visible = visible & same  # [B, H, S, T]
        y = dense_attention.causal(q, keys, values, visible)
        seen = jnp.any(visible, -1).transpose(0, 2, 1)[..., None]  # [B, S, 1|H, 1]
        return self.out((y * seen).reshape(b, s, h * dh))

    def _normed(self, norm: nnx.RMSNorm, x: jax.Array) -> jax.Array:
        """``x`` [B, S, heads, Dh] normalised per head, or over all its heads' features."""
        if self.qk_norm == "head":
            return norm(x)
        return norm(x.reshape(*x.shape[:2], -1)).reshape(x.shape)

    def _split_projection(
        self, x: jax.Array, context: jax.Array, sparse: SparseLinears | None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries of ``x`` [B, S, H, Dh], keys and values of ``context`` [B, T, Hkv, Dh]:
        only the query columns of the projection multiply the subset (a block-sparse projection
        multiplies whole, then splits)."""
        d, h, kv, g = x.shape[-1], self.num_heads, self.num_kv_heads, self.group
        if sparse is not None and sparse.width("attn/qkv") is not None:
            q = self._heads(linear(self.qkv, x, "attn/qkv", sparse))[0]
            _, k, v = self._heads(linear(self.qkv, context, "attn/qkv", sparse))
            return q, k, v
        # the columns per group (`qkv_per_head`): [D, Hkv, (G q, k, v), Dh]
        w = self.qkv.kernel[...].reshape(d, kv, g + 2, -1)
        q = jnp.einsum("bsd,dhe->bshe", x, w[:, :, :g].reshape(d, h, -1))
        if self.qkv.bias is not None:
            q = q + self.qkv.bias[...].reshape(kv, g + 2, -1)[:, :g].reshape(h, -1)
        return q, *self._keys_values(context)

    def _keys_values(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values [B, T, Hkv, Dh] of ``x`` [B, T, D] from their columns of the fused
        projection alone (before normalisation and RoPE)."""
        d, kv, g = x.shape[-1], self.num_kv_heads, self.group
        w = self.qkv.kernel[...].reshape(d, kv, g + 2, -1)
        out = jnp.einsum("btd,dhce->bthce", x, w[:, :, g:])
        if self.qkv.bias is not None:
            out = out + self.qkv.bias[...].reshape(kv, g + 2, -1)[:, g:]
        return out[:, :, :, 0], out[:, :, :, 1]
