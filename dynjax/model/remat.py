"""Rematerialisation policies of a block (`model.remat`; MaxText's ``remat_policy``).

A training step keeps every activation its backward reads (the VJP's residuals) from the
forward until the backward; over many layers they dominate the step's memory. Running a block
under `jax.checkpoint` with a policy keeps only what the policy saves and recomputes the rest
in the backward, trading FLOPs for memory per layer:

- ``"none"``: keep every residual (no `jax.checkpoint`; in a scanned stack, every matmul's
  output, `rematerialised`);
- ``"full"``: keep nothing but the block's input; the backward recomputes the block's forward;
- ``"save_proj"``: keep the outputs of the block's linear projections (`PROJECTIONS`, tagged
  with `checkpoint_name` where they are computed: `dynjax.model.pruned.linear` and the MoE
  experts); the backward recomputes the cheap elementwise work, norms and attention scores
  between them, not the matmuls;
- ``"offload_proj"``: the same tensors, moved to pinned host memory in the forward and back for
  the backward, so device memory holds almost none of them: for a device with host memory apart
  from its own (`host_offload_available`).

The policy is per layer (`dynjax.recompile.Plan.remat`, carried into the stage specs), so the
programs of a stage whose layers' policies changed are the only ones that recompile, and a
stage's measured memory (the compiled programs' `memory_analysis`) and so the balancer's memory
model follow it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from dynjax.model.moe import HIDDEN, RETURNED, host_offload_supported
from dynjax.model.pruned import LINEARS

REMAT = ("none", "full", "save_proj", "offload_proj")  # the choices of `model.remat`
# The checkpoint names of a block's projection outputs: its dense linears' (by parameter path)
# and, in an MoE block, the experts' hidden pre-activation and their combined outputs.
PROJECTIONS = (*LINEARS, HIDDEN, RETURNED)


def host_offload_available() -> bool:
    """Whether offloading to host moves anything: the device has a ``pinned_host`` memory space
    and its own memory is not host memory already. On the CPU backend both are the same RAM
    (XLA:CPU lowers the transfers to nothing), so ``offload_proj`` would only keep them."""
    return jax.default_backend() != "cpu" and host_offload_supported()


@functools.cache
def remat_policy(remat: str) -> Callable | None:
    """The `jax.checkpoint` policy of ``remat`` (one of `REMAT`): None for ``"none"`` (no
    checkpoint at all)."""
    if remat == "none":
        return None
    if remat == "full":
        return jax.checkpoint_policies.nothing_saveable
    if remat == "save_proj":
        return jax.checkpoint_policies.save_only_these_names(*PROJECTIONS)
    if remat == "offload_proj":
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=list(PROJECTIONS),
            offload_src="device",
            offload_dst="pinned_host",
        )
    raise ValueError(f"model.remat={remat!r} is not one of {REMAT}")


def rematerialised(fn: Callable, remat: str, *, in_loop: bool = False) -> Callable:
    """``fn`` under `jax.checkpoint` with ``remat``'s policy (``fn`` itself for ``"none"``).

    ``in_loop``: ``fn`` is a `jax.lax.scan` body, whose iterations XLA cannot merge anyway, so
    the barriers that keep it from merging the recomputation with the forward are left out;
    and ``"none"`` there keeps every matmul's output (`jax.checkpoint_policies.dots_saveable`)
    rather than every residual. Why: a scan's backward reads each iteration's residuals from
    buffers stacked over the iterations, so each elementwise intermediate the body keeps is
    written to and read back from memory once per layer, where the unrolled step's fusions
    recompute them inside the kernels that read them. Keeping them all made the scanned
    16-layer step 1.21x (dense) and 1.09x (MoE) the unrolled one's time on CPU; keeping the
    matmuls' outputs only, 0.94x and 0.70x, for 1% more FLOPs (docs/benchmarks.md, "Scanned
    layers")."""
    if in_loop and remat == "none":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_saveable, prevent_cse=False)
    policy = remat_policy(remat)
    if policy is None:
        return fn
    return jax.checkpoint(fn, policy=policy, prevent_cse=not in_loop)
