"""The dense feed-forward block."""

from __future__ import annotations

import jax
from flax import nnx


class MLP(nnx.Module):
    def __init__(self, d_model: int, mlp_dim: int, *, out_std: float, rngs: nnx.Rngs):
        self.up = nnx.Linear(d_model, mlp_dim, kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.down = nnx.Linear(
            mlp_dim, d_model, kernel_init=nnx.initializers.normal(out_std), rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x)))
