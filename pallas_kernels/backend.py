"""Where the kernels run: Pallas' Triton lowering on GPU, the Pallas interpreter elsewhere.

Backend choice (jax 0.10/0.11). Every kernel in this package is a plain ``pl.pallas_call`` over a
grid, with ``BlockSpec`` tiles, dynamic ``pl.ds`` slices of refs, scalar index loads and
``lax.fori_loop`` with data-dependent bounds. That subset is portable: the same kernel body runs
under ``interpret=True`` on CPU (how the tests check it) and lowers through the Pallas Triton
backend on NVIDIA GPUs, which we select explicitly with ``pallas.triton.CompilerParams`` (jax
0.10 otherwise routes ``pl.pallas_call`` to Mosaic GPU). The Triton backend is deprecated since
JAX 0.11 in favour of Mosaic GPU, but the kernels JAX recommends there
(``plgpu.kernel`` with TMA copies, ``wgmma`` and barriers) are warpgroup programs specific to
Hopper/Blackwell that cannot share one body with the CPU interpreter used here. Porting the inner
loops to Mosaic GPU is the upgrade path once the Triton lowering is removed; the data layout
(compacted block indices, per-block grids) carries over unchanged.

jax 0.12 makes that port harder still: Mosaic GPU no longer takes ``pl.pallas_call`` at all (only
``plgpu.kernel``) and has no ``dot_general`` rule, so no kernel body here lowers through it. Until
a port lands (checked on a GPU), ``route`` keeps the Pallas Triton lowering wherever jax still
has it: jax 0.11 and 0.12 lower it with a ``DeprecationWarning`` ("The Pallas Triton backend is
deprecated ..."), which is expected. On a GPU whose jax has removed the lowering or made that
deprecation an error, the kernels' functions fall back to the same computation in plain XLA ops
(``pallas_kernels.xla``): the same results and gradients, dense cost, and a warning saying so.
"""

from __future__ import annotations

import functools
import warnings
from typing import Literal

import jax

from jax_private import pallas_triton_lowering

Route = Literal["interpret", "triton", "xla"]
_DEPRECATION = "jax-pallas-triton"  # jax's id for the Triton backend's deprecation (0.11+)


@functools.cache
def pallas_triton_usable() -> bool:
    """Whether this jax lowers ``pl.pallas_call`` through Triton without raising.

    True on jax 0.10 (no deprecation yet) and on 0.11/0.12 (a warning); False once jax removes
    the lowering or accelerates its deprecation into an error (jax internals: `jax_private`).
    """
    return pallas_triton_lowering(_DEPRECATION)


def route(interpret: bool | None) -> Route:
    """How a kernel runs: ``interpret=None`` compiles on a GPU backend and interprets elsewhere;
    ``False`` compiles (also when exporting for a GPU from a CPU host); ``True`` interprets.
    Compiling means the Pallas Triton lowering while jax has it, else plain XLA (``xla``)."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if interpret:
        return "interpret"
    if pallas_triton_usable():
        return "triton"
    _warn_xla_once()
    return "xla"


@functools.cache
def _warn_xla_once() -> None:
    warnings.warn(
        f"jax {jax.__version__} has no usable Pallas Triton lowering: pallas_kernels computes "
        "block-sparse attention and SpMM with dense XLA ops (same results, no sparse speed-up) "
        "until its kernels are ported to Mosaic GPU (jax 0.10 to 0.12 still run them)",
        RuntimeWarning,
        stacklevel=3,
    )


def compiler_params(tile_elems: int, *, interpret: bool):
    """Triton's warp count for a tile of ``tile_elems`` elements (8 warps for 128x128 tiles, else
    4); None for the interpreter, which needs none, so it never imports the Triton module."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pl_triton

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
