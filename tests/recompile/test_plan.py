"""Plan: hashable identity, diff, validation with clear errors, JSON round trip."""

import doctest
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynjax.dynamism.moe.part import (
    MoEContext,
    cached_routing_of,
    capacities_of,
    plan_problems,
    static_capacities,
    with_capacities,
)
from dynjax.recompile import plan as plan_module
from dynjax.recompile.plan import Plan, PlanContext, PlanError

MOE = MoEContext(num_moe_layers=2, num_experts=4, top_k=2, group_tokens=64)
# The Plan's validation with MoE's check of its part, as a run with MoE layers has it.
CTX = PlanContext(batch_size=8, checks=(lambda plan: plan_problems(plan, MOE),))


def moe_plan(capacities, cached_routing: bool = False, **fields) -> Plan:
    """A Plan with MoE's part: these capacities and cached routing."""
    plan = with_capacities(Plan(**fields), capacities)
    return plan.with_part("moe", cached_routing=cached_routing)


def test_docstring_examples():
    assert doctest.testmod(plan_module).failed == 0


def test_equal_plans_hash_equal_whatever_the_container():
    a = moe_plan(((32, 32, 40, 24), (32,) * 4), microbatches=2)
    b = moe_plan([np.array([32, 32, 40, 24]), [32] * 4], microbatches=2)
    assert a == b and hash(a) == hash(b)
    assert {a: "exe"}[b] == "exe"
    assert all(type(c) is int for layer in capacities_of(b) for c in layer)
    assert a != a.with_part("moe", cached_routing=True)


def test_diff_lists_only_changed_experts():
    a = moe_plan(static_capacities(MOE, 1.0))
    b = with_capacities(a, ((32, 48, 32, 32), (32, 32, 32, 16))).replace(dtype="bfloat16")
    diff = a.diff(b)
    assert diff == {
        "parts.moe.capacities[0][1]": (32, 48),
        "parts.moe.capacities[1][3]": (32, 16),
        "dtype": ("float32", "bfloat16"),
    }
    json.dumps(diff)
    assert a.format_diff(b).splitlines() == [
        "dtype: float32 -> bfloat16",
        "parts.moe.capacities[0][1]: 32 -> 48",
        "parts.moe.capacities[1][3]: 32 -> 16",
    ]
    assert a.diff(a) == {} and a.format_diff(a) == "(no change)"


def test_diff_of_capacities_with_another_shape_shows_both_whole():
    a = moe_plan(((4, 4),))
    b = moe_plan(((4, 4), (8, 8)))
    assert a.diff(b) == {"parts.moe.capacities": ([[4, 4]], [[4, 4], [8, 8]])}


def test_str_shows_every_field_and_layer():
    text = str(moe_plan(((1, 2), (3, 4)), microbatches=2))
    assert "capacities: ((1, 2), (3, 4))" in text
    assert "microbatches: 2" in text and "cached_routing: False" in text


def test_valid_plan_passes():
    moe_plan(static_capacities(MOE, 1.25), microbatches=4, dtype="bfloat16").validate(CTX)


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"capacities": ((32,) * 4,)}, ["capacities has 1 layers", "2 MoE layers"]),
        ({"capacities": ((32,) * 4, (32,) * 3)}, ["capacities[1] has 3 experts", "4"]),
        ({"capacities": ((32, 0, 32, 32), (32,) * 4)}, ["capacities[0][1] = 0", "below 1"]),
        ({"capacities": ((32,) * 4, (32, 32, 65, 32))}, ["capacities[1][2] = 65", "64 tokens"]),
        ({"microbatches": 0}, ["microbatches = 0", "at least 1"]),
        ({"microbatches": 3}, ["microbatches = 3", "does not divide", "8"]),
        ({"dtype": "float16"}, ["dtype = 'float16'", "bfloat16"]),
    ],
)
def test_invalid_plans_name_the_field(changes, words):
    caps = changes.pop("capacities", static_capacities(MOE, 1.0))
    plan = moe_plan(caps).replace(**changes)
    with pytest.raises(PlanError) as err:
        plan.validate(CTX)
    header, *problems = str(err.value).splitlines()
    assert header == "invalid Plan:" and len(problems) == 1, problems  # the changed field's only
    for word in words:
        assert word in problems[0]


def test_validation_reports_every_problem_at_once():
    plan = moe_plan(((0, 32, 32, 32), (32,) * 4), microbatches=3, dtype="int8")
    with pytest.raises(PlanError) as err:
        plan.validate(CTX)
    assert len(str(err.value).splitlines()) == 4  # header + three problems


def test_json_round_trip_restores_an_equal_hashable_plan():
    plan = moe_plan(((8, 16), (24, 8)), cached_routing=True, microbatches=2)
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan and hash(back) == hash(plan)
    assert isinstance(capacities_of(back)[0], tuple)


def test_from_dict_defaults_fields_saved_before_they_existed():
    assert Plan.from_dict({"capacities": [[4, 4]]}) == moe_plan(((4, 4),))


def test_from_dict_moves_older_top_level_moe_fields_into_its_part():
    old = {"capacities": [[4, 4]], "cached_routing": True, "parts": {"moe": {"chunks": [2]}}}
    plan = Plan.from_dict(old)
    assert capacities_of(plan) == ((4, 4),) and cached_routing_of(plan)
    assert plan.part("moe")["chunks"] == (2,)
    assert Plan.from_dict({"capacities": [], "cached_routing": False}) == Plan()


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(PlanError, match="token_buckets"):
        Plan.from_dict({"capacities": [], "token_buckets": [[0, 1]]})


@given(
    caps=st.lists(st.lists(st.integers(1, 512), min_size=1, max_size=6), max_size=4),
    cached=st.booleans(),
    micro=st.integers(1, 16),
    dtype=st.sampled_from(["float32", "bfloat16"]),
)
def test_round_trip_and_self_diff_property(caps, cached, micro, dtype):
    plan = moe_plan(caps, cached_routing=cached, microbatches=micro, dtype=dtype)
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan and hash(back) == hash(plan) and plan.diff(back) == {}


def test_an_impossible_context_is_refused():
    with pytest.raises(PlanError):
        PlanContext(batch_size=0)


def test_an_unknown_schedule_is_refused():
    ctx = PlanContext(batch_size=8, num_layers=2, pipeline_stages=2)
    for schedule in ("gpipe", "zb_h1"):
        Plan(stage_layers=(1, 1), schedule=schedule).validate(ctx)
    with pytest.raises(PlanError, match="schedule = 'chimera' is unknown: use one of"):
        Plan(stage_layers=(1, 1), schedule="chimera").validate(ctx)
