"""Pipeline schedules as frozen data: one ordered task list per stage, no JAX.

STYLE habit 2 (JaxPP's ``schedules.py``): the simulator here and the pipeline runtime execute the
same task lists, so a schedule can be swapped, printed, hashed and checked without touching either.

* ``gpipe`` (GPipe, Huang et al. 2019): every forward, then every backward in reverse order; each
  stage holds activations for all ``M`` microbatches at its peak.
* ``1f1b`` (PipeDream-flush, Megatron-LM's non-interleaved schedule): stage ``s`` runs
  ``min(S - s - 1, M)`` warm-up forwards, then alternates one forward and one backward, then drains
  the backwards; at most ``S - s`` microbatches are in flight. Same bubble as GPipe, less memory.
"""

from dataclasses import dataclass
from typing import Literal

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Task:
    """One unit of stage work: the forward (``"F"``) or backward (``"B"``) of one microbatch."""

    kind: Literal["F", "B"]
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


Schedule = tuple[tuple[Task, ...], ...]  # [stages][tasks in execution order]


def schedule_tasks(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Per-stage task lists of a named schedule.

    >>> [" ".join(map(str, stage)) for stage in schedule_tasks("1f1b", 2, 3)]
    ['F0 F1 B0 F2 B1 B2', 'F0 B0 F1 B1 F2 B2']
    """
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"need >= 1 stage and microbatch, got {num_stages}, {num_microbatches}")
    if name == "gpipe":
        return tuple(_gpipe(num_microbatches) for _ in range(num_stages))
    if name == "1f1b":
        return tuple(_one_f_one_b(num_stages - s - 1, num_microbatches) for s in range(num_stages))
    raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")


def _gpipe(m: int) -> tuple[Task, ...]:
    return tuple(Task("F", i) for i in range(m)) + tuple(Task("B", i) for i in range(m))


def _one_f_one_b(warmup: int, m: int) -> tuple[Task, ...]:
    warmup = min(warmup, m)
    tasks = [Task("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        tasks += [Task("F", warmup + i), Task("B", i)]
    tasks += [Task("B", i) for i in range(m - warmup, m)]
    return tuple(tasks)


def check_schedule(schedule: Schedule, num_stages: int, num_microbatches: int) -> None:
    """Each stage runs every microbatch's forward and backward once, forward first."""
    if len(schedule) != num_stages:
        raise ValueError(f"schedule has {len(schedule)} stages, expected {num_stages}")
    expected = {(k, i) for k in "FB" for i in range(num_microbatches)}
    for s, tasks in enumerate(schedule):
        seen = [(t.kind, t.microbatch) for t in tasks]
        if len(seen) != len(expected) or set(seen) != expected:
            raise ValueError(f"stage {s} must run F and B of microbatches 0..{num_microbatches - 1}"
                             " exactly once")
        at = {task: i for i, task in enumerate(seen)}
        if any(at["F", i] > at["B", i] for i in range(num_microbatches)):
            raise ValueError(f"stage {s} runs a backward before its forward")


def peak_in_flight(tasks: tuple[Task, ...]) -> int:
    """Most microbatches whose forward ran and backward has not: the activations a stage stores."""
    live = peak = 0
    for task in tasks:
        live += 1 if task.kind == "F" else -1
        peak = max(peak, live)
    return peak
