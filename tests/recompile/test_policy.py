"""History helpers and the normalisation of a policy's answer."""

import math

import pytest

from dynjax.recompile.plan import Plan
from dynjax.recompile.policy import History, Proposal, as_proposal


def test_history_windows_by_key():
    history = History.of(
        [(3, {"loss": 1.0}), (4, {"loss": 2.0, "s": 0.5}), (5, {"s": math.nan}), (6, {"s": 0.7})]
    )
    assert len(history) == 4 and history.latest_step == 6
    assert [s for s, _ in history.window(2)] == [5, 6]
    assert history.values("loss", 5) == [1.0, 2.0]
    assert history.values("s", 2) == [history.entries[2][1]["s"], 0.7]
    assert history.finite("s", 3) == [0.5, 0.7]
    assert history.window(0) == () and History().latest_step is None


class Named:
    name = "named"


def test_answers_are_normalised_to_proposals():
    plan = Plan(microbatches=2)
    assert as_proposal(Named(), None) is None
    assert as_proposal(Named(), plan) == Proposal(plan, "")
    assert as_proposal(Named(), Proposal(plan, "why")).reason == "why"
    with pytest.raises(TypeError, match="named"):
        as_proposal(Named(), {"microbatches": 2})
