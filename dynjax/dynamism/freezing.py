"""Layer freezing as a dynamism plugin: a frozen prefix that grows as layers converge.

Seed 000 §2.3 and §4.2.3: layers that have converged stop training; a frozen layer keeps its
forward but drops its weight gradient and update, and a frozen *prefix* drops its backward
altogether (`Plan.frozen_layers`, in both runtimes). Which layers: AutoFreeze's gradient rule
(`dynjax.dynamism.freezing_math.gradient_freeze_prefix`) on the per-layer gradient norms every
step reports (`layer_grad_norm`). A decision is a Plan change, compiled in the background by
the Controller; in a pipeline the balancers then see the frozen layers' smaller cost.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import ml_collections

from dynjax.config import ConfigError
from dynjax.dynamism import freezing_math as fm
from dynjax.dynamism.base import Plugin, register
from dynjax.recompile import History, Plan, Policy, Proposal

if TYPE_CHECKING:
    from dynjax.experiment import Experiment

GRAD_NORMS = "layer_grad_norm"  # [L] per step, NaN for frozen layers
# A layer's backward costs about twice its forward (seed 000 §2.3): a frozen-prefix layer runs
# its forward only, a frozen layer behind a trainable one also passes its input gradient back.
FROZEN_PREFIX_COST, FROZEN_COST = 1 / 3, 2 / 3
MAX_EVERY = 500  # two intervals must fit the Controller's history of 1000 steps


class FreezingPlugin(Plugin):
    name = "freezing"

    def config(self) -> ml_collections.ConfigDict:
        c = ml_collections.ConfigDict()
        c.enabled = False
        c.every = 50  # steps per interval of averaged gradient norms (AutoFreeze)
        c.percentile = 50.0  # freeze up to the first layer changing at or above this percentile
        c.start_step = 100  # never freeze before this step
        c.max_fraction = 0.5  # at most this fraction of the layers
        return c

    def validate(self, cfg: ml_collections.ConfigDict) -> None:
        f = cfg.freezing
        if not f.enabled:
            return
        try:
            fm.check_settings(
                metric="gradient",
                every=f.every,
                percentile=f.percentile,
                start_step=f.start_step,
                max_fraction=f.max_fraction,
                reference_every=1,
                threshold=1.0,
                patience=1,
            )
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if f.every > MAX_EVERY:
            raise ConfigError(
                f"freezing.every={f.every} must be <= {MAX_EVERY}: the policy compares two "
                "intervals of the Controller's last 1000 steps"
            )
        if fm.max_frozen_layers(cfg.model.num_layers, f.max_fraction) < 1:
            raise ConfigError(
                f"freezing.max_fraction={f.max_fraction} of model.num_layers="
                f"{cfg.model.num_layers} allows no frozen layer: raise freezing.max_fraction"
            )

    def resumed_plan(self, saved: Plan, implied: Plan, changed: Collection[str]) -> Plan:
        """What froze stays frozen (its optimizer state was kept, not updated), unless freezing
        was switched off."""
        if "freezing.enabled" in changed and not implied.frozen_layers and saved.frozen_layers:
            return saved.replace(frozen_layers=())
        return saved

    def policies(self, cfg: ml_collections.ConfigDict, exp: Experiment) -> list[Policy]:
        f = cfg.freezing
        return [
            GradientFreezing(
                num_layers=cfg.model.num_layers,
                every=f.every,
                percentile=f.percentile,
                start_step=f.start_step,
                max_fraction=f.max_fraction,
            )
        ]

    def layer_costs(self, plan: Plan, exp: Experiment) -> Sequence[float] | None:
        prefix = fm.prefix_length(plan.frozen_layers)
        frozen = set(plan.frozen_layers)
        return [
            FROZEN_PREFIX_COST if i < prefix else FROZEN_COST if i in frozen else 1.0
            for i in range(exp.ctx.num_layers)
        ]


class GradientFreezing:
    """AutoFreeze's rule as a policy: grow the frozen prefix over the layers whose averaged
    gradient norm changed least between the last two intervals of `every` steps
    (`freezing_math.gradient_freeze_prefix`). Pure: the same History gives the same Plan."""

    name = "freezing"

    def __init__(
        self, *, num_layers: int, every: int, percentile: float, start_step: int,
        max_fraction: float,
    ) -> None:
        self.every, self.percentile, self.start_step = every, percentile, start_step
        self.max_layers = fm.max_frozen_layers(num_layers, max_fraction)

    def propose(self, history: History, plan: Plan) -> Proposal | None:
        steps, norms = fm.series(history.entries, GRAD_NORMS)
        prefix = fm.prefix_length(plan.frozen_layers)
        if len(steps) == 0:
            return None
        new = fm.gradient_freeze_prefix(
            steps,
            norms,
            prefix,
            every=self.every,
            percentile=self.percentile,
            start_step=self.start_step,
            max_layers=self.max_layers,
        )
        if new <= prefix:
            return None
        frozen = tuple(sorted(set(plan.frozen_layers) | set(fm.frozen_layers(new))))
        changes = fm.interval_changes(steps, norms, every=self.every)
        record = {
            "event": "freeze",
            "frozen_prefix": [prefix, new],
            "relative_changes": None if changes is None else [
                float(c) if math.isfinite(c) else None for c in changes
            ],
        }
        return Proposal(
            plan.replace(frozen_layers=frozen),
            f"layers {prefix}..{new - 1} converged",
            records=(record,),
        )


register(FreezingPlugin())
