"""The math of gradual global magnitude pruning: schedule, which weights, scores, exact selection
(seed 000 §3.2.1 eq. 3; seed 003 §B.2 eq. 2).

Zhu & Gupta's cubic schedule, and *all* prunable weights of the model ranked together. Unlike
Algorithm 1, which gathers every rank's local top-k on rank 0, `global_masks` is an exact global
top-k in which each pipeline stage sends the host only counts: a bisection on the threshold's
bit pattern (31 rounds), then the ties at the threshold given out in the global order (stages,
then names as given, then flat index); over several processes the counts are summed through
`RunLink.rounds`. The derivation is in docs/schemes/pruning.md "The schedule and the
selection". Scores are the current magnitudes (pruned weights are zero, rank last and stay
pruned; ``element_scores`` and ``block_scores`` also take the current mask).

Example (two stages, one array each; ``keep = 3`` keeps both 5s and the first 2 in global order):
  >>> import numpy as np
  >>> stages = [{"a": np.array([2.0, 5.0, 0.0])}, {"b": np.array([5.0, 2.0])}]
  >>> [{k: np.asarray(m).tolist() for k, m in s.items()} for s in global_masks(stages, 3)]
  [{'a': [True, True, False]}, {'b': [True, False]}]
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dynjax.parallel.peers import ALONE, Rounds

# The matrices of attention (fused q/k/v and the output projection), of the dense MLP (with
# SwiGLU's gate) and of the experts, routed and shared (dynjax/model/{attention,mlp,moe}.py);
# not embeddings, positions, norms, biases, the router or the head. Matched with `re.search`
# against "/"-joined parameter paths.
DEFAULT_INCLUDE = (
    r"(^|/)(attn/(qkv|out)/kernel|(mlp|shared)/(gate|up|down)/kernel|moe/w_(in|out))$"
)

_INF_KEY = 0x7F800000  # bits of float32 +inf: the largest key


# ---------------------------------------------------------------------------------------------
# Schedule (seed 000 §3.2.1 eq. 3)


def _check_schedule(start: int, every: int, steps: int) -> None:
    if start < 0 or every < 1 or steps < 1:
        raise ValueError(
            f"pruning needs start >= 0, every >= 1, steps >= 1; got {start=}, {every=}, {steps=}"
        )


def is_pruning_step(step: int, *, start: int, every: int, steps: int) -> bool:
    """Whether ``step`` is one of the pruning events ``t0, t0 + Δt, ..., t0 + nΔt``."""
    _check_schedule(start, every, steps)
    return step >= start and (step - start) % every == 0 and (step - start) // every <= steps


def sparsity_at(
    step: int, *, initial: float, final: float, start: int, every: int, steps: int
) -> float:
    """The target sparsity in force at ``step``: Zhu & Gupta's cubic schedule, held between events.

    ``S_t = S_f + (S_i - S_f)(1 - (t - t0)/(nΔt))^3`` at ``t = t0 + iΔt`` (``i = 0..n``), the value
    of the last event before ``step`` in between, ``S_f`` from ``t0 + nΔt`` on, and 0 before ``t0``
    (the model is still dense; pruning starts at ``t0`` with ``S_i``). Written as the blend
    ``r S_i + (1 - r) S_f`` with ``r = (n - i)^3 / n^3`` so that both ends are exact.

    Example (the paper's run: 90% from step 3000, every 1000 steps, 4 events):
      >>> [round(sparsity_at(t, initial=0.0, final=0.9, start=3000, every=1000, steps=4), 4)
      ...  for t in (2999, 3000, 4000, 5500, 6000, 7000, 9000)]
      [0.0, 0.0, 0.5203, 0.7875, 0.8859, 0.9, 0.9]
    """
    _check_schedule(start, every, steps)
    if not 0.0 <= initial <= final <= 1.0:
        raise ValueError(f"pruning needs 0 <= initial <= final <= 1; got {initial=}, {final=}")
    if step < start:
        return 0.0
    i = min((step - start) // every, steps)
    r = (steps - i) ** 3 / steps**3
    return r * initial + (1.0 - r) * final


def keep_count(total: int, sparsity: float) -> int:
    """How many of ``total`` entries a ``sparsity`` keeps: ``round((1 - sparsity) * total)``.

    Rounding to nearest (Python's ``round``, ties to even) rather than truncating, so that float
    error in ``1 - sparsity`` (e.g. ``(1 - 0.9) * 100 = 9.999...``) cannot drop an entry.
    """
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1]; got {sparsity}")
    return min(total, max(0, round((1.0 - sparsity) * total)))


# ---------------------------------------------------------------------------------------------
# Which weights


def prunable(path: str, include: str = DEFAULT_INCLUDE) -> bool:
    """Whether the parameter at ``path`` ("/"-joined, e.g. ``layers/3/moe/w_in``) is pruned:
    ``re.search(include, path)`` (``pruning.include`` in the config)."""
    return re.search(include, path) is not None


def prunable_leaves(params: Any, include: str = DEFAULT_INCLUDE) -> dict[str, Any]:
    """The prunable leaves of a parameter tree by "/"-joined path, in the tree's leaf order
    (integer layer keys sort numerically, so this is the model's layer order)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    named = ((jax.tree_util.keystr(p, simple=True, separator="/"), leaf) for p, leaf in flat)
    return {name: leaf for name, leaf in named if prunable(name, include)}


# ---------------------------------------------------------------------------------------------
# Scores


@jax.jit
def element_scores(w: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Unstructured magnitude scores ``|w|`` (float32), 0 where ``mask`` has pruned the entry."""
    s = jnp.abs(w).astype(jnp.float32)
    return s if mask is None else jnp.where(mask, s, 0.0)


def _tiles(w: jax.Array, block_size: int) -> jax.Array:
    """``[..., in, out]`` -> ``[..., in/bs, bs, out/bs, bs]`` (blocks as ``BlockSparseMatrix``)."""
    *lead, k, n = w.shape
    if block_size < 1 or k % block_size or n % block_size:
        raise ValueError(f"shape {w.shape} is not divisible into {block_size}x{block_size} blocks")
    return w.reshape(*lead, k // block_size, block_size, n // block_size, block_size)


@functools.partial(jax.jit, static_argnames="block_size")
def block_scores(w: jax.Array, block_size: int, mask: jax.Array | None = None) -> jax.Array:
    """Frobenius norm of each ``bs x bs`` block of the last two axes (``[in, out]``; expert weights
    ``[E, in, out]`` get blocks per expert): ``[..., in/bs, out/bs]`` float32, 0 where the block
    ``mask`` has pruned the block. Ranking whole blocks is what lets a block-sparse matmul
    (``pallas_kernels.BlockSparseMatrix``, same block grid) skip work."""
    t = _tiles(w.astype(jnp.float32), block_size)
    s = jnp.sqrt(jnp.sum(t * t, axis=(-3, -1)))
    return s if mask is None else jnp.where(mask, s, 0.0)


@functools.partial(jax.jit, static_argnames="block_size")
def expand_blocks(block_mask: jax.Array, block_size: int) -> jax.Array:
    """A ``[..., in/bs, out/bs]`` block mask as the ``[..., in, out]`` element mask it covers."""
    return jnp.repeat(jnp.repeat(block_mask, block_size, axis=-2), block_size, axis=-1)


# ---------------------------------------------------------------------------------------------
# Exact global top-k without gathering: per-stage functions (jitted where the scores live) ...


def _keys(s: jax.Array) -> jax.Array:
    """Order-preserving int32 keys of non-negative float32 scores (negatives and -0.0 count as 0,
    NaN as +inf). Comparing keys, not floats, keeps subnormal scores exact under flush-to-zero."""
    bits = jax.lax.bitcast_convert_type(s.astype(jnp.float32), jnp.int32)
    return jnp.clip(bits, 0, _INF_KEY)


@jax.jit
def count_above(scores: Sequence[jax.Array], t: jax.Array) -> jax.Array:
    """``[len(scores)]`` int32: per array, how many scores have a key above ``t`` (int32 key)."""
    return jnp.array([jnp.sum(_keys(s) > t, dtype=jnp.int32) for s in scores], jnp.int32)


@jax.jit
def count_equal(scores: Sequence[jax.Array], t: jax.Array) -> jax.Array:
    """``[len(scores)]`` int32: per array, how many scores have key ``t``."""
    return jnp.array([jnp.sum(_keys(s) == t, dtype=jnp.int32) for s in scores], jnp.int32)


@jax.jit
def mask_for(scores: Sequence[jax.Array], t: jax.Array, quota: jax.Array) -> tuple[jax.Array, ...]:
    """Keep masks: scores with key above ``t``, and of array ``i``'s ties (key ``t``) its first
    ``quota[i]`` in flat C order."""
    masks = []
    for s, q in zip(scores, quota, strict=True):
        key = _keys(s)
        tie = key == t
        rank = jnp.cumsum(tie.ravel(), dtype=jnp.int32).reshape(s.shape)
        masks.append((key > t) | (tie & (rank <= q)))
    return tuple(masks)


# ... and the host driver, which sees only counts (and, over several processes, exchanges them).


def _fetch(arrays: list[jax.Array]) -> list[np.ndarray]:
    """The one device-to-host transfer of a round: every local stage's small count vector."""
    return [np.asarray(a, dtype=np.int64) for a in jax.device_get(arrays)]


def _counts_above(stages: list[tuple[jax.Array, ...]], t: int, rounds: Rounds) -> int:
    local = int(sum(c.sum() for c in _fetch([count_above(s, np.int32(t)) for s in stages])))
    return sum(rounds.all(local))


def _kth_key(
    stages: list[tuple[jax.Array, ...]], keep: int, rounds: Rounds
) -> tuple[int, int]:
    """The key ``t`` of the ``keep``-th largest score (``keep >= 1``) and how many lie above it.

    Bisection for the smallest ``t`` with fewer than ``keep`` scores above it; that ``t`` is a
    score's key (at ``t - 1`` the count reaches ``keep``, so some score has key ``t``)."""
    lo, hi, above_hi = -1, _INF_KEY, 0  # count_above(lo) = total >= keep > count_above(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        above = _counts_above(stages, mid, rounds)
        if above < keep:
            hi, above_hi = mid, above
        else:
            lo = mid
    return hi, above_hi


def _tie_quotas(ties: list[np.ndarray], remaining: int) -> list[np.ndarray]:
    """Hand ``remaining`` keeps to the tied entries in global order: per stage, per array."""
    quotas = []
    for per_array in ties:
        q = np.zeros(len(per_array), np.int32)
        for i, n in enumerate(per_array):
            q[i] = min(int(n), remaining)
            remaining -= int(q[i])
        quotas.append(q)
    return quotas


def global_masks(
    stage_scores: Sequence[Mapping[str, jax.Array]],
    keep: int,
    rounds: Rounds = ALONE,
) -> list[dict[str, jax.Array]]:
    """Keep masks of the ``keep`` largest scores over all stages (seed 000 §3.2 Alg. 1), ties
    broken by the global order (stages in order, names in each mapping's order, flat C index).

    ``stage_scores[s]`` maps names to non-negative score arrays (``element_scores``,
    ``block_scores``) that may live on stage ``s``'s devices; the masks are computed there, with
    the same shapes and placement. Only per-array counts cross to the host: about 32 rounds of one
    int32 vector per stage. Each array must hold fewer than 2**31 entries.

    ``rounds``: where other processes hold further stages (a pipeline over processes,
    `RunLink.rounds`), ``stage_scores`` are this process's; each round's counts are
    summed over the processes, whose stages come in process order, and ``keep`` counts over all.
    Every process makes the same call.
    """
    names = [list(s) for s in stage_scores]
    stages = [tuple(s[n] for n in ns) for s, ns in zip(stage_scores, names, strict=True)]
    total = sum(rounds.all(sum(int(np.prod(a.shape)) for s in stages for a in s)))
    if not 0 <= keep <= total:
        raise ValueError(f"keep must be in [0, {total}]; got {keep}")
    if keep == 0:  # no k-th largest to search for
        t, quotas = _INF_KEY + 1, [np.zeros(len(s), np.int32) for s in stages]
    else:
        t, above = _kth_key(stages, keep, rounds)
        ties = rounds.all(_fetch([count_equal(s, np.int32(t)) for s in stages]))
        mine = sum(len(per) for per in ties[: rounds.index])
        quotas = _tie_quotas([v for per in ties for v in per], keep - above)
        quotas = quotas[mine : mine + len(stages)]
    masks = [mask_for(s, np.int32(t), q) for s, q in zip(stages, quotas, strict=True)]
    return [dict(zip(ns, m, strict=True)) for ns, m in zip(names, masks, strict=True)]
