"""Pipeline schedules as frozen data: one ordered task list per device, no JAX.

STYLE habit 2 (JaxPP's ``schedules.py``): the simulator here and the pipeline runtime execute the
same task lists, so a schedule can be swapped, printed, hashed and checked without touching either.
A task is the forward ``F``, the backward ``B`` or, in schedules that split the backward, its
weight-gradient part ``W`` (``B`` is then the input-gradient part only) of one microbatch on one
*chunk* of the device's layers. With ``v`` virtual stages a pipeline of ``S`` devices has ``S * v``
logical stages; logical stage ``c * S + d`` is chunk ``c`` of device ``d`` (`logical_stage`).

* ``gpipe`` (GPipe, Huang et al. 2019): every forward, then every backward in reverse order; each
  stage holds activations for all ``M`` microbatches at its peak.
* ``1f1b`` (PipeDream-flush, Megatron-LM's non-interleaved schedule): stage ``s`` runs
  ``min(S - s - 1, M)`` warm-up forwards, then alternates one forward and one backward, then drains
  the backwards; at most ``S - s`` microbatches are in flight. Same bubble as GPipe, less memory.
* ``interleaved_1f1b`` (Narayanan et al. 2021 §2.2, Megatron-LM's interleaved schedule): each
  device holds ``v`` non-adjacent chunks and runs 1F1B over them in groups of ``S`` microbatches
  per chunk; the bubble shrinks ``v``-fold to ``(S - 1)(f + b) / v`` at the cost of ``v`` times
  the transfers. Needs ``M`` a multiple of ``S``.
* ``zb_h1`` (Qi et al. 2024, "Zero Bubble Pipeline Parallelism" §3, not in the seeds): 1F1B with
  each backward split into ``B`` and ``W``; stage ``s`` keeps up to ``s`` ``W`` passes pending,
  so its ``B`` reaches the stage before it sooner, and runs them in the drain, where 1F1B idles.
  With ``W <= F``, ``W <= B`` and ``M >= S`` the idle time per stage shrinks from
  ``(S - 1)(F + B + W)`` to ``(S - 1)(F + B - W)``; at most ``S`` microbatches are in flight on
  any stage, 1F1B's peak.
"""

from dataclasses import dataclass
from typing import Literal

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
SPLIT_BACKWARD = ("zb_h1",)  # schedules whose backward is B (input gradient) then W (weights)
INTERLEAVED = ("interleaved_1f1b",)  # schedules that take more than one virtual stage


@dataclass(frozen=True)
class Task:
    """One unit of device work: ``F``, ``B`` or ``W`` of one microbatch on chunk ``chunk``."""

    kind: Literal["F", "B", "W"]
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


Schedule = tuple[tuple[Task, ...], ...]  # [devices][tasks in execution order]


def logical_stage(device: int, chunk: int, num_devices: int) -> int:
    """The position in the model of ``chunk`` of ``device``: chunks are dealt round-robin."""
    return chunk * num_devices + device


def schedule_tasks(
    name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> Schedule:
    """Per-device task lists of a named schedule (``num_stages`` devices).

    >>> [" ".join(map(str, stage)) for stage in schedule_tasks("1f1b", 2, 3)]
    ['F0 F1 B0 F2 B1 B2', 'F0 B0 F1 B1 F2 B2']
    >>> [" ".join(map(str, stage)) for stage in schedule_tasks("zb_h1", 2, 3)]
    ['F0 F1 B0 W0 F2 B1 W1 B2 W2', 'F0 B0 F1 B1 W0 F2 B2 W1 W2']
    """
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"need >= 1 stage and microbatch, got {num_stages}, {num_microbatches}")
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    if name in INTERLEAVED:
        if virtual_stages < 2:
            raise ValueError(f"{name} needs virtual_stages >= 2, got {virtual_stages}")
        if num_microbatches % num_stages:
            raise ValueError(
                f"{name} runs microbatches in groups of one per stage: {num_microbatches} "
                f"microbatches is not a multiple of {num_stages} stages"
            )
        return tuple(
            _interleaved(d, num_stages, num_microbatches, virtual_stages)
            for d in range(num_stages)
        )
    if virtual_stages != 1:
        raise ValueError(f"{name} runs one chunk per device, got virtual_stages={virtual_stages}")
    m = num_microbatches
    if name == "gpipe":
        return tuple(_gpipe(m) for _ in range(num_stages))
    if name == "1f1b":
        return tuple(_one_f_one_b(num_stages - s - 1, m) for s in range(num_stages))
    return tuple(_zb_h1(num_stages - s - 1, m, deferred=s) for s in range(num_stages))


