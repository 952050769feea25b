"""The dense feed-forward blocks: GPT's GELU MLP and Llama's SwiGLU."""

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


class SwiGLU(nnx.Module):
    """Llama's gated MLP (Shazeer 2020): ``down(silu(gate(x)) * up(x))``, three matrices and no
    biases. ``up`` and ``down`` keep the GELU MLP's names, so tensor parallelism, pruning and the
    block-sparse path treat them alike; ``gate`` is split like ``up`` (column-parallel)."""

    def __init__(self, d_model: int, mlp_dim: int, *, out_std: float, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.gate = nnx.Linear(d_model, mlp_dim, use_bias=False, kernel_init=init, rngs=rngs)
        self.up = nnx.Linear(d_model, mlp_dim, use_bias=False, kernel_init=init, rngs=rngs)
        self.down = nnx.Linear(
            mlp_dim,
            d_model,
            use_bias=False,
            kernel_init=nnx.initializers.normal(out_std),
            rngs=rngs,
        )

    def __call__(self, x: jax.Array, sparse: SparseLinears | None = None) -> jax.Array:
        """``sparse``: which of ``mlp/gate``, ``mlp/up``, ``mlp/down`` multiply block-sparsely."""
        h = jax.nn.silu(linear(self.gate, x, "mlp/gate", sparse))
        return linear(self.down, h * linear(self.up, x, "mlp/up", sparse), "mlp/down", sparse)
