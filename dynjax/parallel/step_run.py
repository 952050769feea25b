"""The run of one pipeline step: the schedule's tasks dispatched in their global order.

docs/parallelism.md: a step walks the global dispatch order of the schedule's task lists
(`dispatch`), sends activations (with the block wrappers' carry) and their gradients to the
neighbour stage (`Transport.send`), accumulates gradients over the microbatches, sums the
per-stage gradient norms over all stages for clipping and updates each stage's parameters.
Stages whose wrappers read the model's readout (early exit) get the last stage's norm and head
parameters once per step and send their gradient back to it before the norms
(`stage_programs`). Everything is dispatched asynchronously: a step never waits for a result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dynjax.parallel.executable import PipelineExecutable
from dynjax.parallel.feed import place_microbatches
from dynjax.parallel.mesh import TOKEN_AXES
from dynjax.parallel.residuals import keeps_residuals
from dynjax.parallel.stage_inputs import StageInputs
from dynjax.parallel.stage_programs import add_readout_grads
from dynjax.parallel.stage_state import StageState
from dynjax.parallel.stages import PipelineSpec, StageSpec
from dynjax.parallel.step_inputs import BatchInputs, rows_of
from dynjax.parallel.transport import Transport
from jax_private import copy_to


@dataclasses.dataclass
class Run:
    """The arrays in flight during one step."""

    exe: PipelineExecutable
    inputs: np.ndarray  # the rows ``held`` of the batch's ``size``, on this process
    targets: np.ndarray
    held: np.ndarray
    size: int
    routes: BatchRows  # the batch inputs of each (stage, microbatch)
    # [stage][microbatch] -> (stage input, its context), kept for the backward
    stage_in: list[dict[int, Any]]
    grad_in: list[dict[int, Any]]  # [stage][microbatch] -> gradient of the stage output
    # [stage][microbatch] -> what the forward kept for the backward (``recompute`` off)
    residuals: list[dict[int, Any]]
    # [stage][microbatch] -> the inputs of a split backward's ``W`` task, from its ``B``
    weight_work: list[dict[int, tuple]]
    metrics: list[list[Any]]  # [stage][microbatch] -> metrics of that forward
    # (kind, stage, microbatch) -> what a task produced for a neighbour, until its send
    outbox: dict[tuple[str, int, int], Any]
    readout: dict[int, Any]  # stage -> the last stage's norm and head parameters, this step
    # (field, microbatches, sharding) -> every microbatch of it, placed at the first request
    placed: dict[tuple[str, int, NamedSharding], list[jax.Array]] = dataclasses.field(
        default_factory=dict
    )

    # copies between this process's stages not made yet: (arrays, target shardings, what
    # receives the copies), made together by `flush` (`defer`)
    deferred: list[tuple[list[jax.Array], list[NamedSharding], Callable[[list], None]]] = (
        dataclasses.field(default_factory=list)
    )

    def defer(
        self, arrays: list[jax.Array], shardings: list[NamedSharding], land: Callable[[list], None]
    ) -> None:
        """Copy ``arrays`` to ``shardings`` (another stage of this process) when a task first
        needs a copy not made yet, together with every other copy pending then: one call of
        many copies (`copy_to`) costs far less host time than one call each (issue 15 §7;
        GPipe's 48 copies a step go in 6 calls). The copies are only enqueued later, never
        made to wait for."""
        self.deferred.append((arrays, shardings, land))

    def flush(self) -> None:
        if not self.deferred:
            return
        arrays = [a for arrays, _, _ in self.deferred for a in arrays]
        shardings = [sh for _, shardings, _ in self.deferred for sh in shardings]
        moved, start = copy_to(arrays, shardings), 0
        for some, _, land in self.deferred:
            land(moved[start : start + len(some)])
            start += len(some)
        self.deferred = []

    def take(self, table: list[dict[int, Any]], s: int, m: int, pop: bool) -> Any:
        """``table[s][m]`` (a stage input or output gradient) once its deferred copy is made;
        ``pop``: removed (its last use frees it)."""
        if m not in table[s]:
            self.flush()
        return table[s].pop(m) if pop else table[s][m]

    def readout_of(self, s: int) -> dict[str, Any]:
        return {"readout": self.readout[s]} if s in self.readout else {}

    def place(self, field: str, m: int, m_count: int, sharding: NamedSharding) -> jax.Array:
        """Microbatch ``m`` (rows ``m::m_count``) of ``field`` on ``sharding`` (a local
        stage's): all ``m_count`` microbatches are placed together on the first request."""
        key = (field, m_count, sharding)
        if key not in self.placed:
            values = getattr(self, field)
            self.placed[key] = place_microbatches(values, self.held, self.size, m_count, sharding)
        return self.placed[key][m]


class BatchRows:
    """Each stage's rows of a step's batch inputs (`StageSpec.batch_inputs`), per microbatch,
    on its sub-mesh."""

    def __init__(self, spec: PipelineSpec, batch_in: BatchInputs | None, transport: Transport):
        self.spec, self.batch_in, self.transport = spec, batch_in, transport
        self._stacked: dict[int, dict[str, np.ndarray]] = {}

    def __call__(self, s: int, m: int) -> dict[str, jax.Array] | None:
        stage = self.spec.stages[s]
        if self.batch_in is None or not stage.batch_inputs:
            return None
        if s not in self._stacked:
            self._stacked[s] = rows_of(self.batch_in, stage.layers)
        sharding = self.transport.sharding(s, P(None, TOKEN_AXES))
        return {
            name: jax.device_put(rows[:, m :: stage.microbatches], sharding)
            for name, rows in self._stacked[s].items()
        }


class StepRunner:
    """Dispatches a step's tasks on the stages' state: `start`, `dispatch` per task, `finish`."""

    def __init__(self, stages: StageState, inputs: StageInputs) -> None:
        self.stages, self.inputs = stages, inputs
        self.transport, self.shapes = stages.transport, stages.programs.shapes

    def start(
        self,
        exe: PipelineExecutable,
        inputs: np.ndarray,
        targets: np.ndarray,
        batch_in: BatchInputs | None,
        rows: np.ndarray | None,
    ) -> Run:
        """The arrays of a step on ``exe``, before any task ran; the readout sent."""
        if exe.spec != self.stages.spec:
            raise ValueError("the state is laid out for another stage assignment: migrate first")
        stages = exe.spec.stages
        size = stages[0].microbatch_size * exe.spec.microbatches
        return Run(
            exe=exe,
            inputs=inputs,
            targets=targets,
            held=np.arange(size) if rows is None else rows,
            size=size,
            routes=BatchRows(exe.spec, batch_in, self.transport),
            stage_in=[{} for _ in stages],
            grad_in=[{} for _ in stages],
            residuals=[{} for _ in stages],
            weight_work=[{} for _ in stages],
            metrics=[[None] * exe.spec.microbatches for _ in stages],
            outbox={},
            readout=self.inputs.send_readout(exe.spec),
        )

    def dispatch(
        self, run: Run, s: int, task: Any, action: str, watch: bool = False
    ) -> tuple:
        """Dispatch one entry of the step's order (`dispatch`): a task's program (``"run"``)
        or this process's side of the transfer of what it produced (``"send"``); returns
        what a run computed as far as it is on this process, and with ``watch`` what a
        transfer across processes left on this process's devices (what a timed step
        watches; an untimed step does not collect them)."""
        if action == "send":
            return self._send(run, s, task, [] if watch else None)
        spec = run.exe.spec
        stage, m, m_count = spec.stages[s], task.microbatch, spec.microbatches
        programs, local = run.exe.programs, self.transport.is_local(s)
        params = self.stages.state[s]["params"] if local else None
        residual = keeps_residuals(self.stages.programs.setup, stage)
        if task.kind == "F":
            if local and stage.first:
                x = run.place("inputs", m, m_count, self.inputs.rows(s))
                run.stage_in[s][m] = (x, self.inputs.context(stage, None, run, m, m_count))
            if stage.last or not local:
                return ()  # the last stage's forward runs inside its backward
            x, ctx = run.take(run.stage_in, s, m, pop=False)
            y, carry, run.metrics[s][m], *kept = programs["fwd", s](
                params, x, {**ctx, **run.readout_of(s)}, run.routes(s, m)
            )
            if kept and residual:  # the backward's residuals (`residuals`)
                run.residuals[s][m] = kept[0]
            elif kept:  # the backward recomputes from a frozen prefix's output (`frozen_prefix`)
                run.stage_in[s][m] = (kept[0], ctx)
            run.outbox["F", s, m] = (y, carry)
            return present(y, carry)
        acc, racc = self.stages.acc, self.stages.racc
        if task.kind == "W":  # the weight gradients of a split backward (ZB-H1)
            if not (local and stage.has_backward):
                return ()
            acc[s], done, racc[s] = programs["bwd_w", s](
                params, acc[s], racc[s], *run.weight_work[s].pop(m)
            )
            return present(done)
        x, ctx = run.take(run.stage_in, s, m, pop=True) if local else (None, None)
        if not (local and stage.has_backward):
            return ()
        if stage.last:
            seed = run.place("targets", m, m_count, self.inputs.rows(s))
        else:
            seed = run.take(run.grad_in, s, m, pop=True)
        ctx = {**ctx, **run.readout_of(s)}
        stored = run.residuals[s].pop(m) if residual else ()
        microbatch = (x, ctx, stored, seed, run.routes(s, m))
        split = run.exe.splits.get(s)
        if split is not None:  # B now, its W later (`split_backward`)
            if ("bwd_b", s) not in programs:  # nothing to pass back: W is the whole backward
                run.weight_work[s][m] = (split.kept_for_w(microbatch), ())
                return ()
            g_x, boundary, *metrics = programs["bwd_b", s](params, *microbatch)
            run.weight_work[s][m] = (split.kept_for_w(microbatch), boundary)
            out = (None, g_x, None, *metrics)
        else:
            out = programs["bwd", s](params, acc[s], racc[s], *microbatch)
            acc[s], racc[s] = out[0], out[2]
        if stage.last:
            run.metrics[s][m] = out[3]
        if stage.input_grads:
            run.outbox["B", s, m] = out[1]
        # Not the accumulators: the stage's next backward donates them.
        return present((out[1], out[3:]))

    def _send(
        self, run: Run, s: int, task: Any, held: list[jax.Array] | None
    ) -> tuple[jax.Array, ...]:
        """Move what ``task`` on stage ``s`` produced to the stage that consumes it: a copy
        made later with others (`Run.defer`) inside this process, a transfer both processes
        take part in across two (its arrays on this process go to ``held`` where it is a
        list, `Transport.send`'s, and are returned)."""
        spec, m, m_count = run.exe.spec, task.microbatch, run.exe.spec.microbatches
        local = self.transport.is_local(s)
        if task.kind == "F":
            after = self.shapes(spec.stages[s + 1])
            y, carry = run.outbox.pop(("F", s, m)) if local else (None, None)
            carry_like, carry_def = jax.tree.flatten(after.ctx.get("carry", {}))

            def arrive(moved: jax.Array, moved_carry: Any, dst: StageSpec = spec.stages[s + 1]):
                ctx = self.inputs.context(dst, moved_carry or None, run, m, m_count)
                run.stage_in[dst.index][m] = (moved, ctx)

            if local and self.transport.is_local(s + 1):  # one copy call with others (`defer`)
                run.defer(
                    [y, *jax.tree.leaves(carry)],
                    [after.x.sharding, *(c.sharding for c in carry_like)],
                    lambda a: arrive(a[0], jax.tree.unflatten(carry_def, a[1:])),
                )
                return ()
            moved = self.transport.send(y, s, s + 1, after.x, held)
            moved_carry = self.transport.send_tree(
                carry, s, s + 1, after.ctx.get("carry", {}), held
            )
            if moved is not None:
                arrive(moved, moved_carry)
            return tuple(held or ())
        stage = spec.stages[s]
        if not (stage.has_backward and stage.input_grads):
            return ()
        like = self.shapes(spec.stages[s - 1]).y
        grad = run.outbox.pop(("B", s, m)) if local else None
        if local and self.transport.is_local(s - 1):

            def land(moved: list[jax.Array], dst: int = s - 1) -> None:
                run.grad_in[dst][m] = moved[0]

            run.defer([grad], [like.sharding], land)
            return ()
        moved = self.transport.send(grad, s, s - 1, like, held)
        if moved is not None:
            run.grad_in[s - 1][m] = moved
        return tuple(held or ())

    def finish(self, run: Run) -> dict[str, Any]:
        """Global gradient norm and the update of every stage of this process."""
        stages, programs = run.exe.spec.stages, run.exe.programs
        local = [s.index for s in stages if self.transport.is_local(s.index)]
        run.flush()  # none left unless a schedule sent what no task reads
        self._gather_readout_grads(run.exe.spec)
        acc = self.stages.acc
        sq = {s: programs["sqnorm", s](acc[s]) for s in local}
        sq_all = self.transport.gather(sq, (1,), jnp.float32, len(stages))
        stage_metrics = {}
        for s in local:
            st = self.stages.state[s]
            st["params"], st["opt_state"], acc[s], stage_metrics[s] = programs["update", s](
                st["params"], st["opt_state"], acc[s], sq_all[s], tuple(run.metrics[s])
            )
            leaves = jax.tree.leaves(st["params"])
            if leaves:
                self.stages.updated[s] = (leaves[0], jax.tree.leaves(stage_metrics[s])[0])
        return {"stages": stage_metrics}

    def _gather_readout_grads(self, spec: PipelineSpec) -> None:
        """Add every earlier stage's readout gradient to the last stage's accumulator (the
        norm and head entries), then zero those stages' readout accumulators."""
        last = spec.stages[-1]
        for stage in spec.stages:
            if not stage.needs_readout:
                continue
            s, like = stage.index, self.shapes(last).acc
            acc, racc = self.stages.acc, self.stages.racc
            grads = racc.get(s)
            moved = self.transport.send_tree(
                grads, s, last.index, {k: like[k] for k in self.shapes(stage).racc}
            )
            if moved is not None:
                acc[last.index] = _ADD_READOUT(acc[last.index], moved)
            if self.transport.is_local(s):
                zeros = lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding)
                racc[s] = jax.tree.map(zeros, self.shapes(stage).racc)


def present(*outputs: Any) -> tuple:
    """The arrays of ``outputs`` (None where they are on another process), flattened."""
    return tuple(jax.tree.leaves(outputs))


_ADD_READOUT = jax.jit(add_readout_grads, donate_argnums=0)
