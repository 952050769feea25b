"""Mixture of depths (Raposo et al. 2024; seed 000 §2.6): a routed block computes only the top
fraction of each sequence's tokens.

A linear router scores every token; the top ``tokens`` of each sequence (a static count, so the
compiled block is that much smaller) are gathered in their original order, run through the
block's attention and MLP with their original positions (RoPE and the causal mask stay those of
the full sequence), and scattered back as ``x + sigmoid(r) * (block(x) - x)``: scaling by the
router weight puts the router on the gradient path. The other tokens skip the block (the
residual path). Top-k over a sequence is not causal, so a small predictor (an MLP on the
stop-gradient input, as in the paper's §3.5) learns to tell which tokens the router picks: its
binary cross entropy is a loss term of the training loss, and its accuracy a metric.

At inference (`LayerContext.inference`: evaluation) with ``eval_routing="predictor"`` the block
routes as causal sampling does (the paper's §3.5): a token goes through it iff its predictor
logit is positive, the first ``tokens`` such tokens of each sequence in position order fill the
same static bucket, and later ones take the residual path. A token's route then depends only on
itself and the tokens before it, so the evaluation loss is the one sampling would see.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dynjax.model.hooks import (
    HookSet,
    LayerContext,
    Residual,
)

NAME = "mod"
ACCURACY, PREDICTOR_LOSS, ROUTER_WEIGHT, ROUTED = (f"{NAME}/{m}" for m in (
    "predictor_accuracy", "predictor_loss", "router_weight", "routed_fraction"))
LOSS = f"{NAME}/loss"  # predictor_weight x the predictor's loss: the term the step minimises


@dataclasses.dataclass(frozen=True)
class RoutedBlock:
    """A routed layer's static record: how many tokens of each sequence its block computes, the
    weight of its predictor's loss, and how it routes at inference (`EVAL_ROUTINGS`)."""

    tokens: int
    predictor_weight: float
    eval_routing: str


# At inference: by the causal predictor (what sampling can do), or the training's top-k.
EVAL_ROUTINGS = ("predictor", "topk")


class DepthRouter(nnx.Module):
    """The router (one linear score per token) and the causal predictor of one routed block."""

    def __init__(self, cfg: Any, predictor_hidden: int, rngs: nnx.Rngs):
        d, init = cfg.d_model, nnx.initializers.normal(0.02)
        self.router = nnx.Linear(d, 1, kernel_init=init, rngs=rngs)
        self.predictor_hidden = nnx.Linear(d, predictor_hidden, kernel_init=init, rngs=rngs)
        self.predictor_out = nnx.Linear(predictor_hidden, 1, kernel_init=init, rngs=rngs)

    def predict(self, x: jax.Array) -> jax.Array:
        """[B, S] logits that each token is among its sequence's top-k (stop-gradient input: the
        predictor must not change what it predicts)."""
        h = jax.nn.silu(self.predictor_hidden(jax.lax.stop_gradient(x)))
        return self.predictor_out(h)[..., 0].astype(jnp.float32)


def route_depth(
    residual: Residual,
    x: jax.Array,
    record: RoutedBlock,
    part: DepthRouter,
    context: LayerContext,
) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
    """The routed block: ``record.tokens`` tokens of each sequence through ``residual``, the
    others unchanged; the router's top-k in training, the predictor's first members at
    inference (see the module docstring)."""
    b, s, _ = x.shape
    scores = part.router(x)[..., 0].astype(jnp.float32)  # [B, S]
    logits = part.predict(x)
    causal = context.inference and record.eval_routing == "predictor"
    if causal:
        chosen, valid = predicted_members(logits, record.tokens)
    else:
        _, top = jax.lax.top_k(scores, record.tokens)
        chosen = jnp.sort(top, axis=-1)  # [B, k]: original order, so causality holds in the subset
        valid = jnp.ones(chosen.shape, bool)
    picked = jnp.take_along_axis(x, chosen[..., None], axis=1)
    computed, stats, inner = residual(picked, chosen)
    weight = jax.nn.sigmoid(jnp.take_along_axis(scores, chosen, axis=1))[..., None]
    routed = picked + weight.astype(x.dtype) * (computed - picked)
    rows = jnp.arange(b)[:, None]
    out = x.at[rows, chosen].set(jnp.where(valid[..., None], routed, picked))
    router_weight = jnp.sum(weight[..., 0] * valid) / jnp.maximum(jnp.sum(valid), 1)
    if causal:
        return out, stats, {
            **inner,
            ROUTED: jnp.mean(jnp.sum(valid, axis=1) / s),
            ROUTER_WEIGHT: router_weight,
        }
    member = jnp.zeros((b, s), jnp.float32).at[rows, chosen].set(1.0)
    predictor_loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, member))
    metrics = {
        **inner,
        PREDICTOR_LOSS: predictor_loss,
        LOSS: record.predictor_weight * predictor_loss,
        ACCURACY: jnp.mean(((logits > 0) == (member > 0)).astype(jnp.float32)),
        ROUTER_WEIGHT: router_weight,
    }
    return out, stats, metrics


def predicted_members(logits: jax.Array, tokens: int) -> tuple[jax.Array, jax.Array]:
    """The causal route: (chosen [B, k] positions, valid [B, k]) where the first ``valid`` slots
    hold, in order, the first ``tokens`` positions whose predictor logit is positive. Slots past
    them (fewer members than the bucket) hold the first non-members, after every member: the
    subset's causal triangle keeps them out of the members' attention, and their outputs are
    dropped."""
    s = logits.shape[1]
    member = logits > 0
    position = jnp.arange(s)[None, :]
    key = jnp.where(member, position, s + position)  # members first, each group in order
    _, chosen = jax.lax.top_k(-key, tokens)  # the ``tokens`` smallest keys, ascending
    return chosen, jnp.take_along_axis(member, chosen, axis=1)


HOOKS = HookSet(
    NAME, wrapper=route_depth, part=DepthRouter, reductions=((LOSS, "mean"),), losses=(LOSS,)
)
