"""Hash-based dynamic sparse attention (Pagliardini et al. 2023; seed 000 §2.4, §4.2.4).

Per head, queries and keys are hashed by angular LSH into ``buckets`` buckets (random rotations
R fixed per layer, not trained: bucket = argmax([xR, -xR])). A query attends to the keys of its
own bucket whose position is not after its own: causal in the original order. Each head's
queries and keys are sorted by (bucket, position) and cut into blocks of ``block`` tokens; a
query block can only match key blocks whose bucket range overlaps its own and whose first
position is not after its last, so only those *needed* blocks hold work.

This XLA path computes a static ``budget`` of key blocks per query block (the needed ones first,
in sorted order; the Plan holds the budget, so the compiled program is that much smaller). It
equals the dense masked reference whenever the budget covers a query block's needed blocks;
otherwise the needed blocks beyond it are dropped and counted as overflow (like dropped MoE
tokens), and a policy (`dynjax.dynamism.sparse_attention`) sizes the budget from the observed
counts. A query whose bucket holds no visible key gets a zero output.

With ``kernel="pallas"`` the sorted queries, keys and values go to
``pallas_kernels.hashed_block_sparse_attention`` instead: it builds the needed-block lists on
device from the same ranges and computes every needed block, the element mask in-kernel, with no
budget (overflow is 0). Compiled on a GPU, interpreted elsewhere (``pallas_kernels.backend``).
On a mesh of several devices the kernel runs under ``jax.shard_map``, each device on its own
rows of the batch (and its heads, over ``tensor``): compiled, it is one custom call, which GSPMD
cannot split and would run on the whole gathered batch on every device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dynjax.model.hooks import HookSet, LayerOptions
from dynjax.model.moe import ExpertParallel
from pallas_kernels import hashed_block_sparse_attention
from pallas_kernels.block_index import range_blocks

NAME = "sparse_attention"
NEEDED_HIST, OVERFLOW, PAIR_FRACTION = (f"{NAME}/{m}" for m in (
    "needed_hist", "overflow", "pair_fraction"))
HOOKS = HookSet(
    NAME, reductions=((NEEDED_HIST, "sum"), (OVERFLOW, "mean"), (PAIR_FRACTION, "mean"))
)


@dataclasses.dataclass(frozen=True)
class HashedAttention:
    """A layer's static record: its hashing (``buckets``, rotations from ``seed`` and
    ``layer``), its block size, its key-block budget per query block (the XLA path's) and the
    path: ``"xla"`` (budgeted) or ``"pallas"`` (the kernel, every needed block)."""

    buckets: int
    block: int
    budget: int
    seed: int
    layer: int
    kernel: Literal["xla", "pallas"] = "xla"


def hashed_record(options: LayerOptions) -> HashedAttention | None:
    return dict(options).get(NAME)


def rotations(record: HashedAttention, heads: int, head_dim: int) -> jax.Array:
    """[H, Dh, buckets // 2] Gaussian rotations of the layer, fixed by seed and layer index."""
    key = jax.random.fold_in(jax.random.key(record.seed), record.layer)
    return jax.random.normal(key, (heads, head_dim, record.buckets // 2), jnp.float32)


def lsh_buckets(x: jax.Array, rot: jax.Array) -> jax.Array:
    """[B, S, H, Dh] -> [B, S, H] bucket ids: argmax of [xR, -xR] (angular LSH)."""
    proj = jnp.einsum("bshd,hdr->bshr", x.astype(jnp.float32), rot)
    return jnp.argmax(jnp.concatenate([proj, -proj], axis=-1), axis=-1).astype(jnp.int32)


def _sorted(buckets: jax.Array) -> jax.Array:
    """[B, H, S] the permutation that sorts each head's tokens by (bucket, position)."""
    b, s, h = buckets.shape
    keys = jnp.moveaxis(buckets, 1, 2) * s + jnp.arange(s, dtype=jnp.int32)
    return jnp.argsort(keys, axis=-1)


# [B, H, nb, nb] whether a (sorted) query block and key block can hold a visible pair: overlapping
# bucket ranges and a key position not after the query block's last. One rule for both paths.
needed_blocks = range_blocks


def hashed_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    record: HashedAttention,
    parallel: ExpertParallel | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """q, k, v [B, S, H, Dh] (positions already applied) -> ([B, S, H, Dh], metrics);
    ``parallel``: the mesh whose token axes split the batch (the Pallas path's `shard_map`)."""
    b, s, h, dh = q.shape
    block, budget = record.block, record.budget
    nb = s // block
    rot = rotations(record, h, dh)
    q_bucket, k_bucket = lsh_buckets(q, rot), lsh_buckets(k, rot)
    q_perm, k_perm = _sorted(q_bucket), _sorted(k_bucket)  # [B, H, S]
    take = lambda x, perm: jnp.take_along_axis(jnp.moveaxis(x, 1, 2), perm[..., None], axis=2)
    qs, ks, vs = take(q, q_perm), take(k, k_perm), take(v, k_perm)  # [B, H, S, Dh]
    qb = jnp.take_along_axis(jnp.moveaxis(q_bucket, 1, 2), q_perm, axis=2)  # [B, H, S]
    kb = jnp.take_along_axis(jnp.moveaxis(k_bucket, 1, 2), k_perm, axis=2)
    need = needed_blocks(qb, q_perm, kb, k_perm, block)  # [B, H, nb, nb]
    inverse = jnp.argsort(q_perm, axis=-1)
    unsort = lambda ys: jnp.moveaxis(jnp.take_along_axis(ys, inverse[..., None], axis=2), 1, 2)
    if record.kernel == "pallas":
        kernel = functools.partial(hashed_block_sparse_attention, block_size=block)
        if parallel is not None and parallel.mesh.size > 1:
            kernel = _per_device(kernel, parallel, b, h)
        ys = kernel(qs, ks, vs, q_perm, qb, k_perm, kb)
        return unsort(ys), block_metrics(need, nb)
    # The budget's key blocks: needed ones first, each in sorted order (lower index first).
    order = jnp.where(need, 2 * nb, nb) - jnp.arange(nb)
    _, chosen = jax.lax.top_k(order, budget)  # [B, H, nb, budget]
    present = jnp.take_along_axis(need, chosen, axis=-1)  # a chosen block that is needed
    gather = lambda x: jnp.take_along_axis(
        x.reshape(b, h, 1, nb, block, -1), chosen[..., None, None], axis=3
    ).reshape(b, h, nb, budget * block, -1)
    kg, vg = gather(ks), gather(vs)
    kbg = gather(kb[..., None])[..., 0]  # [B, H, nb, budget * block]
    kpg = gather(k_perm[..., None])[..., 0]
    qblk = qs.reshape(b, h, nb, block, dh)
    scale = dh**-0.5
    logits = jnp.einsum("bhnqd,bhnkd->bhnqk", qblk, kg).astype(jnp.float32) * scale
    visible = (
        jnp.repeat(present, block, axis=-1)[..., None, :]
        & (kbg[..., None, :] == qb.reshape(b, h, nb, block)[..., None])
        & (kpg[..., None, :] <= q_perm.reshape(b, h, nb, block)[..., None])
    )
    # A softmax over the visible keys; a row without any gives zeros (no NaN, no gradient).
    logits = jnp.where(visible, logits, jnp.finfo(jnp.float32).min)
    peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    weights = jnp.where(visible, jnp.exp(logits - peak), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = (weights / jnp.where(total > 0, total, 1.0)).astype(v.dtype)
    ys = jnp.einsum("bhnqk,bhnkd->bhnqd", probs, vg).reshape(b, h, s, dh)
    return unsort(ys), block_metrics(need, budget)


def _per_device(kernel, parallel: ExpertParallel, batch: int, heads: int):
    """``kernel`` on [B, H, ...] arguments under `jax.shard_map`: rows over the token axes
    that divide the batch, heads over ``tensor`` where it divides them (every head and row is
    independent: no communication)."""
    mesh = parallel.mesh
    rows: list[str] = []
    for axis in parallel.token_axes:
        if batch % (int(np.prod([mesh.shape[a] for a in rows])) * mesh.shape[axis]) == 0:
            rows.append(axis)
    tensor = mesh.shape.get("tensor", 1)
    cols = "tensor" if tensor > 1 and heads % tensor == 0 else None
    spec = P(tuple(rows) or None, cols)
    # The kernel's pallas_call declares no varying axes for its outputs: not checked.
    return jax.shard_map(kernel, mesh=mesh, in_specs=(spec,) * 7, out_specs=spec, check_vma=False)


def block_metrics(need: jax.Array, budget: int) -> dict[str, jax.Array]:
    """The layer's needed-block histogram (over query blocks: how many needed key blocks each
    has, 0..nb), the fraction of needed blocks beyond the budget, and the needed fraction of
    the causal (query block, key block) pairs (seed 000 §2.4: a kernel that skips exactly
    computes that fraction)."""
    nb = need.shape[-1]
    counts = jnp.sum(need, axis=-1)  # [B, H, nb]
    hist = jnp.zeros((nb + 1,), jnp.float32).at[counts.reshape(-1)].add(1.0)
    total = jnp.sum(counts).astype(jnp.float32)
    dropped = jnp.sum(jnp.maximum(counts - budget, 0)).astype(jnp.float32)
    causal_pairs = np.prod(counts.shape[:2]) * nb * (nb + 1) / 2
    return {
        NEEDED_HIST: hist,
        OVERFLOW: dropped / jnp.maximum(total, 1.0),
        PAIR_FRACTION: total / causal_pairs,
    }
