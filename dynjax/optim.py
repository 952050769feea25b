"""AdamW with linear warmup, cosine decay and global-norm clipping."""

from __future__ import annotations

import jax
import optax


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


def clip_gradients(max_norm: float) -> optax.GradientTransformation:
    """Global-norm clipping to ``max_norm``; 0 = no clipping (nanoGPT's convention).

    Both branches keep an empty state, so the optimizer state has one layout whatever the bound
    (a checkpoint resumes under another ``train.grad_clip``).
    """
    return optax.clip_by_global_norm(max_norm) if max_norm > 0 else optax.identity()


def make_optimizer(train_cfg) -> optax.GradientTransformation:
    """Weight decay applies to matrices only (not norms, biases or the router's scale)."""
    schedule = learning_rate_schedule(
        train_cfg.learning_rate, train_cfg.warmup_steps, train_cfg.steps, train_cfg.min_lr_ratio
    )
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        clip_gradients(train_cfg.grad_clip),
        optax.adamw(
            schedule, b1=0.9, b2=0.95, weight_decay=train_cfg.weight_decay, mask=decay_mask
        ),
    )