def _gpipe(m: int) -> tuple[Task, ...]:
    return tuple(Task("F", i) for i in range(m)) + tuple(Task("B", i) for i in range(m))


def _one_f_one_b(warmup: int, m: int) -> tuple[Task, ...]:
    warmup = min(warmup, m)
    tasks = [Task("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        tasks += [Task("F", warmup + i), Task("B", i)]
    tasks += [Task("B", i) for i in range(m - warmup, m)]
    return tuple(tasks)


def _zb_h1(warmup: int, m: int, deferred: int) -> tuple[Task, ...]:
    """1F1B's order of F and B, each W run once more than ``deferred`` are pending."""
    tasks, pending = [], []
    for task in _one_f_one_b(warmup, m):
        tasks.append(task)
        if task.kind == "B":
            pending.append(task.microbatch)
            if len(pending) > deferred:
                tasks.append(Task("W", pending.pop(0)))
    return tuple(tasks + [Task("W", i) for i in pending])


def _interleaved(device: int, s: int, m: int, v: int) -> tuple[Task, ...]:
    """Megatron-LM's order: virtual microbatch ``k`` is microbatch ``(k // (s v)) s + k % s`` of
    chunk ``(k // s) % v`` (backwards: chunks in reverse), with ``2 (s - d - 1) + (v - 1) s``
    warm-up forwards on device ``d`` (all of them when ``m == s``)."""
    total = m * v

    def task(kind: Literal["F", "B"], k: int) -> Task:
        chunk = (k // s) % v
        return Task(kind, (k // (s * v)) * s + k % s, chunk if kind == "F" else v - 1 - chunk)

    warmup = total if m == s else min(2 * (s - device - 1) + (v - 1) * s, total)
    tasks = [task("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        tasks += [task("F", warmup + k), task("B", k)]
    return tuple(tasks + [task("B", k) for k in range(total - warmup, total)])


def check_schedule(
    schedule: Schedule, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> None:
    """Each device runs every chunk's F and B of every microbatch once (and W once, in every
    list or none), F before B before W."""
    if len(schedule) != num_stages:
        raise ValueError(f"schedule has {len(schedule)} stages, expected {num_stages}")
    split = has_split_backward(schedule)
    kinds = "FBW" if split else "FB"
    expected = {
        (k, i, c) for k in kinds for i in range(num_microbatches) for c in range(virtual_stages)
    }
    for s, tasks in enumerate(schedule):
        seen = [(t.kind, t.microbatch, t.chunk) for t in tasks]
        if len(seen) != len(expected) or set(seen) != expected:
            raise ValueError(
                f"stage {s} must run {'/'.join(kinds)} of microbatches "
                f"0..{num_microbatches - 1} on chunks 0..{virtual_stages - 1} exactly once"
            )
        at = {task: i for i, task in enumerate(seen)}
        for i in range(num_microbatches):
            for c in range(virtual_stages):
                if at["F", i, c] > at["B", i, c] or (split and at["B", i, c] > at["W", i, c]):
                    raise ValueError(f"stage {s} runs a backward before its forward")


def has_split_backward(schedule: Schedule) -> bool:
    """Whether the schedule's backward is split into B and W."""
    return any(t.kind == "W" for tasks in schedule for t in tasks)


def peak_in_flight(tasks: tuple[Task, ...]) -> int:
    """Most microbatches whose forward ran and whose backward (its W, where split) has not: the
    activations a stage stores."""
    split = any(t.kind == "W" for t in tasks)
    live = peak = 0
    for task in tasks:
        live += 1 if task.kind == "F" else -1 if task.kind == ("W" if split else "B") else 0
        peak = max(peak, live)
    return peak
