"""What each pipeline stage computes, as frozen data: the compile key of its programs.

docs/parallelism.md: the pipeline is MPMD, one program per stage on its own sub-mesh, so a
stage's programs depend only on its own layers (their kinds, records, inputs, frozen flags), its
position (first: embedding; last: norm, head, loss) and the microbatch shape. `StageSpec` holds
exactly that, so a Plan change that leaves a stage's spec equal reuses its executables, and only
stages whose layer set changed recompile (seed 000 §4.1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from dynjax.model.hooks import NO_HOOKS, Hooks, LayerOptions
from dynjax.parallel.layout import Unit
from dynjax.parallel.step_inputs import InputSignature, restrict


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """One stage of one Plan: everything its forward, backward and update programs depend on."""

    index: int  # which stage sub-mesh runs it
    num_stages: int
    first: bool  # holds the embedding: its input is tokens
    last: bool  # holds the final norm, head and loss
    layers: tuple[int, ...]  # consecutive model layers
    frozen: tuple[int, ...]  # frozen layers among `layers`
    embed_frozen: bool  # first stage: the embedding (and learned positions) are frozen
    input_grads: bool  # the backward returns the gradient of the stage input
    microbatches: int
    microbatch_size: int
    dtype: str
    options: tuple[LayerOptions, ...] = ()  # each layer's plugin records (empty: none)
    inference: bool = False  # evaluation programs: block wrappers run causally (`LayerContext`)
    # The block wrappers (of any stage) whose carry crosses stage boundaries: the input of a
    # stage after the first and the output of one before the last hold it (`HookSet.carry`).
    carry: tuple[str, ...] = ()
    # What of the `LayerContext` each layer's wrapper reads (`HookSet.needs`; empty: none).
    needs: tuple[frozenset[str], ...] = ()
    # The step inputs its layers read (`Plugin.step_inputs`): a
    # runtime input of the stage's programs (``ctx["inputs"]``, each name [its layers, ...]),
    # so changing their values leaves the spec, and so every compiled program, as it is.
    step_inputs: tuple[InputSignature, ...] = ()
    # The batch inputs its layers read (`Plugin.batch_inputs`): per
    # microbatch, each name [its layers, b, ...]; none in evaluation.
    batch_inputs: tuple[InputSignature, ...] = ()
    # Each layer's rematerialisation policy (`dynjax.model.remat.REMAT`; empty: "none" for
    # all): what its forward keeps for the backward, so what its programs hold in memory.
    remat: tuple[str, ...] = ()

    def layer_options(self) -> tuple[LayerOptions, ...]:
        """One `LayerOptions` per layer of the stage."""
        return self.options or ((),) * len(self.layers)

    def layer_remat(self) -> tuple[str, ...]:
        """One rematerialisation policy per layer of the stage."""
        return self.remat or ("none",) * len(self.layers)

    def units(self, learned_positions: bool) -> tuple[Unit, ...]:
        """The parameter units this stage holds, in model order."""
        head = (("embed",),) + ((("pos",),) if learned_positions else ()) if self.first else ()
        tail = (("norm",), ("head",)) if self.last else ()
        return head + tuple(("layers", i) for i in self.layers) + tail

    def trainable(self, learned_positions: bool) -> tuple[Unit, ...]:
        """The units that get gradients and optimizer updates."""
        frozen = {("layers", i) for i in self.frozen}
        if self.embed_frozen:
            frozen |= {("embed",), ("pos",)}
        return tuple(u for u in self.units(learned_positions) if u not in frozen)

    @property
    def needs_readout(self) -> bool:
        """A stage before the last whose wrappers read the model's readout: it gets the last
        stage's norm and head parameters each step and returns their gradient."""
        return not self.last and any("readout" in n for n in self.needs)

    @property
    def needs_targets(self) -> bool:
        """A stage before the last whose wrappers read the targets (the last has them)."""
        return not self.last and any("targets" in n for n in self.needs)

    @property
    def has_backward(self) -> bool:
        """False for a stage inside the model's frozen prefix: it runs no backward at all
        (unless it reads the readout, whose parameters train)."""
        trainable = self.last or (self.first and not self.embed_frozen) or self.needs_readout
        return self.input_grads or trainable or len(self.frozen) < len(self.layers)


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    """The static description of one pipeline step: stages and the schedule's task lists.

    ``stages`` are the logical stages in model order; ``tasks[d]`` is stage sub-mesh d's
    ordered list of tasks (anything with ``kind`` "F"/"B"/"W", ``microbatch`` and ``chunk``: the
    task runs logical stage ``chunk * len(tasks) + d``), e.g. ``dynjax.balance.schedule_tasks``:
    the runtime executes these lists.
    """

    stages: tuple[StageSpec, ...]
    schedule: str
    tasks: tuple[tuple[Any, ...], ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def microbatches(self) -> int:
        return self.stages[0].microbatches

    def stage_tasks(self, s: int) -> tuple[Any, ...]:
        """The tasks of logical stage ``s``, in its sub-mesh's order."""
        devices = len(self.tasks)
        return tuple(t for t in self.tasks[s % devices] if t.chunk == s // devices)

    def owner(self, layer: int) -> int:
        """The stage holding ``layer``."""
        return next(s.index for s in self.stages if layer in s.layers)


def stage_specs(
    stage_layers: Sequence[int],
    *,
    frozen_layers: Sequence[int],
    microbatches: int,
    batch_size: int,
    dtype: str,
    options: Sequence[LayerOptions] = (),
    hooks: Hooks = NO_HOOKS,
    step_inputs: Sequence[InputSignature] = (),
    batch_inputs: Sequence[InputSignature] = (),
    remat: Sequence[str] = (),
) -> tuple[StageSpec, ...]:
    """Split the model into consecutive stages of ``stage_layers[s]`` layers each.

    A frozen prefix of the model (the embedding and every layer before the first trainable one,
    seed 000 §4.2.3) needs no gradient: stages after it still pass input gradients back to it.
    ``options`` holds each model layer's plugin records; a stage carries those of its layers, so
    only stages whose records change compile anew; ``hooks`` is what the records run (what
    the stages' wrappers read and carry). ``step_inputs`` and ``batch_inputs``: the per-layer
    inputs of the model (`dynjax.parallel.step_inputs`); a stage reads its layers' rows.
    ``remat``: each model layer's rematerialisation policy (empty: "none" for all); a stage
    carries its layers', so a policy change recompiles the stages holding the layers it changed.
    """
    frozen = set(frozen_layers)
    embed_frozen = 0 in frozen
    first_trainable = 0 if not embed_frozen else next(
        (i for i in range(sum(stage_layers)) if i not in frozen), None
    )
    needs = [hooks.context_needs([o]) for o in options]
    specs, start = [], 0
    for s, count in enumerate(stage_layers):
        layers = tuple(range(start, start + count))
        trainable_before = first_trainable is not None and first_trainable < start
        specs.append(
            StageSpec(
                index=s,
                num_stages=len(stage_layers),
                first=s == 0,
                last=s == len(stage_layers) - 1,
                layers=layers,
                frozen=tuple(i for i in layers if i in frozen),
                embed_frozen=s == 0 and embed_frozen,
                input_grads=s > 0 and trainable_before,
                microbatches=microbatches,
                microbatch_size=batch_size // microbatches,
                dtype=dtype,
                options=tuple(options[start : start + count]) if any(options) else (),
                carry=hooks.carrying_wrappers(options),
                needs=tuple(needs[start : start + count]) if any(needs) else (),
                step_inputs=restrict(step_inputs, layers),
                batch_inputs=restrict(batch_inputs, layers),
                remat=_policies(remat[start : start + count]),
            )
        )
        start += count
    return tuple(specs)


def _policies(remat: Sequence[str]) -> tuple[str, ...]:
    """A stage's `StageSpec.remat`: empty where every layer's is "none", so its spec (and its
    programs) stay those of a Plan without remat."""
    return tuple(remat) if any(r != "none" for r in remat) else ()
