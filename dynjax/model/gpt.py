"""Decoder-only GPT whose layers are a Python list of blocks, each with its own parameters.

A list rather than a scanned stack because layer shapes diverge during dynamic training (MoE
capacities, pruned widths) and layers move between pipeline stages (DESIGN.md "Parallelism").
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dynjax.model.attention import CausalSelfAttention
from dynjax.model.hashed_attention import hashed_record
from dynjax.model.hooks import (
    BlockPart,
    LayerContext,
    LayerOptions,
    apply_block_hooks,
    apply_weight_hooks,
    block_wrapper,
    make_block_part,
)
from dynjax.model.mlp import MLP
from dynjax.model.moe import MoE, MoEStats
from dynjax.model.pruned import sparse_linears


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
    routing: str = "token_choice"  # `dynjax.model.moe.ROUTINGS`
    routed_bias: bool = False  # a `RoutedBias` per MoE block (auxiliary-loss-free balancing)
    # Plugins' extra submodules per layer: (layer, part name, settings), `hooks.BlockPart`.
    block_parts: tuple[BlockPart, ...] = ()

    @property
    def residual_std(self) -> float:
        """GPT-2's scaled init of residual projections keeps activations flat with depth."""
        return 0.02 / math.sqrt(2 * self.num_layers)


# The matrices GPT-2 initialises with `GPTConfig.residual_std` rather than 0.02: the projections
# back into the residual stream. Matched with `re.search` against "/"-joined parameter paths.
RESIDUAL_PROJECTIONS = r"(^|/)(attn/out/kernel|mlp/down/kernel|moe/w_out)$"


def init_std(cfg: GPTConfig, path: str) -> float:
    """The standard deviation the matrix at ``path`` is initialised with (``Block`` below):
    the unit in which a scale-free magnitude ranking (pruning) measures its weights."""
    return cfg.residual_std if re.search(RESIDUAL_PROJECTIONS, path) else 0.02


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
                d,
                hidden,
                cfg.num_experts,
                cfg.top_k,
                out_std=cfg.residual_std,
                rngs=rngs,
                routing=cfg.routing,
                routed_bias=cfg.routed_bias,
            )
        else:
            self.mlp = MLP(d, cfg.mlp_dim, out_std=cfg.residual_std, rngs=rngs)
        for layer, name, settings in cfg.block_parts:
            if layer == index:
                if hasattr(self, name):
                    raise ValueError(f"block part {name!r} of layer {index} shadows an attribute")
                setattr(self, name, make_block_part(name, cfg, settings, rngs))

    def __call__(
        self,
        x,
        *,
        capacities=None,
        parallel=None,
        cached=None,
        options: LayerOptions = (),
        context: LayerContext | None = None,
    ):
        """(output, MoE stats or None, the block hooks' metrics) of one layer."""
        # Records read inside the block: block-sparse matmuls, hashed attention.
        sparse, hashed = sparse_linears(options), hashed_record(options)

        def residual(x, positions, whole=None):
            keys = None if whole is None else self.norm1(whole)
            y, metrics = self.attn(self.norm1(x), sparse, positions, hashed, keys)
            x = x + y
            if self.is_moe:
                y, stats = self.moe(
                    self.norm2(x),
                    capacities=capacities,
                    parallel=parallel,
                    cached=cached,
                    chunking=dict(options).get("moe"),  # MPipeMoE's partitions, memory reuse
                )
                return x + y, stats, metrics
            return x + self.mlp(self.norm2(x), sparse), None, metrics

        wrapped = block_wrapper(options)
        if wrapped is None:
            x, stats, inner = residual(x, None)
        else:  # a scheme that picks the tokens the block computes (mixture of depths)
            name, wrapper, record = wrapped
            part = getattr(self, name, None)
            x, stats, inner = wrapper(residual, x, record, part, context or LayerContext())
        x, metrics = apply_block_hooks(x, options)
        return x, stats, {**inner, **metrics}


