"""Block-sparse linears inside a block: the record that names them, and the matmul they run.

Block-granularity pruning zeroes whole ``bs x bs`` blocks of a weight (which stays stored dense in
the params, pruned entries exactly zero). Once few blocks remain, a layer's options may name some
of its linears (``"mlp/up"``, ``"attn/qkv"``, ...) with a static width ``K``: the block then
multiplies them with `dynjax.model.sparse_linear.block_pruned_matmul`, at ``K / (in // bs)`` of
the dense cost. The block index it needs is derived here, inside the forward, from the weight's
own zero pattern (`present_index`): no runtime input carries it. ``K`` must bound the present
blocks of every block-column; pruning only removes blocks, so a ``K`` counted at some step stays
valid afterwards.

A record is found among a layer's options by type (`sparse_linears`), so any scheme whose record
is a `SparseLinears` (e.g. pruning's, a subclass) switches the matmuls; the model names none.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from dynjax.model.sparse_linear import block_pruned_matmul

# The dense blocks' linears: GPT's in order, then the Llama family's SwiGLU gate.
LINEARS = ("attn/qkv", "attn/out", "mlp/up", "mlp/down", "mlp/gate")


@dataclasses.dataclass(frozen=True)
class SparseLinears:
    """Which linears of a block multiply block-sparsely.

    ``widths``: (linear path inside the block, K) pairs; ``block_size``: the blocks' side;
    ``loop``: `block_pruned_matmul`'s loop over block-columns (False: one batched step, slower,
    but what ``cost_analysis`` counts in full).
    """

    block_size: int = 0
    widths: tuple[tuple[str, int], ...] = ()
    loop: bool = True

    def width(self, path: str) -> int | None:
        return dict(self.widths).get(path)


def sparse_linears(options: Any) -> SparseLinears | None:
    """The `SparseLinears` record among a layer's options (``(name, record)`` pairs), if any."""
    return next((r for _, r in options or () if isinstance(r, SparseLinears)), None)


def present_index(w: jax.Array, block_size: int, k: int) -> jax.Array:
    """``[out // bs, k]`` int32: per block-column of ``w``, its block-rows holding a nonzero,
    ascending, padded with the sentinel ``in // bs`` (`sparse_linear.column_block_index`'s
    layout). ``lax.top_k`` over the rows, present rows ranked by position."""
    bs = block_size
    n_rows, n_cols = w.shape[0] // bs, w.shape[1] // bs
    tiles = jax.lax.stop_gradient(w).reshape(n_rows, bs, n_cols, bs)
    present = jnp.any(tiles != 0, axis=(1, 3))  # [R, C]
    score = jnp.where(present, n_rows - jnp.arange(n_rows)[:, None], 0).T  # [C, R]
    vals, rows = jax.lax.top_k(score, k)
    return jnp.where(vals > 0, rows, n_rows).astype(jnp.int32)


def column_blocks(w: jax.Array, block_size: int) -> jax.Array:
    """The most present blocks in any block-column of ``w`` (int32): the least valid K."""
    bs = block_size
    tiles = jax.lax.stop_gradient(w).reshape(w.shape[0] // bs, bs, w.shape[1] // bs, bs)
    return jnp.max(jnp.sum(jnp.any(tiles != 0, axis=(1, 3)), axis=0)).astype(jnp.int32)


def linear(module: nnx.Linear, x: jax.Array, path: str, sparse: SparseLinears | None):
    """``module(x)``, block-sparse when ``sparse`` gives ``path`` a width; its output named
    ``path`` for a rematerialisation policy that keeps projections (`dynjax.model.remat`)."""
    k = sparse.width(path) if sparse is not None else None
    if k is None:
        return checkpoint_name(module(x), path)
    w = module.kernel[...]
    index = present_index(w, sparse.block_size, k)
    y = block_pruned_matmul(x, w, index, block_size=sparse.block_size, loop=sparse.loop)
    return checkpoint_name(y + module.bias[...] if module.bias is not None else y, path)
