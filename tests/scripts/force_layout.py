"""``python tests/scripts/force_layout.py LAYOUT AFTER ARGS...``: the training CLI with one user
policy that asks for the pipeline layout LAYOUT (layers per stage, e.g. ``2,2``) once it has seen
the metrics of step AFTER: a forced rebalance, for the multi-process migration test."""

import functools
import sys

from dynjax import train
from dynjax.recompile import Proposal

LAYOUT = tuple(int(n) for n in sys.argv[1].split(","))
AFTER = int(sys.argv[2])


class ForceLayout:
    name = "force_layout"

    def propose(self, history, plan):
        seen = history.latest_step
        if seen is not None and seen >= AFTER and plan.stage_layers != LAYOUT:
            return Proposal(plan.replace(stage_layers=LAYOUT), "forced by the test")
        return None


train.train = functools.partial(train.train, policies=[ForceLayout()])
sys.exit(train.main(sys.argv[3:]))
