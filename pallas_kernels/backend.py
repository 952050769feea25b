"""Where the kernels run: Pallas' Triton lowering on GPU, the Pallas interpreter elsewhere.

Backend choice (jax 0.10/0.11). Every kernel in this package is a plain ``pl.pallas_call`` over a
grid, with ``BlockSpec`` tiles, dynamic ``pl.ds`` slices of refs, scalar index loads and
``lax.fori_loop`` with data-dependent bounds. That subset is portable: the same kernel body runs
under ``interpret=True`` on CPU (how the tests check it) and lowers through the Pallas Triton
backend on NVIDIA GPUs, which we select explicitly with ``pallas.triton.CompilerParams`` (jax
0.10 otherwise routes ``pl.pallas_call`` to Mosaic GPU). The Triton backend is deprecated since
JAX 0.11 in favour of Mosaic GPU (DESIGN.md), but the kernels JAX recommends there
(``plgpu.kernel`` with TMA copies, ``wgmma`` and barriers) are warpgroup programs specific to
Hopper/Blackwell that cannot share one body with the CPU interpreter used here. Porting the inner
loops to Mosaic GPU is the upgrade path once the Triton lowering is removed; the data layout
(compacted block indices, per-block grids) carries over unchanged.
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import triton as pl_triton


def resolve_interpret(interpret: bool | None) -> bool:
    """``None`` means: compile on a GPU backend, interpret everywhere else."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    return bool(interpret)


def triton_params(tile_elems: int) -> pl_triton.CompilerParams:
    """Warp count for a tile of ``tile_elems`` elements (8 warps for 128x128 tiles, else 4)."""
    return pl_triton.CompilerParams(num_warps=8 if tile_elems >= 128 * 128 else 4, num_stages=2)


def check_tile(name: str, size: int, *, interpret: bool) -> None:
    """Triton tiles must be powers of two >= 16 (``tl.dot``); the interpreter takes any size."""
    if size < 1:
        raise ValueError(f"{name} must be positive, got {size}")
    if not interpret and (size < 16 or size & (size - 1)):
        raise ValueError(
            f"{name}={size}: compiled GPU kernels need a power of two >= 16 "
            "(Triton tile constraint); use interpret=True for other sizes"
        )
