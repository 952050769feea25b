"""Layer freezing as a dynamism plugin: a frozen prefix that grows as layers converge.

Seed 000 §2.3 and §4.2.3: layers that have converged stop training; a frozen layer keeps its
forward but drops its weight gradient and update, and a frozen *prefix* drops its backward
altogether (`Plan.frozen_layers`, in both runtimes). Which layers (`freezing.metric`):

- ``"gradient"``: AutoFreeze's rule (`freezing_math.gradient_freeze_prefix`) on the per-layer
  gradient norms every step reports (`layer_grad_norm`);
- ``"plasticity"``: Egeria's rule (`freezing_math.plasticity_freeze_prefix`) on how far each
  layer's output on a fixed probe batch moved from a reference snapshot refreshed every
  ``freezing.reference_every`` steps, measured every ``freezing.every`` steps between two steps
  (`Plugin.measure`, `dynjax.dynamism.plasticity`): one probe forward per measurement.

A decision is a Plan change, compiled in the background by the Controller; in a pipeline the
balancers then see the frozen layers' smaller cost.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, Literal

import ml_collections
import numpy as np

from dynjax.dynamism import freezing_math as fm
from dynjax.dynamism.base import Plugin
from dynjax.dynamism.plasticity import PlasticityProbe
from dynjax.errors import ConfigError
from dynjax.model.facts import ModelFacts
from dynjax.recompile import History, Plan, Policy, Proposal

if TYPE_CHECKING:
    from dynjax.runlog.plots import PlotEntry

GRAD_NORMS = "layer_grad_norm"  # [L] per step, NaN for frozen layers
PLASTICITY = "freezing/plasticity"  # [L] at measured steps, NaN for the frozen prefix
# A layer's backward costs about twice its forward (seed 000 §2.3): a frozen-prefix layer runs
# its forward only, a frozen layer behind a trainable one also passes its input gradient back.
FROZEN_PREFIX_COST, FROZEN_COST = 1 / 3, 2 / 3
HISTORY_STEPS = 1000  # the Controller's history: what a policy's intervals must fit in


@dataclasses.dataclass(frozen=True)
class FreezingSettings:
    """The `freezing` section (its keys' defaults and meanings: `FreezingPlugin.config`)."""

    enabled: bool
    metric: Literal[fm.METRICS]
    every: int
    percentile: float
    reference_every: int
    threshold: float
    patience: int
    probe_size: int
    start_step: int
    max_fraction: float


class FreezingPlugin(Plugin):
    name = "freezing"
    logged_metrics = (PLASTICITY,)
    Settings = FreezingSettings
    settings: FreezingSettings

    _probe: PlasticityProbe | None = None  # this run's, made at its first measurement

    @classmethod
    def config(cls) -> ml_collections.ConfigDict:
        c = ml_collections.ConfigDict()
        c.enabled = False
        c.metric = "gradient"  # "gradient" (AutoFreeze) | "plasticity" (Egeria)
        # gradient: steps per interval of averaged gradient norms; plasticity: steps between
        # probe measurements
        c.every = 50
        c.percentile = 50.0  # gradient: freeze up to the first layer changing at or above this
        c.reference_every = 200  # plasticity: steps between refreshes of the reference
        c.threshold = 0.05  # plasticity: a layer whose output moved less than this converged...
        c.patience = 2  # ...in each of this many newest complete reference periods
        c.probe_size = 2  # plasticity: sequences in the fixed probe batch
        c.start_step = 100  # never freeze before this step
        c.max_fraction = 0.5  # at most this fraction of the layers
        return c

    @classmethod
    def validate(cls, f: FreezingSettings, facts: ModelFacts) -> None:
        if not f.enabled:
            return
        try:
            fm.check_settings(
                metric=f.metric,
                every=f.every,
                percentile=f.percentile,
                start_step=f.start_step,
                max_fraction=f.max_fraction,
                reference_every=f.reference_every,
                threshold=f.threshold,
                patience=f.patience,
            )
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if f.metric == "gradient" and 2 * f.every > HISTORY_STEPS:
            raise ConfigError(
                f"freezing.every={f.every} must be <= {HISTORY_STEPS // 2}: the policy compares "
                f"two intervals of the Controller's last {HISTORY_STEPS} steps"
            )
        if f.metric == "plasticity":
            cls._check_plasticity(f, facts.batch_size)
        if fm.max_frozen_layers(facts.num_layers, f.max_fraction) < 1:
            raise ConfigError(
                f"freezing.max_fraction={f.max_fraction} of model.num_layers="
                f"{facts.num_layers} allows no frozen layer: raise freezing.max_fraction"
            )

    @staticmethod
    def _check_plasticity(f: FreezingSettings, batch_size: int) -> None:
        if (f.patience + 1) * f.reference_every > HISTORY_STEPS:
            raise ConfigError(
                f"freezing.patience={f.patience} + 1 periods of freezing.reference_every="
                f"{f.reference_every} steps must fit in the Controller's last {HISTORY_STEPS} "
                "steps: lower one of them"
            )
        if f.every >= f.reference_every:
            raise ConfigError(
                f"freezing.every={f.every} must be < freezing.reference_every="
                f"{f.reference_every}: a reference period needs a measurement after its refresh"
            )
        if not isinstance(f.probe_size, int) or not 1 <= f.probe_size <= batch_size:
            raise ConfigError(
                f"freezing.probe_size={f.probe_size!r} must be an integer in [1, "
                f"train.batch_size={batch_size}]"
            )

    @classmethod
    def resumed_plan(cls, saved: Plan, implied: Plan, changed: Collection[str]) -> Plan:
        """What froze stays frozen (its optimizer state was kept, not updated), unless freezing
        was switched off."""
        if "freezing.enabled" in changed and not implied.frozen_layers and saved.frozen_layers:
            return saved.replace(frozen_layers=())
        return saved

    @classmethod
    def report_plots(cls) -> Sequence[PlotEntry]:
        """The frozen prefix of each Plan, and what freezing measured (`PLASTICITY`)."""
        from dynjax.runlog import plots  # the report's, never a run's import
        from dynjax.runlog.arrays import frozen_layers

        return (
            (
                "freezing",
                "Layer freezing",
                plots.on_axes(plots.plot_freezing, 4.0),
                lambda r: (
                    None
                    if frozen_layers(r) is not None
                    else "no Plan froze a layer (no `frozen_layers` in the compile/recompile "
                    "events)"
                ),
                "The frozen prefix (layers 0..n-1 frozen: no backward) of each Plan over time.",
            ),
            plots.scheme_metrics_plot(
                cls.name,
                "freezing_metrics",
                "Layer freezing: measurements",
                "Each `freezing/...` metric over time, e.g. each layer's plasticity (one line per "
                "layer).",
            ),
        )

    def policies(self) -> list[Policy]:
        f = self.settings
        limits = dict(
            num_layers=self.facts.num_layers, start_step=f.start_step, max_fraction=f.max_fraction
        )
        if f.metric == "plasticity":
            return [
                PlasticityFreezing(
                    reference_every=f.reference_every,
                    threshold=f.threshold,
                    patience=f.patience,
                    **limits,
                )
            ]
        return [GradientFreezing(every=f.every, percentile=f.percentile, **limits)]

    def measure(
        self, step: int, states: Sequence[dict[str, Any]], plan: Plan
    ) -> dict[str, Any]:
        """Egeria's measurements: refresh the reference at multiples of
        ``freezing.reference_every``; every ``freezing.every`` steps in between, each layer's
        plasticity (NaN for the frozen prefix, whose outputs cannot move). A resumed run has no
        reference until its first refresh."""
        f = self.settings
        if f.metric != "plasticity" or step % f.every and step % f.reference_every:
            return {}
        probe, rounds = self._run_probe(), self.link.rounds("plasticity")
        if step % f.reference_every == 0:
            probe.refresh(states, rounds)
            return {}
        if probe.reference is None:
            return {}
        values = probe.plasticity(states, rounds)
        values[: fm.prefix_length(plan.frozen_layers)] = np.nan
        return {PLASTICITY: values}

    def _run_probe(self) -> PlasticityProbe:
        """This run's probe: the first ``freezing.probe_size`` sequences of its first training
        batch (fixed by the data order's seed)."""
        if self._probe is None:
            tokens = self.link.first_inputs()[: self.settings.probe_size]
            self._probe = PlasticityProbe(self.facts.model, tokens)
        return self._probe

    def layer_costs(self, plan: Plan) -> Sequence[float] | None:
        prefix = fm.prefix_length(plan.frozen_layers)
        frozen = set(plan.frozen_layers)
        return [
            FROZEN_PREFIX_COST if i < prefix else FROZEN_COST if i in frozen else 1.0
            for i in range(self.facts.num_layers)
        ]


def _freeze(plan: Plan, prefix: int, new: int, **record: Any) -> Proposal:
    """The Proposal that grows the frozen prefix from ``prefix`` to ``new`` layers."""
    frozen = tuple(sorted(set(plan.frozen_layers) | set(fm.frozen_layers(new))))
    return Proposal(
        plan.replace(frozen_layers=frozen),
        f"layers {prefix}..{new - 1} converged",
        records=({"event": "freeze", "frozen_prefix": [prefix, new], **record},),
    )


def _finite_or_none(values: np.ndarray | None) -> list[float | None] | None:
    return None if values is None else [float(v) if math.isfinite(v) else None for v in values]


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
        changes = fm.interval_changes(steps, norms, every=self.every)
        return _freeze(plan, prefix, new, relative_changes=_finite_or_none(changes))


class PlasticityFreezing:
    """Egeria's rule as a policy: grow the frozen prefix over the layers whose plasticity stayed
    below `threshold` in each of the `patience` newest complete reference periods
    (`freezing_math.plasticity_freeze_prefix`). Pure: the same History gives the same Plan."""

    name = "freezing"

    def __init__(
        self, *, num_layers: int, reference_every: int, threshold: float, patience: int,
        start_step: int, max_fraction: float,
    ) -> None:
        self.reference_every, self.threshold, self.patience = reference_every, threshold, patience
        self.start_step = start_step
        self.max_layers = fm.max_frozen_layers(num_layers, max_fraction)

    def propose(self, history: History, plan: Plan) -> Proposal | None:
        steps, plasticity = fm.series(history.entries, PLASTICITY)
        prefix = fm.prefix_length(plan.frozen_layers)
        if len(steps) == 0:
            return None
        window = dict(reference_every=self.reference_every, patience=self.patience)
        new = fm.plasticity_freeze_prefix(
            steps,
            plasticity,
            prefix,
            threshold=self.threshold,
            start_step=self.start_step,
            max_layers=self.max_layers,
            **window,
        )
        if new <= prefix:
            return None
        peak = fm.window_plasticity(steps, plasticity, **window)
        return _freeze(plan, prefix, new, plasticity=_finite_or_none(peak))

