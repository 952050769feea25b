"""Dense causal attention: cuDNN's fused flash attention on a GPU where it takes the call, two
einsums around a float32 softmax otherwise.

Written as einsums, attention compiles into the full ``[B, H, S, S]`` score matrix, forward and
backward: on a GPU, the memory and time a flash kernel avoids, and a maintained one exists
(dynjax's own kernels are for the data-dependent block lists that nothing maintained takes), so
`route` sends bfloat16/float16 inputs with a head dimension cuDNN takes (`cudnn_takes`) to
``jax.nn.dot_product_attention(implementation="cudnn")``; its ``implementation=None`` would mean
XLA. Elsewhere the einsums stay: on CPU, jax's own XLA implementation took 1.24-1.31x their time
forward and backward (B, S, H, Dh = 16, 128, 8, 64; 16, 128, 4, 32; 4, 512, 4, 32; 2026-12-07).
The first cuDNN route per (dtype, head dimension) compiles a small call once: a cuDNN or jax
build that refuses it gets the einsums (the same function at dense cost) and a warning, never a
failed run.
"""

from __future__ import annotations

import functools
import warnings
from typing import Literal

import jax
import jax.numpy as jnp

Route = Literal["einsum", "cudnn"]
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 128  # cuDNN's fused attention on Ampere and Hopper: head dim <= 128, % 8


def cudnn_takes(dtype: jnp.dtype, head_dim: int, backend: str) -> bool:
    """Whether cuDNN's flash attention takes these inputs: a GPU backend, bf16/fp16, a head
    dimension that is a multiple of 8 up to `CUDNN_MAX_HEAD_DIM`.

    Example:
      >>> cudnn_takes(jnp.bfloat16, 64, "gpu"), cudnn_takes(jnp.float32, 64, "gpu")
      (True, False)
      >>> cudnn_takes(jnp.bfloat16, 64, "cpu"), cudnn_takes(jnp.bfloat16, 256, "gpu")
      (False, False)
    """
    return (
        backend == "gpu"
        and jnp.dtype(dtype) in CUDNN_DTYPES
        and head_dim % 8 == 0
        and head_dim <= CUDNN_MAX_HEAD_DIM
    )


def route(dtype: jnp.dtype, head_dim: int) -> Route:
    """``"cudnn"`` where cuDNN takes these inputs on this backend (`cudnn_takes`) and compiles
    them, else ``"einsum"``."""
    name = jnp.dtype(dtype).name
    if cudnn_takes(dtype, head_dim, jax.default_backend()) and _cudnn_compiles(name, head_dim):
        return "cudnn"
    return "einsum"


@functools.cache
def _cudnn_compiles(dtype: str, head_dim: int) -> bool:
    """Whether this process's jax and cuDNN compile a small causal cuDNN attention (and its
    gradient) at ``dtype`` and ``head_dim``; warns once where they do not."""
    shape = jax.ShapeDtypeStruct((1, 128, 2, head_dim), jnp.dtype(dtype))

    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return out.astype(jnp.float32).sum()

    try:
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile()
    except Exception as err:  # cuDNN's refusals are jax errors of several kinds
        warnings.warn(
            f"cuDNN attention does not compile here ({type(err).__name__}: {err}); dense "
            f"attention at {dtype}, head dim {head_dim} runs as einsums (same results, no flash "
            "kernel)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def causal(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None
) -> jax.Array:
    """Causal attention ``[B, S, H, Dh]`` of queries ``q`` over keys and values ``k``, ``v``
    ``[B, T, Hkv, Dh]`` (``H`` a multiple of ``Hkv``: each key/value head serves its group of
    query heads), scaled by ``Dh ** -0.5``. Without ``mask``, query ``i`` sees keys ``0..i``
    (``S == T``: the tokens in their order); ``mask`` (bool, broadcast to ``[B, H, S, T]``)
    replaces that rule and takes the einsums (cuDNN's masks are kinds of its own)."""
    if mask is None and route(q.dtype, q.shape[-1]) == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    group = q.shape[2] // k.shape[2]
    if group > 1:
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * q.shape[-1] ** -0.5
    if mask is None:
        mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), dtype=bool))
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)
