"""MoE's part of the Plan: static capacities (Eq. 4) and the facts they are sized against."""

import pytest

from dynjax.dynamism.moe.part import MoEContext, capacity_for_factor, static_capacities
from dynjax.recompile import PlanError

MOE = MoEContext(num_moe_layers=2, num_experts=4, top_k=2, group_tokens=64)


def test_static_capacities_follow_eq4_and_clip():
    # C = ceil(factor * group_tokens * top_k / E) = ceil(1.1 * 64 * 2 / 4) = ceil(35.2)
    assert static_capacities(MOE, 1.1) == ((36,) * 4,) * 2
    assert capacity_for_factor(MOE, 1.0) == 32
    assert capacity_for_factor(MOE, 100.0) == 64  # never more than a group holds
    assert capacity_for_factor(MOE, 1e-6) == 1  # never below one slot
    ctx = MoEContext(num_moe_layers=1, num_experts=1, top_k=1, group_tokens=30)
    assert capacity_for_factor(ctx, 0.1) == 3  # 0.1 * 30 is 3.0000000000000004 in floats


def test_an_impossible_moe_context_is_refused():
    with pytest.raises(PlanError):
        MoEContext(num_moe_layers=1, num_experts=2, top_k=4, group_tokens=8)
    with pytest.raises(PlanError):
        MoEContext(num_moe_layers=1, num_experts=0, top_k=1, group_tokens=8)
