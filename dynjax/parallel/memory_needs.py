"""What a compiled step needs of a device's memory, by XLA's own memory analysis (issue 32 §4):
checked against the device before training, so a model too big is an error that says what
shrinks it rather than an out-of-memory traceback a minute in."""

from __future__ import annotations

from typing import Any

from dynjax.parallel.executable import PipelineExecutable


def device_bytes_needed(executable: Any) -> dict[int, int]:
    """Per stage (0: the single program), the bytes one device needs while the stage's largest
    program runs: its arguments and outputs (less those that alias: donated state) and its
    temporaries. A lower bound for a pipeline stage, which also keeps its microbatches' inputs
    between programs. Empty where the backend analyses nothing."""
    if isinstance(executable, PipelineExecutable):
        programs = [(stage, compiled) for (_, stage), compiled in executable.programs.items()]
    else:
        programs = [(0, executable)]
    out: dict[int, int] = {}
    for stage, compiled in programs:
        m = compiled.memory_analysis()
        if m is None:
            continue
        need = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                + m.temp_size_in_bytes)
        out[stage] = max(out.get(stage, 0), int(need))
    return out