def run_layers(
    blocks: Sequence[Block],
    x: jax.Array,
    *,
    capacities: Sequence[tuple[int, ...]],
    options: Sequence[LayerOptions] | None,
    parallel,
    cached: jax.Array | Sequence[jax.Array] | None,
    context: LayerContext | None = None,
) -> tuple[jax.Array, tuple[MoEStats, ...], tuple[dict[str, jax.Array], ...]]:
    """The one layer loop of the model and of every pipeline stage.

    ``capacities`` and ``cached`` hold one entry per MoE block of ``blocks`` in order;
    ``options`` one `LayerOptions` per block (None: none); ``context`` what the block wrappers
    share (`LayerContext`; default: none of it). Returns the output, the MoE blocks' stats in
    order and each block's hook metrics.
    """
    context = context if context is not None else LayerContext()
    if len(capacities) != sum(b.is_moe for b in blocks):
        raise ValueError(
            f"{len(capacities)} capacity tuples for {sum(b.is_moe for b in blocks)} MoE layers"
        )
    options = options if options is not None else ((),) * len(blocks)
    stats, metrics = [], []
    for block, opts in zip(blocks, options, strict=True):
        j = len(stats)
        block, weight_metrics = apply_weight_hooks(block, opts)
        x, s, m = block(
            x,
            capacities=capacities[j] if block.is_moe else None,
            parallel=parallel,
            cached=cached[j] if (block.is_moe and cached is not None) else None,
            options=opts,
            context=context,
        )
        if s is not None:
            stats.append(s)
        metrics.append({**weight_metrics, **m})
    return x, tuple(stats), tuple(metrics)


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
        logits, stats, _ = self.forward(
            tokens, capacities=capacities, parallel=parallel, cached=cached
        )
        return logits, stats

    def forward(
        self,
        tokens: jax.Array,
        *,
        capacities: tuple[tuple[int, ...], ...] = (),
        parallel=None,
        cached: tuple[jax.Array, ...] | None = None,
        options: Sequence[LayerOptions] | None = None,
        targets: jax.Array | None = None,
        inference: bool = False,
    ):
        """`__call__` with each layer's options: also returns each layer's hook metrics.
        ``targets`` [B, S]: the next tokens, for wrappers that take a loss inside the stack;
        ``inference``: run the wrappers as evaluation or sampling does (`LayerContext`)."""
        x = self.embed(tokens)
        if self.cfg.positions == "learned":
            x = x + self.pos[: tokens.shape[1]].astype(x.dtype)
        x, stats, metrics = run_layers(
            list(self.layers),
            x,
            capacities=capacities,
            options=options,
            parallel=parallel,
            cached=cached,
            context=LayerContext(readout=self.readout, targets=targets, inference=inference),
        )
        return self.readout(x), stats, metrics

    def readout(self, x: jax.Array) -> jax.Array:
        """Hidden states [..., D] -> float32 logits: the final norm and the LM head."""
        return self.head(self.norm(x)).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """The graph of each parameter unit of a GPT, so a pipeline stage, or a forward run stage by
    stage (freezing's plasticity probe), can run just its own units."""

    cfg: GPTConfig
    embed: Any  # nnx.GraphDef of each unit
    layers: tuple[Any, ...]
    norm: Any
    head: Any

    @classmethod
    def of(cls, cfg: GPTConfig) -> ModelParts:
        model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
        return cls(
            cfg=cfg,
            embed=nnx.graphdef(model.embed),
            layers=tuple(nnx.graphdef(block) for block in model.layers),
            norm=nnx.graphdef(model.norm),
            head=nnx.graphdef(model.head),
        )

    @property
    def learned_positions(self) -> bool:
        return self.cfg.positions == "learned"


def fresh_params(cfg: GPTConfig, seed: int) -> dict[str, Any]:
    """A new model's parameters as a pure dict (the NNX state without the modules)."""
    return nnx.to_pure_dict(nnx.state(GPT(cfg, rngs=nnx.Rngs(seed))))


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross entropy."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
