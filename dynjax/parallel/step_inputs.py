"""Step inputs: per-layer arrays a step reads rather than compiles in (`Plugin.step_inputs`).

A plugin declares them by name as ``{layer: row}``; the runtimes carry them without knowing
what they mean. The single program reads every row, a pipeline stage those of its own layers,
each name stacked in layer order (``[layers, ...]``), so changing the values runs the same
programs.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np

StepInputs = Mapping[str, Mapping[int, np.ndarray]]


def rows_of(inputs: StepInputs, layers: Collection[int] | None = None) -> dict[str, np.ndarray]:
    """Each input's rows of ``layers`` (all of them: None) stacked in layer order; an input
    none of ``layers`` reads is left out."""
    out = {}
    for name, rows in inputs.items():
        held = [rows[i] for i in sorted(rows) if layers is None or i in layers]
        if held:
            out[name] = np.stack(held)
    return out
