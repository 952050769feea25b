"""Plan: hashable identity, diff, validation with clear errors, JSON round trip."""

import doctest
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynjax.recompile import plan as plan_module
from dynjax.recompile.plan import (
    Plan,
    PlanContext,
    PlanError,
    capacity_for_factor,
    static_capacities,
)

CTX = PlanContext(num_moe_layers=2, num_experts=4, top_k=2, group_tokens=64, batch_size=8)


def test_docstring_examples():
    assert doctest.testmod(plan_module).failed == 0


def test_equal_plans_hash_equal_whatever_the_container():
    a = Plan(capacities=((32, 32, 40, 24), (32,) * 4), microbatches=2)
    b = Plan(capacities=[np.array([32, 32, 40, 24]), [32] * 4], microbatches=2)
    assert a == b and hash(a) == hash(b)
    assert {a: "exe"}[b] == "exe"
    assert all(type(c) is int for layer in b.capacities for c in layer)
    assert a != a.replace(cached_routing=True)


def test_diff_lists_only_changed_experts():
    a = Plan(capacities=static_capacities(CTX, 1.0))
    b = a.replace(capacities=((32, 48, 32, 32), (32, 32, 32, 16)), dtype="bfloat16")
    diff = a.diff(b)
    assert diff == {
        "capacities[0][1]": (32, 48),
        "capacities[1][3]": (32, 16),
        "dtype": ("float32", "bfloat16"),
    }
    json.dumps(diff)
    assert a.format_diff(b).splitlines() == [
        "capacities[0][1]: 32 -> 48",
        "capacities[1][3]: 32 -> 16",
        "dtype: float32 -> bfloat16",
    ]
    assert a.diff(a) == {} and a.format_diff(a) == "(no change)"


def test_diff_of_capacities_with_another_shape_shows_both_whole():
    a = Plan(capacities=((4, 4),))
    b = Plan(capacities=((4, 4), (8, 8)))
    assert a.diff(b) == {"capacities": ([[4, 4]], [[4, 4], [8, 8]])}


def test_str_shows_every_field_and_layer():
    text = str(Plan(capacities=((1, 2), (3, 4)), microbatches=2))
    assert "layer 0: 1 2" in text and "layer 1: 3 4" in text
    assert "microbatches: 2" in text and "cached_routing: False" in text


def test_valid_plan_passes():
    Plan(capacities=static_capacities(CTX, 1.25), microbatches=4, dtype="bfloat16").validate(CTX)


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
    plan = Plan(capacities=static_capacities(CTX, 1.0)).replace(**changes)
    with pytest.raises(PlanError) as err:
        plan.validate(CTX)
    assert isinstance(err.value, ValueError)
    for word in words:
        assert word in str(err.value)


def test_validation_reports_every_problem_at_once():
    plan = Plan(capacities=((0, 32, 32, 32), (32,) * 4), microbatches=3, dtype="int8")
    with pytest.raises(PlanError) as err:
        plan.validate(CTX)
    assert len(str(err.value).splitlines()) == 4  # header + three problems


def test_json_round_trip_restores_an_equal_hashable_plan():
    plan = Plan(capacities=((8, 16), (24, 8)), cached_routing=True, microbatches=2)
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan and hash(back) == hash(plan)
    assert isinstance(back.capacities[0], tuple)


def test_from_dict_defaults_fields_saved_before_they_existed():
    assert Plan.from_dict({"capacities": [[4, 4]]}) == Plan(capacities=((4, 4),))


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
    plan = Plan(capacities=caps, cached_routing=cached, microbatches=micro, dtype=dtype)
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan and hash(back) == hash(plan) and plan.diff(back) == {}


def test_static_capacities_follow_eq4_and_clip():
    # C = ceil(factor * group_tokens * top_k / E) = ceil(1.1 * 64 * 2 / 4) = ceil(35.2)
    assert static_capacities(CTX, 1.1) == ((36,) * 4,) * 2
    assert capacity_for_factor(CTX, 1.0) == 32
    assert capacity_for_factor(CTX, 100.0) == 64  # never more than a group holds
    assert capacity_for_factor(CTX, 1e-6) == 1  # never below one slot
    ctx = PlanContext(num_moe_layers=1, num_experts=1, top_k=1, group_tokens=30, batch_size=1)
    assert capacity_for_factor(ctx, 0.1) == 3  # 0.1 * 30 is 3.0000000000000004 in floats


def test_an_impossible_context_is_refused():
    with pytest.raises(PlanError):
        PlanContext(num_moe_layers=1, num_experts=2, top_k=4, group_tokens=8, batch_size=1)
    with pytest.raises(PlanError):
        PlanContext(num_moe_layers=1, num_experts=0, top_k=1, group_tokens=8, batch_size=1)
