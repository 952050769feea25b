"""AdamW with linear warmup, cosine decay and global-norm clipping."""

from __future__ import annotations

import dataclasses

import jax
import optax

ROUTER = "router"  # the MoE router's parameter name (`dynjax.model.moe.MoE.router`)


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """The `train` keys the optimizer reads, unpacked at the edge
    (`dynjax.settings.optimizer_settings`; their defaults and meanings are the config's)."""

    learning_rate: float
    warmup_steps: int
    steps: int
    min_lr_ratio: float
    weight_decay: float
    grad_clip: float


def learning_rate_schedule(
    peak: float, warmup: int, total: int, min_ratio: float
) -> optax.Schedule:
    warmup = min(warmup, max(total - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=warmup,
        decay_steps=max(total, warmup + 1),
        end_value=peak * min_ratio,
    )


def decay_mask(params):
    """True for the leaves weight decay applies to: matrices, except the MoE router's.

    Norm scales and biases are vectors. Shrinking the router's weights flattens the routing
    softmax: how evenly tokens spread is left to the balance loss and its weight
    (``moe.aux_loss_weight``), not to ``train.weight_decay``.
    """

    def decayed(path, p) -> bool:
        return p.ndim >= 2 and getattr(path[-1], "key", None) != ROUTER

    return jax.tree_util.tree_map_with_path(decayed, params)


def clip_gradients(max_norm: float) -> optax.GradientTransformation:
    """Global-norm clipping to ``max_norm``; 0 = no clipping (nanoGPT's convention).

    Both branches keep an empty state, so the optimizer state has one layout whatever the bound
    (a checkpoint resumes under another ``train.grad_clip``).
    """
    return optax.clip_by_global_norm(max_norm) if max_norm > 0 else optax.identity()


def make_optimizer(s: OptimizerSettings) -> optax.GradientTransformation:
    """AdamW (b2 0.95) after global-norm clipping, weight decay on `decay_mask`'s leaves."""
    schedule = learning_rate_schedule(s.learning_rate, s.warmup_steps, s.steps, s.min_lr_ratio)
    return optax.chain(
        clip_gradients(s.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=s.weight_decay, mask=decay_mask),
    )
