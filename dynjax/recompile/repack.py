"""Re-packing a pipeline onto fewer stages as a Controller policy (seed 000 §3.4, 003 §B.4).

When the model's work has shrunk (pruning, freezing, early exit), DynMo consolidates it onto
fewer workers, subject to each worker's memory, and gives the idle ones back to the job
manager. Here the policy proposes a Plan with fewer `stage_layers`; the runtime migrates the
layers, and the training loop releases the unused stage sub-meshes through the release hook
(`dynjax.launch.release`). Only whole trailing sub-meshes are released: stage s of the packed
Plan runs on sub-mesh s.

Memory comes from the profile of the current layout, as in DynMo ("the actual memory usage from
the profiling step"; `dynjax.recompile.memory`): a packed stage must hold its layers' shares of
the measured bytes plus the stage inputs its new place in the schedule keeps. Among the stage
counts whose exact min-max layout (`dynjax.balance.partition` with memory caps) fits, the policy
takes the fewest whose simulated step time is at most ``1 + max_slowdown`` times today's and
whose device-seconds per step (step time x stages) do not grow: the same work on fewer devices,
at no worse cost per device (seed 000 Fig. 4).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dynjax.balance import InfeasibleError, partition, stage_costs
from dynjax.recompile.memory import STAGE_MEMORY, layer_memory, stage_capacities
from dynjax.recompile.plan import Plan
from dynjax.recompile.policy import History, Periodic, Proposal
from dynjax.recompile.rebalance import (
    current_profile,
    layer_times,
    moved_layers,
    predict_seconds,
)


class Repack:
    """Proposes a Plan with fewer pipeline stages when memory allows and the step keeps pace.

    Decides once every `every` metrics steps, in the first round after a multiple of `every`
    that has a profile of the current layout (`Periodic`), on that profile. `target`
    asks for exactly that many stages (0: as few as fit). Every decision returns a `repack`
    record: the old and new layouts, the stage counts tried and why each failed, the simulated
    step time of both layouts, the estimated memory per new stage against `memory_bytes`.
    """

    name = "repack"

    def __init__(
        self,
        *,
        memory_bytes: float,
        layer_state_bytes: Sequence[float],
        every: int = 50,
        target: int = 0,
        max_slowdown: float = 0.0,
        comm_seconds: float = 0.0,
    ) -> None:
        """`memory_bytes`: what one device of a stage may use. `layer_state_bytes`: [L] per
        device, to share a stage's measured memory among its layers."""
        if memory_bytes <= 0:
            raise ValueError(f"memory_bytes={memory_bytes} must be > 0")
        if min(every, target, max_slowdown, comm_seconds) < 0:
            raise ValueError("every, target, max_slowdown and comm_seconds must be >= 0")
        self.memory_bytes = float(memory_bytes)
        self.layer_state_bytes = np.asarray(layer_state_bytes, dtype=np.float64)
        self.target = target
        self._periodic = Periodic(every)
        self.max_slowdown, self.comm = max_slowdown, comm_seconds

    def propose(self, history: History, plan: Plan) -> Proposal | None:
        old = plan.stage_layers
        latest = history.latest_step
        if len(old) < 2 or latest is None or not self._periodic.due(latest):
            return None
        if self.target >= len(old):  # packed to the target already: nothing to decide
            return None
        profile = current_profile(history, old)
        if profile is None or STAGE_MEMORY not in profile[1]:
            return None
        self._periodic.decide(latest)
        step, metrics = profile
        fwd, bwd = layer_times(metrics)
        memory = layer_memory(metrics, old, self.layer_state_bytes)
        before = predict_seconds(fwd, bwd, old, plan, self.comm)
        counts = [self.target] if self.target else range(1, len(old))
        tried, chosen = [], None
        for k in counts:
            caps = stage_capacities(
                self.memory_bytes, metrics, plan.schedule, k, plan.microbatches
            )
            if caps.min() <= 0:
                tried.append({"stages": k, "why": "memory: kept stage inputs alone fill a device"})
                continue
            try:
                new = partition(
                    fwd + bwd, k, memory=memory, capacity=caps, comm=self.comm
                )
            except InfeasibleError as e:
                tried.append({"stages": k, "why": f"memory: {e}"})
                continue
            after = predict_seconds(fwd, bwd, new, plan, self.comm)
            if after > before * (1 + self.max_slowdown):
                why = f"step {after:.4g} s > {1 + self.max_slowdown:g} x {before:.4g} s"
            elif after * k > before * len(old):
                why = f"device-seconds per step grow: {after * k:.4g} > {before * len(old):.4g}"
            else:
                chosen = (new, after, caps)
                break
            tried.append({"stages": k, "why": why, "layout": list(new), "seconds": after})
        record = {
            "event": "repack",
            "profile_step": step,
            "old": list(old),
            "new": list(chosen[0]) if chosen else None,
            "accepted": chosen is not None,
            "tried": tried,
            "predicted_old_seconds": before,
            "predicted_new_seconds": chosen[1] if chosen else None,
            "memory_bytes": self.memory_bytes,
            "max_slowdown": self.max_slowdown,
        }
        if chosen is None:
            return Proposal(plan, "", records=(record,))
        new, after, caps = chosen
        used = stage_costs(memory, new)
        record["moved_layers"] = moved_layers(old, new)
        record["predicted_stage_memory_bytes"] = (used + self.memory_bytes - caps).tolist()
        reason = (
            f"{len(old)} -> {len(new)} stages, {list(old)} -> {list(new)}: "
            f"{before:.4g} -> {after:.4g} s/step predicted"
        )
        return Proposal(plan.replace(stage_layers=new), reason, records=(record,))
