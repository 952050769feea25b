"""The kernels lower through Pallas' Triton GPU backend, checked on CPU by exporting for CUDA.

Exporting for the ``cuda`` platform runs the Pallas-to-Triton lowering (every primitive must have
a Triton rule, every load/store a power-of-two size) without a GPU. It does not run Triton's own
compiler (PTX, registers, shared memory) nor the kernels: that needs the GPU benchmark.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    BlockSparseMatrix,
    backend,
    block_sparse_attention,
    block_sparse_matmul,
    hashed_block_sparse_attention,
)

pytestmark = pytest.mark.skipif(
    not backend.pallas_triton_usable(),
    reason="this jax has no usable Pallas Triton lowering (the kernels fall back to XLA)",
)

_TRITON = "__gpu$xla.gpu.triton"
# The GPU the lowering targets: jax >= 0.12 asks the device for its compute capability, and on a
# CPU host only an abstract device can answer. (jax 0.10 lowers without asking.)
_H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")


def _triton_kernels(fn, *args) -> list[str]:
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=_H100)
    with jax.sharding.use_abstract_mesh(mesh):
        exported = jax.export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON)],
        )(*args)
    return re.findall(r'name = "(\w+)", num_stages', exported.mlir_module())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_lowers_to_triton(dtype):
    q = jnp.zeros((1, 2, 384, 64), dtype)  # 3 blocks of 128: index lists of odd length
    mask = jnp.ones((1, 2, 3, 3), bool)
    attend = lambda q, k, v: block_sparse_attention(q, k, v, mask, interpret=False)
    loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32))
    assert _triton_kernels(attend, q, q, q) == ["attention_fwd"]
    grads = _triton_kernels(jax.grad(loss, (0, 1, 2)), q, q, q)
    assert sorted(grads) == ["attention_dkv", "attention_dq", "attention_fwd"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_hashed_attention_lowers_to_triton(dtype):
    """The hashed mask: per-token ids loaded per block and compared in-kernel, on-device lists."""
    q = jnp.zeros((1, 2, 384, 64), dtype)
    ids = jnp.zeros((1, 2, 384), jnp.int32)
    attend = lambda q, k, v, pos, bucket: hashed_block_sparse_attention(
        q, k, v, pos, bucket, pos, bucket, interpret=False
    )
    loss = lambda *a: jnp.sum(attend(*a).astype(jnp.float32))
    assert _triton_kernels(attend, q, q, q, ids, ids) == ["attention_fwd"]
    grads = _triton_kernels(jax.grad(loss, (0, 1, 2)), q, q, q, ids, ids)
    assert sorted(grads) == ["attention_dkv", "attention_dq", "attention_fwd"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_spmm_lowers_to_triton(dtype):
    mask = np.random.default_rng(0).random((4, 3)) < 0.5
    w = BlockSparseMatrix.from_dense(jnp.ones((256, 384), dtype), (64, 128), mask)
    x = jnp.zeros((100, 256), dtype)
    matmul = lambda x, blocks: block_sparse_matmul(
        x, BlockSparseMatrix(blocks, w.rows, w.cols, w.shape, w.block_size), interpret=False
    )
    loss = lambda x, blocks: jnp.sum(matmul(x, blocks).astype(jnp.float32))
    assert _triton_kernels(matmul, x, w.blocks) == ["spmm_fwd"]
    assert sorted(_triton_kernels(jax.grad(loss, (0, 1)), x, w.blocks)) == ["spmm_dw", "spmm_dx"]
