"""Per-layer inputs: arrays a step reads rather than compiles in.

Two kinds, both declared by plugins by name, one row per layer that reads them, and carried by
the runtimes without knowing what they mean:

* *step inputs* (`Plugin.step_inputs`, ``{layer: row}``) hold for every step of a Plan (e.g.
  sizes a layer uses within a buffer compiled in): a pipeline stage places its layers' rows once
  per Plan;
* *batch inputs* (`Plugin.batch_inputs`, ``{layer: [B, ...]}``) come with each training batch
  (e.g. the routes a routing cache holds for its samples), cut into microbatches like the tokens.

The single program reads every row, a pipeline stage those of its own layers, each name stacked
in layer order (``[layers, ...]``), so changing the values runs the same programs. What a stage's
programs are lowered for is their `InputSignature`s, part of its `StageSpec`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

import numpy as np

StepInputs = Mapping[str, Mapping[int, np.ndarray]]
BatchInputs = Mapping[str, Mapping[int, np.ndarray]]  # rows [B, ...] of one training batch


@dataclasses.dataclass(frozen=True)
class InputSignature:
    """One per-layer input as a program is lowered for it: the layers reading it (in order),
    one layer's row shape (a batch input's after its batch axis) and dtype, and ``fill``, the
    value a layer timed alone reads (profiling: e.g. the most work its buffers allow)."""

    name: str
    layers: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str
    fill: float = 0

    def of(self, layers: Collection[int]) -> InputSignature | None:
        """The signature restricted to ``layers`` (None: none of them reads it)."""
        held = tuple(i for i in self.layers if i in layers)
        return dataclasses.replace(self, layers=held) if held else None


def signatures(
    inputs: StepInputs, fills: Mapping[str, float] | None = None
) -> tuple[InputSignature, ...]:
    """The signatures of step inputs given by value (``fills``: each name's profiling fill)."""
    out = []
    for name in sorted(inputs):
        rows = inputs[name]
        layers = tuple(sorted(rows))
        if not layers:
            continue
        first = np.asarray(rows[layers[0]])
        fill = (fills or {}).get(name, 0)
        out.append(InputSignature(name, layers, first.shape, str(first.dtype), fill))
    return tuple(out)


def restrict(
    sigs: Sequence[InputSignature], layers: Collection[int]
) -> tuple[InputSignature, ...]:
    """``sigs`` restricted to ``layers``, those none of them reads left out."""
    return tuple(s for s in (sig.of(layers) for sig in sigs) if s is not None)


def rows_of(inputs: StepInputs, layers: Collection[int] | None = None) -> dict[str, np.ndarray]:
    """Each input's rows of ``layers`` (all of them: None) stacked in layer order; an input
    none of ``layers`` reads is left out."""
    out = {}
    for name, rows in inputs.items():
        held = [rows[i] for i in sorted(rows) if layers is None or i in layers]
        if held:
            out[name] = np.stack(held)
    return out


def layer_rows(
    stacked: Mapping[str, object], sigs: Sequence[InputSignature], layers: Sequence[int]
) -> list[dict[str, object]]:
    """Each of ``layers``' rows of the ``stacked`` inputs ([layers reading it, ...] by name,
    as `rows_of` stacks them; a name not given is left out): what `run_layers` takes."""
    out: list[dict[str, object]] = [{} for _ in layers]
    for sig in sigs:
        if sig.name not in stacked:
            continue
        for j, layer in enumerate(sig.layers):
            out[layers.index(layer)][sig.name] = stacked[sig.name][j]
    return out
