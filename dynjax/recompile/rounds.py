"""One round of the controller's policies: the Plan they propose together, and the budget.

Deciding is apart from the `Controller`'s threads and multi-process agreement (STYLE trap 4:
decide, plan, execute in separate places): a round is plain code over a `History` and a Plan,
which reports what it refuses (``recompile_rejected``, a policy's records, ``policy_error``)
and remembers only what the budget and the once-per-refused-Plan rule need.
"""

from __future__ import annotations

import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dynjax.recompile.plan import Plan
from dynjax.recompile.policy import History, Policy, as_proposal

Event = dict[str, Any]


@dataclass(frozen=True)
class Budget:
    """At most `max_recompiles` accepted proposals within any `window_steps` training steps.

    Protects against thrashing (seed 001 §5.2: a policy that recompiles every iteration
    eliminates any speed-up). Returns to cached Plans count too: each swap still migrates state.
    """

    max_recompiles: int
    window_steps: int

    def __post_init__(self) -> None:
        if self.max_recompiles < 0 or self.window_steps < 1:
            raise ValueError(f"need max_recompiles >= 0 and window_steps >= 1, got {self}")

    def allows(self, accepted_steps: Sequence[int], step: int) -> bool:
        """Whether one more recompile at `step` fits, given the steps of earlier ones."""
        recent = sum(1 for s in accepted_steps if step - s < self.window_steps)
        return recent < self.max_recompiles


@dataclass(frozen=True)
class Accepted:
    """The Plan a round accepted, for the `Compiler`."""

    plan: Plan
    reason: str  # "policy: reason" of each policy that changed it, joined by "; "
    policy: str  # their names, joined by "+"
    free: bool  # runs the current executable (e.g. ragged MoE capacities): outside the budget


class PolicyRounds:
    """Runs the policies in order, each on the Plan as changed by the ones before it, so the
    changes of one round are compiled together. A proposal that `validate` rejects (it raises
    `ValueError`, e.g. `PlanError`) is dropped with a ``recompile_rejected`` event; the combined
    Plan must fit the `budget` unless it is ``free`` (`same_program`). A policy (or the budget)
    that keeps refusing the same Plan is reported once, until it refuses another one or a
    recompile goes through (`submitted`)."""

    def __init__(
        self,
        policies: Sequence[Policy],
        *,
        emit: Callable[[Event], None],
        validate: Callable[[Plan], None],
        budget: Budget,
        same_program: Callable[[Plan, Plan], bool],
    ) -> None:
        self._policies = tuple(policies)
        self._emit, self._validate = emit, validate
        self._budget, self._same_program = budget, same_program
        self._accepted_steps: deque[int] = deque(maxlen=max(budget.max_recompiles, 1))
        self._refused: dict[str, Plan] = {}  # policy name or "budget" -> last Plan refused

    def run(self, history: History, base: Plan, step: int) -> Accepted | None:
        """The Plan this round's policies propose on ``base`` at training ``step``, or None."""
        where = {"step": step, "metrics_step": history.latest_step}
        plan, reasons, names = base, [], []
        for policy in self._policies:
            try:
                proposal = as_proposal(policy, policy.propose(history, plan))
            except Exception as e:
                self._emit(
                    {
                        "event": "policy_error",
                        **where,
                        "policy": policy.name,
                        "error": f"{type(e).__name__}: {e}",
                        "traceback": traceback.format_exc(),
                    }
                )
                continue
            if proposal is None:
                continue
            for record in proposal.records:
                self._emit({**record, **where, "policy": policy.name})
            if proposal.plan == plan:
                continue
            try:
                self._validate(proposal.plan)
            except ValueError as e:
                if self._refused.get(policy.name) == proposal.plan:
                    continue
                self._refused[policy.name] = proposal.plan
                self._emit(
                    {
                        "event": "recompile_rejected",
                        **where,
                        "reason": str(e),
                        "policy": policy.name,
                        "plan_diff": plan.diff(proposal.plan),
                    }
                )
                continue
            plan = proposal.plan
            reasons.append(f"{policy.name}: {proposal.reason}" if proposal.reason else policy.name)
            names.append(policy.name)
        if plan == base:
            return None
        free = self._same_program(base, plan)
        accepted = Accepted(plan, "; ".join(reasons), "+".join(names), free)
        if not accepted.free and not self._budget.allows(self._accepted_steps, step):
            if self._refused.get("budget") == plan:
                return None
            self._refused["budget"] = plan
            self._emit(
                {
                    "event": "recompile_rejected",
                    **where,
                    "reason": "budget",
                    "detail": f"{self._budget.max_recompiles} recompiles within "
                    f"{self._budget.window_steps} steps already",
                    "policy": accepted.policy,
                    "plan_diff": base.diff(plan),
                }
            )
            return None
        return accepted

    def submitted(self, accepted: Accepted, step: int) -> None:
        """``accepted`` went to the compiler at ``step``: it counts against the budget (unless
        free), and every refusal may be reported again."""
        if not accepted.free:
            self._accepted_steps.append(step)
        self._refused.clear()
