"""Dynamic pipeline load balancing: DynMo's rebalance step as a Controller policy.

Seed 000 §3.3-3.4 and seed 003 §B.3: after the model changed, profile every layer, re-partition
the layers over the stages (exact `partition`, or neighbour-to-neighbour `diffusion`) and move
the layers whose stage changed. Seed 003 §D.2: a stage's cost includes sending its activations
to the next stage (`comm_seconds`, in both the balancer and the simulation).

A move is worth it only if it pays for itself: the simulated step time of the old and new
layouts (`dynjax.balance.simulate`, fed with the profiled per-layer times) gives the gain per
step, which must exceed the cost of the move (bytes of the moved layers over
`bandwidth_bytes_per_sec`, plus `recompile_seconds`) when summed over `amortize_steps` steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dynjax.balance import (
    InfeasibleError,
    diffusion,
    imbalance,
    partition,
    simulate,
    stage_costs,
)
from dynjax.recompile.memory import STAGE_MEMORY, layer_memory, stage_capacities
from dynjax.recompile.plan import Plan
from dynjax.recompile.policy import History, Metrics, Periodic, Proposal

LAYER_FORWARD = "profile/layer_forward_seconds"  # [L] seconds per microbatch
LAYER_BACKWARD = "profile/layer_backward_seconds"  # [L] (with the forward's recompute)
EMBED = "profile/embed_seconds"  # [2] forward, backward of the token embedding
HEAD = "profile/head_seconds"  # [2] forward, backward of the final norm, head and loss
STAGE_FORWARD = "profile/stage_forward_seconds"  # [S] measured in the profiled step
STAGE_BACKWARD = "profile/stage_backward_seconds"  # [S]
STAGE_LAYERS = "profile/stage_layers"  # [S] the layout the profiled step ran
ITERATION = "profile/iteration_seconds"  # measured forward/backward part of the profiled step
BY = ("time", "param")
METHODS = ("partition", "diffusion")


def moved_layers(old: Sequence[int], new: Sequence[int]) -> list[int]:
    """Layers whose stage differs between the layouts ``old`` and ``new`` (layers per stage).

    >>> moved_layers((3, 1), (2, 2))
    [2]
    """
    stage_of = lambda counts: np.repeat(np.arange(len(counts)), counts)
    return np.flatnonzero(stage_of(old) != stage_of(new)).tolist()


class Rebalance:
    """Proposes a new `Plan.stage_layers` when the predicted gain pays for the move.

    A decision is taken on the newest profile of the *current* layout (the first step of every
    Plan is profiled, `pipeline.profile_on_change`; `pipeline.profile_every` refreshes it):

    * once every `every` metrics steps (0: never), in the first round after a multiple of
      `every` that has such a profile (`Periodic`), or
    * in the first round that sees a profile not decided on yet whose measured stage times'
      imbalance (seed 000 eq. 2) exceeds `threshold` (0: off).

    Per-layer costs are the profiled forward + backward times (`by="time"`, with the embedding
    in the first layer and the head in the last) or the `layer_params` given here
    (`by="param"`); the step-time prediction always uses the profiled times. Every decision,
    moving or not, returns a `rebalance` record: old/new counts, the simulated step time of
    both, the move's cost, whether it was accepted, and `measured_seconds`, the measured
    iteration time of the current layout's profile, i.e. the measured result of the previous
    accepted move one interval later (compare with that decision's `predicted_new_seconds`). The
    simulation covers the layers, embedding, head and `comm_seconds`, not the optimizer update
    or host dispatch, so the two agree in trend more than in absolute value. `accepted` means
    proposed: the Controller may still reject the Plan (validation, budget), which its
    `recompile_rejected` event then records.
    """

    name = "rebalance"

    def __init__(
        self,
        *,
        total_steps: int,
        layer_bytes: Sequence[int],
        every: int = 50,
        threshold: float = 0.0,
        by: str = "time",
        method: str = "partition",
        amortize_steps: int = 0,
        bandwidth_bytes_per_sec: float = 10e9,
        recompile_seconds: float = 10.0,
        comm_seconds: float = 0.0,
        layer_params: Sequence[int] | None = None,
        memory_bytes: float | None = None,
        layer_state_bytes: Sequence[float] | None = None,
    ) -> None:
        """`layer_bytes`: [L] bytes a moved layer copies (parameters and optimizer state).
        `amortize_steps`: steps the gain is summed over; 0 = the rest of the run.
        `memory_bytes`: what one device of a stage may use; with `layer_state_bytes` ([L] per
        device) no stage of a new layout may need more, by the profile's memory
        (`dynjax.recompile.memory`). None: memory is not checked."""
        if by not in BY or method not in METHODS:
            raise ValueError(f"by={by!r} must be in {BY} and method={method!r} in {METHODS}")
        if by == "param" and layer_params is None:
            raise ValueError("by='param' needs layer_params")
        if min(every, amortize_steps, threshold, recompile_seconds, comm_seconds) < 0:
            raise ValueError("every, amortize_steps, threshold and the costs must be >= 0")
        if bandwidth_bytes_per_sec <= 0:
            raise ValueError(f"bandwidth_bytes_per_sec={bandwidth_bytes_per_sec} must be > 0")
        self.total_steps = total_steps
        self.layer_bytes = np.asarray(layer_bytes, dtype=np.float64)
        self.threshold, self.by, self.method = threshold, by, method
        self._periodic = Periodic(every)
        self._judged = -1  # the step of the newest profile a decision was taken on
        self.amortize_steps = amortize_steps
        self.bandwidth = bandwidth_bytes_per_sec
        self.recompile_seconds = recompile_seconds
        self.comm = comm_seconds
        self.layer_params = None if layer_params is None else np.asarray(layer_params, float)
        if (memory_bytes is None) != (layer_state_bytes is None):
            raise ValueError("memory_bytes and layer_state_bytes go together")
        self.memory_bytes = memory_bytes
        self.layer_state_bytes = (
            None if layer_state_bytes is None else np.asarray(layer_state_bytes, float)
        )

    def propose(self, history: History, plan: Plan) -> Proposal | None:
        old = plan.stage_layers
        if len(old) < 2 or history.latest_step is None:
            return None
        profile = current_profile(history, old)
        if profile is None:
            return None
        step, metrics = profile
        latest = history.latest_step
        periodic = self._periodic.due(latest)
        # A profile whose timeline measured nothing (`Profile.timeline_measured`) triggers no
        # decision; a periodic one still runs on its unit times.
        measured_imbalance = None
        if STAGE_FORWARD in metrics:
            stage_times = np.asarray(metrics[STAGE_FORWARD]) + np.asarray(metrics[STAGE_BACKWARD])
            measured_imbalance = imbalance(stage_times)
        triggered = (
            measured_imbalance is not None
            and 0 < self.threshold < measured_imbalance
            and step > self._judged
        )
        if not (periodic or triggered):
            return None
        if periodic:
            self._periodic.decide(latest)
        self._judged = step
        fwd, bwd = layer_times(metrics)
        costs = fwd + bwd if self.by == "time" else self.layer_params
        limits = {}
        if self.memory_bytes is not None and STAGE_MEMORY in metrics:
            limits = dict(
                memory=layer_memory(metrics, old, self.layer_state_bytes),
                capacity=stage_capacities(
                    self.memory_bytes,
                    metrics,
                    plan.schedule,
                    len(old),
                    plan.microbatches,
                    plan.virtual_stages,
                ),
            )
        try:
            if self.method == "partition":
                new = partition(costs, len(old), current=old, comm=self.comm, **limits)
            else:
                new = diffusion(costs, old, comm=self.comm, **limits)
        except InfeasibleError as e:  # no layout fits: keep this one, and say so
            new, infeasible = old, str(e)
        else:
            infeasible = None
        before = predict_seconds(fwd, bwd, old, plan, self.comm)
        after = predict_seconds(fwd, bwd, new, plan, self.comm)
        moved = moved_layers(old, new)
        moved_bytes = float(self.layer_bytes[moved].sum())
        cost = moved_bytes / self.bandwidth + (self.recompile_seconds if moved else 0.0)
        horizon = self.amortize_steps or max(self.total_steps - latest, 0)
        gain = before - after
        accepted = bool(moved) and gain > 0 and gain * horizon > cost
        record = {
            "event": "rebalance",
            "profile_step": step,
            "trigger": "every" if periodic else "threshold",
            "by": self.by,
            "method": self.method,
            "old": list(old),
            "new": list(new),
            "accepted": accepted,
            "moved_layers": moved,
            "moved_bytes": moved_bytes,
            "measured_imbalance": measured_imbalance,
            "measured_seconds": float(metrics[ITERATION]) if ITERATION in metrics else None,
            "predicted_old_seconds": before,
            "predicted_new_seconds": after,
            "gain_seconds": gain * horizon,
            "move_cost_seconds": cost,
            "amortize_steps": horizon,
            "memory_checked": bool(limits),
        }
        if infeasible:
            record["infeasible"] = infeasible
        reason = (
            f"{list(old)} -> {list(new)}: {before:.4g} -> {after:.4g} s/step predicted, "
            f"gain {gain * horizon:.3g} s over {horizon} steps vs move cost {cost:.3g} s"
        )
        new_plan = plan.replace(stage_layers=new) if accepted else plan
        return Proposal(new_plan, reason, records=(record,))


def layer_times(metrics: Metrics) -> tuple[np.ndarray, np.ndarray]:
    """[L] forward and backward seconds per microbatch of each layer, with the embedding's
    counted in the first layer and the head's (norm, head, loss) in the last: the stages that
    hold those layers run them too, and a large vocabulary makes them count."""
    fwd = np.array(metrics[LAYER_FORWARD], dtype=np.float64)
    bwd = np.array(metrics[LAYER_BACKWARD], dtype=np.float64)
    for key, layer in ((EMBED, 0), (HEAD, -1)):
        if key in metrics:
            fwd[layer] += metrics[key][0]
            bwd[layer] += metrics[key][1]
    return fwd, bwd


def current_profile(history: History, counts: tuple[int, ...]) -> tuple[int, Metrics] | None:
    """The newest profiled ``(step, metrics)`` entry that ran the layout ``counts``."""
    for step, metrics in reversed(history.window(len(history), LAYER_FORWARD)):
        if tuple(np.asarray(metrics.get(STAGE_LAYERS, ())).tolist()) == counts:
            return step, metrics
    return None


def predict_seconds(
    fwd: np.ndarray, bwd: np.ndarray, counts: Sequence[int], plan: Plan, comm: float
) -> float:
    """Simulated seconds of one step's forward/backward with layers split as ``counts``, from
    per-layer times ``fwd``, ``bwd`` (seconds per microbatch) and ``plan``'s schedule (with
    interleaving, ``counts`` are logical stages and a layer moved between two of them shifts
    time between two different devices' chunks)."""
    sim = simulate(
        stage_costs(fwd, counts),
        stage_costs(bwd, counts),
        plan.microbatches,
        schedule=plan.schedule,
        comm=comm,
        virtual_stages=plan.virtual_stages,
    )
    return sim.iteration_time

