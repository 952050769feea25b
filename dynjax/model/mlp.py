"""The dense feed-forward block."""

from __future__ import annotations

import jax
from flax import nnx

from dynjax.model.pruned import SparseLinears, linear


class MLP(nnx.Module):
    def __init__(self, d_model: int, mlp_dim: int, *, out_std: float, rngs: nnx.Rngs):
        self.up = nnx.Linear(d_model, mlp_dim, kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.down = nnx.Linear(
            mlp_dim, d_model, kernel_init=nnx.initializers.normal(out_std), rngs=rngs
        )

    def __call__(self, x: jax.Array, sparse: SparseLinears | None = None) -> jax.Array:
        """``sparse``: which of ``mlp/up``, ``mlp/down`` multiply block-sparsely."""
        h = jax.nn.gelu(linear(self.up, x, "mlp/up", sparse))
        return linear(self.down, h, "mlp/down", sparse)
