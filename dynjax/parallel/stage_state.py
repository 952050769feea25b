"""The training state of this process's pipeline stages, and its migration between Plans.

State per stage: ``{"params", "opt_state"}`` keyed by name as in the full state (see `layout`),
plus the gradient accumulators of its trainable units (zero between steps). `StageState.migrate`
moves each moved layer's parameters and optimizer state to its new stage bit for bit (seed 000
§4.1); a Plan that keeps the state layout (`state_layout`: layer records, step inputs, the
schedule changed) swaps in without touching the state or waiting for the device.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp

from dynjax.parallel.executable import PipelineExecutable, PipelinePrograms
from dynjax.parallel.layout import join, relayout
from dynjax.parallel.stages import PipelineSpec, StageSpec


def state_layout(spec: PipelineSpec) -> tuple:
    """What the per-stage state trees depend on: the units each stage holds and which of them
    train (the gradient accumulator's). Plans equal here share one state: swapping between them
    moves nothing."""
    return tuple(
        (s.index, s.first, s.last, s.layers, s.frozen, s.embed_frozen) for s in spec.stages
    )


@dataclasses.dataclass(frozen=True)
class Migration:
    """What `StageState.migrate` did: the ``migrate`` event of events.jsonl."""

    moves: tuple[tuple[int, int, int], ...]  # (layer, from stage, to stage)
    bytes: int  # parameter and optimizer-state bytes copied between stages
    seconds: float  # copying, after the steps in flight finished
    recompiled_stages: tuple[int, ...]  # stages whose programs the new Plan compiled

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(m[0] for m in self.moves)

    def event(self, step: int) -> dict[str, Any]:
        return {
            "event": "migrate",
            "step": step,
            "layers": list(self.layers),
            "moves": [list(m) for m in self.moves],
            "bytes": self.bytes,
            "seconds": self.seconds,
            "recompiled_stages": list(self.recompiled_stages),
        }


class StageState:
    """Each local stage's ``{"params", "opt_state"}``, gradient accumulators (``acc``, and
    ``racc`` for the readout's gradient where early exit reads it) and the spec they are laid
    out for; ``updated`` notes, per stage, the first parameter leaf the last update wrote and
    one of that update's metrics, ready with it (what a timed step watches)."""

    def __init__(self, programs: PipelinePrograms, full_template: Any) -> None:
        self.programs = programs
        self.transport = programs.transport
        self.full_template = full_template  # the full {"params", "opt_state"} tree (structure)
        self.spec: PipelineSpec | None = None
        self.state: dict[int, dict[str, Any]] = {}
        self.acc: dict[int, Any] = {}
        self.racc: dict[int, Any] = {}  # readout-gradient accumulators (empty where unused)
        self.updated: dict[int, tuple[jax.Array, jax.Array]] = {}

    def local(self, spec: PipelineSpec) -> list[StageSpec]:
        return [s for s in spec.stages if self.transport.is_local(s.index)]

    def require_every_stage(self, what: str) -> None:
        if not self.transport.all_local:
            raise ValueError(f"{what} needs every pipeline stage in this process")

    def templates(self, spec: PipelineSpec, every: bool = False) -> dict[int, dict[str, Any]]:
        """The abstract state of this process's stages (``every``: of all stages)."""
        out = {}
        for stage in spec.stages if every else self.local(spec):
            shapes = self.programs.shapes(stage)
            out[stage.index] = {"params": shapes.params, "opt_state": shapes.opt_state}
        return out

    def zero_acc(self, spec: PipelineSpec, which: str = "acc") -> dict[int, Any]:
        """Zero accumulators (``which``: "acc" or "racc") of this process's stages."""
        zeros = lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding)
        return {
            s.index: jax.tree.map(zeros, getattr(self.programs.shapes(s), which))
            for s in self.local(spec)
        }

    def place(self, state: Any, spec: PipelineSpec) -> None:
        """Split the full ``{"params", "opt_state"}`` tree (host arrays, or device arrays: a
        leaf already in its stage's sharding stays where it is) onto this process's stages."""
        put = lambda array, _src, _dst, sharding: jax.device_put(array, sharding)
        # The full tree is one more "stage" (-1) that holds every leaf.
        self.state, _ = relayout({-1: state}, self.templates(spec), put)
        self._laid_out(spec)

    def _laid_out(self, spec: PipelineSpec) -> None:
        """Zero accumulators for ``spec``, whose layout the state now has."""
        self.acc, self.racc, self.spec = self.zero_acc(spec), self.zero_acc(spec, "racc"), spec
        self.updated = {}

    def full_state(self) -> Any:
        """The full ``{"params", "opt_state"}`` tree of the stages' own arrays, each shared
        leaf from the first stage holding it: nothing is copied (checkpoints save it shard by
        shard). Over several processes, this process's stages' leaves, and None where only
        another process's stage holds one (the part of a checkpoint this process writes)."""
        stages = [self.state[s] for s in sorted(self.state)]
        return join(self.full_template, stages, partial=not self.transport.all_local)

    def migrate(self, exe: PipelineExecutable) -> Migration:
        """Lay the state out for ``exe``: every layer whose stage changed moves to its new stage
        with its optimizer state, bit for bit; the others stay where they are. Across processes
        both owners take part in each move (`Transport.send`), in the one order every process
        derives from the two specs."""
        old, spec = self.spec, exe.spec
        jax.block_until_ready(self.state)  # the steps in flight finish first: time the moves only
        start = time.perf_counter()
        held = {**self.templates(old, every=True), **self.state}  # others' stages: abstract
        is_local = self.transport.is_local

        def move(leaf, src: int, dst: int, sharding) -> jax.Array | None:
            like = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
            return self.transport.send(leaf if is_local(src) else None, src, dst, like)

        self.state, moved = relayout(held, self.templates(spec, every=True), move, is_local)
        jax.block_until_ready(self.state)
        seconds = time.perf_counter() - start
        self._laid_out(spec)
        layers = [i for s in old.stages for i in s.layers if spec.owner(i) != s.index]
        return Migration(
            moves=tuple((i, old.owner(i), spec.owner(i)) for i in layers),
            bytes=moved,
            seconds=seconds,
            recompiled_stages=tuple(sorted({s for _, s in exe.compiled})),
        )
