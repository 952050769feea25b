"""Early exit (CALM, Schuster et al. 2022; seed 000 §2.5, §4.2.5): confident tokens stop early.

At an exit point (after some layer) the model's own readout (the final norm and LM head, shared
with the last layer) scores every remaining token; a token whose confidence reaches the
threshold exits there. Its loss is taken at its exit: its hidden state is carried unchanged
through the later layers (CALM's state propagation, §3.2), so the model's final readout of it is
its exit prediction, and the later layers still use it for their keys and values, so later
tokens attend to it. Confidence is ``softmax_max`` (the top probability of the exit's
prediction) or ``state`` (the cosine similarity of the token's hidden state before and after the
exit layer; CALM §3.1).

Compute shrinks: a layer after the first exit point computes its queries, attention rows and MLP
only for ``tokens`` tokens of each sequence (a static bucket from the Plan), the remaining ones
gathered in position order; keys and values still come from the whole sequence. Remaining
tokens beyond the bucket are forced to exit at that layer and counted (``forced``).

Every exit point also learns: its cross entropy over the tokens present there, weighted, is a
loss term (CALM's weighted per-exit losses, §4), so exits become confident before tokens use
them. Before ``active`` (the plugin's start step) no token exits but the exit losses train.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from dynjax.model.hooks import (
    HookSet,
    LayerContext,
    Residual,
)

NAME = "early_exit"
REMAINING = f"{NAME}/remaining"  # carry: [B, S] bool, the tokens that have not exited
PROCESSED, FORCED, NEEDED_HIST = (f"{NAME}/{m}" for m in ("processed", "forced", "needed_hist"))
EXIT_CE, EXITED, CONFIDENCE = (f"{NAME}/{m}" for m in ("exit_ce", "exited", "confidence"))
LOSS = f"{NAME}/loss"  # an exit point's weight x its cross entropy: a term of the training loss
CONFIDENCES = ("softmax_max", "state")


@dataclasses.dataclass(frozen=True)
class ExitLayer:
    """A layer's static record: how many tokens of each sequence it computes (``tokens`` equal
    to the sequence: all), and, for an exit point after it, its loss weight (0: no exit point),
    the confidence measure and threshold, and whether tokens exit yet."""

    tokens: int
    exit_weight: float = 0.0
    confidence: str = "softmax_max"
    threshold: float = 0.9
    active: bool = False


def confidence(measure: str, before: jax.Array, after: jax.Array, logits: jax.Array) -> jax.Array:
    """[B, k] confidence of each token at an exit: the top softmax probability of its exit
    logits, or the cosine similarity of its hidden state before and after the exit layer."""
    if measure == "softmax_max":
        return jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)
    a, b = before.astype(jnp.float32), after.astype(jnp.float32)
    dot = jnp.sum(a * b, axis=-1)
    return dot / jnp.maximum(jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1), 1e-9)


def bucket_remaining(remaining: jax.Array, tokens: int) -> jax.Array:
    """[B, tokens] positions a bucketed layer computes: each sequence's remaining tokens first,
    in position order (those beyond the bucket are forced out), padded with exited ones, then
    sorted, so positions ascend and the causal order holds in the subset."""
    seq = remaining.shape[1]
    order = jnp.where(remaining, 0, seq) + jnp.arange(seq)[None, :]
    _, first = jax.lax.top_k(-order, tokens)
    return jnp.sort(first, axis=-1)


def run_exit_layer(
    residual: Residual,
    x: jax.Array,
    record: ExitLayer,
    part: Any,
    context: LayerContext,
) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
    """One layer at or after the first exit point (see the module docstring)."""
    del part
    if context.readout is None or context.targets is None:
        raise ValueError(
            "early exit needs the model's readout and the targets inside the stack: run it "
            "through GPT.forward(..., targets=...) or a pipeline stage (which gets what the "
            "wrapper's registered needs name)"
        )
    b, s, _ = x.shape
    remaining = context.carry.get(REMAINING, jnp.ones((b, s), bool))
    counts = jnp.sum(remaining, axis=1)
    metrics = {NEEDED_HIST: jnp.zeros(s + 1, jnp.float32).at[counts].add(1.0)}
    rows = jnp.arange(b)[:, None]
    if record.tokens >= s:  # the whole sequence: no gather
        chosen, picked, targets = None, x, context.targets
        present = remaining
        computed, stats, inner = residual(x, None)
    else:
        chosen = bucket_remaining(remaining, record.tokens)
        picked = jnp.take_along_axis(x, chosen[..., None], axis=1)
        targets = jnp.take_along_axis(context.targets, chosen, axis=1)
        present = jnp.take_along_axis(remaining, chosen, axis=1)
        computed, stats, inner = residual(picked, chosen, x)
    metrics[FORCED] = (jnp.sum(counts) - jnp.sum(present)).astype(jnp.float32)
    metrics[PROCESSED] = jnp.mean(present.astype(jnp.float32)) * (present.shape[1] / s)
    # An exited (or padding) token keeps its state: no later layer changes it.
    after = jnp.where(present[..., None], computed, picked)
    if record.exit_weight > 0:
        logits = context.readout(after)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        weight = present.astype(jnp.float32)
        exit_ce = jnp.sum(ce * weight) / jnp.maximum(jnp.sum(weight), 1.0)
        conf = jax.lax.stop_gradient(confidence(record.confidence, picked, after, logits))
        exits = present & (conf >= record.threshold) if record.active else jnp.zeros_like(present)
        present = present & ~exits
        metrics.update({
            EXIT_CE: exit_ce,
            LOSS: record.exit_weight * exit_ce,
            EXITED: jnp.sum(exits).astype(jnp.float32) / (b * s),
            CONFIDENCE: jnp.sum(conf * weight) / jnp.maximum(jnp.sum(weight), 1.0),
        })
    if chosen is None:
        context.carry[REMAINING] = present
        return after, stats, {**inner, **metrics}
    context.carry[REMAINING] = jnp.zeros((b, s), bool).at[rows, chosen].set(present)
    return x.at[rows, chosen].set(after), stats, {**inner, **metrics}


HOOKS = HookSet(
    NAME,
    wrapper=run_exit_layer,
    needs=frozenset({"readout", "targets"}),
    carry=((REMAINING, jnp.bool_, True),),
    reductions=(
        (NEEDED_HIST, "sum"), (FORCED, "sum"), (PROCESSED, "mean"), (EXIT_CE, "mean"),
        (LOSS, "mean"), (EXITED, "mean"), (CONFIDENCE, "mean"),
    ),
    losses=(LOSS,),
)
