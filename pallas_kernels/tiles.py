"""Tile helpers shared by the kernels: fp32-accumulating tile products and block slices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

NN = ((1,), (0,))  # a @ b
NT = ((1,), (1,))  # a @ b.T
TN = ((0,), (0,))  # a.T @ b


def mm(a: jax.Array, b: jax.Array, dims: tuple) -> jax.Array:
    """Tile product contracting ``dims`` (``NN``, ``NT`` or ``TN``), accumulated in fp32."""
    return lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)


def block(index: jax.Array, size: int) -> pl.Slice:
    """Slice of the ``index``-th block of ``size`` elements (aligned, for the Triton lowering)."""
    return pl.ds(pl.multiple_of(index * size, size), size)
