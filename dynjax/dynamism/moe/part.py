"""MoE's part of the Plan (``plan.part("moe")``) and the facts that decide whether it is possible.

The part holds ``capacities`` (one tuple of E ints per MoE layer, in layer order: slots per
expert per dispatch group, one sequence, so they depend on neither batch size nor mesh; seed 001
§4.1, Eq. 4), ``cached_routing`` (dispatch with the cached sample assignment instead of waiting
for the router, §4.2), ``chunks`` (MPipeMoE's partitions per MoE layer) and ``memory_reuse``.
The Plan carries it as opaque data; validating it is `plan_problems`, which the Plan's
validation calls through `PlanContext.checks`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dynjax.model.facts import ModelFacts
from dynjax.recompile import Plan, PlanError

NAME = "moe"


@dataclass(frozen=True)
class MoEContext:
    """The model facts MoE's part is checked and sized against.

    `group_tokens` is the number of tokens in one dispatch group (one sequence of `seq_len`
    tokens), the unit capacities are counted in.
    """

    num_moe_layers: int
    num_experts: int
    top_k: int
    group_tokens: int

    def __post_init__(self) -> None:
        if (
            self.num_moe_layers < 0
            or min(self.num_experts, self.top_k, self.group_tokens) < 1
            or self.top_k > self.num_experts
        ):
            raise PlanError(f"impossible MoE model for a Plan: {self}")


def moe_context(facts: ModelFacts) -> MoEContext:
    m = facts.model
    return MoEContext(len(m.moe_layers), m.num_experts, m.top_k, facts.seq_len)


def capacities_of(plan: Plan) -> tuple[tuple[int, ...], ...]:
    """``plan``'s per-expert capacities per MoE layer; () without MoE layers."""
    return plan.part(NAME).get("capacities", ())


def cached_routing_of(plan: Plan) -> bool:
    return bool(plan.part(NAME).get("cached_routing", False))


def with_capacities(plan: Plan, caps) -> Plan:
    """``plan`` with capacities ``caps`` (NumPy integers stored as Python ints, for JSON)."""
    return plan.with_part(NAME, capacities=tuple(tuple(int(c) for c in layer) for layer in caps))


def plan_problems(plan: Plan, ctx: MoEContext) -> list[str]:
    """Every problem of ``plan``'s MoE part for ``ctx``, each with its fix."""
    caps = capacities_of(plan)
    problems = []
    if len(caps) != ctx.num_moe_layers:
        problems.append(
            f"capacities has {len(caps)} layers but the model has "
            f"{ctx.num_moe_layers} MoE layers: build it with static_capacities(ctx, factor)"
        )
    for layer, row in enumerate(caps):
        if len(row) != ctx.num_experts:
            problems.append(
                f"capacities[{layer}] has {len(row)} experts but the model has "
                f"{ctx.num_experts}: give one capacity per expert"
            )
        for expert, c in enumerate(row):
            if c < 1:
                problems.append(
                    f"capacities[{layer}][{expert}] = {c} is below 1: an expert needs at "
                    "least one slot (raise the minimum capacity factor)"
                )
            elif c > ctx.group_tokens:
                problems.append(
                    f"capacities[{layer}][{expert}] = {c} exceeds the {ctx.group_tokens} "
                    "tokens of a dispatch group: clip it to group_tokens"
                )
    return problems


def base_capacity(ctx: MoEContext) -> float:
    """Slots per expert per group at capacity factor 1.0: group_tokens * top_k / E (Eq. 4)."""
    return ctx.group_tokens * ctx.top_k / ctx.num_experts


def capacity_for_factor(ctx: MoEContext, factor: float) -> int:
    """ceil(factor * base_capacity), clipped to [1, group_tokens] (seed 001 §4.1, Eq. 4)."""
    # The small tolerance keeps float noise (0.1 * 30 = 3.0000000000000004) from adding a slot.
    c = math.ceil(factor * base_capacity(ctx) - 1e-9)
    return min(max(c, 1), ctx.group_tokens)


def static_capacities(ctx: MoEContext, factor: float) -> tuple[tuple[int, ...], ...]:
    """A static, global capacity factor (the baseline of seed 001 §5.2) as the part's
    capacities."""
    c = capacity_for_factor(ctx, factor)
    return tuple((c,) * ctx.num_experts for _ in range(ctx.num_moe_layers))
