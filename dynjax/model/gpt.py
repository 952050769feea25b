"""Decoder-only GPT whose layers are a Python list of blocks, each with its own parameters.

A list rather than a scanned stack because layer shapes diverge during dynamic training (MoE
capacities, pruned widths) and layers move between pipeline stages (DESIGN.md "Parallelism").
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dynjax.model.attention import CausalSelfAttention
from dynjax.model.mlp import MLP
from dynjax.model.moe import MoE, MoEStats


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    num_layers: int
    d_model: int
    num_heads: int
    mlp_dim: int
    max_len: int
    positions: str = "rope"  # "rope" | "learned"
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 8
    top_k: int = 2
    expert_mlp_dim: int = 0  # 0: mlp_dim

    @property
    def residual_std(self) -> float:
        """GPT-2's scaled init of residual projections keeps activations flat with depth."""
        return 0.02 / math.sqrt(2 * self.num_layers)


class Block(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + ffn(norm(x)) with an MLP or MoE ffn."""

    def __init__(self, cfg: GPTConfig, index: int, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.norm1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = CausalSelfAttention(
            d, cfg.num_heads, rope=cfg.positions == "rope", out_std=cfg.residual_std, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(d, rngs=rngs)
        self.is_moe = index in cfg.moe_layers
        if self.is_moe:
            hidden = cfg.expert_mlp_dim or cfg.mlp_dim
            self.moe = MoE(
                d, hidden, cfg.num_experts, cfg.top_k, out_std=cfg.residual_std, rngs=rngs
            )
        else:
            self.mlp = MLP(d, cfg.mlp_dim, out_std=cfg.residual_std, rngs=rngs)

    def __call__(self, x, *, capacities=None, parallel=None, cached=None):
        x = x + self.attn(self.norm1(x))
        if not self.is_moe:
            return x + self.mlp(self.norm2(x)), None
        y, stats = self.moe(self.norm2(x), capacities=capacities, parallel=parallel, cached=cached)
        return x + y, stats


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size, cfg.d_model, embedding_init=nnx.initializers.normal(0.02), rngs=rngs
        )
        if cfg.positions == "learned":
            self.pos = nnx.Param(
                nnx.initializers.normal(0.01)(rngs.params(), (cfg.max_len, cfg.d_model))
            )
        self.layers = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(
            cfg.d_model, cfg.vocab_size, kernel_init=nnx.initializers.normal(0.02), rngs=rngs
        )

    def __call__(
        self,
        tokens: jax.Array,
        *,
        capacities: tuple[tuple[int, ...], ...] = (),
        parallel=None,
        cached: tuple[jax.Array, ...] | None = None,
    ) -> tuple[jax.Array, tuple[MoEStats, ...]]:
        """tokens [B, S] -> (logits [B, S, V] float32, stats of each MoE layer in order)."""
        if len(capacities) != len(self.cfg.moe_layers):
            raise ValueError(
                f"{len(capacities)} capacity tuples for {len(self.cfg.moe_layers)} MoE layers"
            )
        x = self.embed(tokens)
        if self.cfg.positions == "learned":
            x = x + self.pos[: tokens.shape[1]].astype(x.dtype)
        stats = []
        for block in self.layers:
            j = len(stats)
            x, s = block(
                x,
                capacities=capacities[j] if block.is_moe else None,
                parallel=parallel,
                cached=cached[j] if (block.is_moe and cached is not None) else None,
            )
            if s is not None:
                stats.append(s)
        return self.head(self.norm(x)).astype(jnp.float32), tuple(stats)


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross entropy."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
