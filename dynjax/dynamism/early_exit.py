"""Early exit as a dynamism plugin (CALM, Schuster et al. 2022; seed 000 §2.5, §4.2.5).

Exit points sit after layer ``early_exit.first`` and every ``early_exit.every`` layers after it
(never after the last layer: that is the model's own output). `dynjax.model.early_exit` runs the
layers from the first exit point on: confident tokens exit, later layers compute only a bucket
of each sequence's remaining tokens. The Plan holds each layer's bucket
(``parts.early_exit.tokens``, bucketed by `bucket_tokens`) and whether tokens exit yet
(``active``, from ``early_exit.start_step``: before it the exits only learn). `ExitBuckets`
turns exits on at the start step and sizes every bucket from the remaining-token counts the
steps report, with headroom and hysteresis, so that at most ``early_exit.max_forced`` of the
remaining tokens are forced out; a change compiles in the background. A layer's cost for the
balancer is the share of tokens its bucket computes (seed 000 §2.5). On a pipeline, stages before
the last get the readout, the targets and the remaining tokens from the runtime
(`dynjax.parallel.stage_programs`), so exit points may sit in any stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import ml_collections
import numpy as np

from dynjax.dynamism.base import Plugin
from dynjax.dynamism.histograms import resized_budget
from dynjax.errors import ConfigError
from dynjax.model.early_exit import (
    CONFIDENCE,
    CONFIDENCES,
    EXIT_CE,
    EXITED,
    FORCED,
    HOOKS,
    NAME,
    NEEDED_HIST,
    PROCESSED,
    ExitLayer,
)
from dynjax.model.facts import ModelFacts
from dynjax.recompile import History, Proposal

if TYPE_CHECKING:
    from dynjax.recompile import Plan, Policy


@dataclasses.dataclass(frozen=True)
class ExitSettings:
    """The `early_exit` section (its keys' defaults and meanings: `EarlyExit.config`)."""

    enabled: bool
    first: int
    every: int
    confidence: Literal[CONFIDENCES]
    threshold: float
    start_step: int
    loss_weights: tuple[float, ...]
    max_forced: float
    window: int
    headroom: float
    hysteresis: float


def exit_layers(settings: ExitSettings, num_layers: int) -> tuple[int, ...]:
    """Indices of the layers an exit point follows."""
    return tuple(range(settings.first - 1, num_layers - 1, settings.every))


def exit_weights(settings: ExitSettings, num_layers: int) -> tuple[float, ...]:
    """Each exit point's loss weight: ``early_exit.loss_weights``, or by default CALM's weights
    growing with depth, (layer + 1) / num_layers (the final readout's weight is 1)."""
    if settings.loss_weights:
        return tuple(float(w) for w in settings.loss_weights)
    return tuple((i + 1) / num_layers for i in exit_layers(settings, num_layers))


def bucket_tokens(count: int, seq_len: int) -> int:
    """A static bucket covering ``count`` tokens of a sequence: a multiple of 1/16 of it (at
    least one token). Finer than `bucket_blocks`' eighths: a bucket must hold the sequence with
    the most remaining tokens, so the saving is already smaller than the share that exits."""
    step = -(-seq_len // 16)
    return min(seq_len, max(1, -(-max(count, 0) // step) * step))


class EarlyExit(Plugin):
    name = NAME
    hook_sets = (HOOKS,)
    # The exit points decide what the loss trains (and where buckets start).
    fixed_on_resume = ("early_exit.enabled", "early_exit.first", "early_exit.every")
    logged_metrics = (PROCESSED, FORCED, EXITED, EXIT_CE, CONFIDENCE)
    Settings = ExitSettings
    settings: ExitSettings

    @classmethod
    def config(cls) -> ml_collections.ConfigDict:
        c = ml_collections.ConfigDict()
        c.enabled = False
        c.first = 2  # the first exit point follows this many layers
        c.every = 2  # then one every n layers (never after the last layer)
        c.confidence = "softmax_max"  # | "state" (cosine of the state before/after the layer)
        c.threshold = 0.9  # a token exits when its confidence reaches this
        c.start_step = 100  # tokens exit from this step on; before, the exits only learn
        c.loss_weights = ()  # one per exit point; (): (layer + 1) / num_layers (CALM §4)
        c.max_forced = 0.01  # the policy keeps tokens forced out by buckets at most this share
        c.window = 10  # steps of remaining-token counts the policy reads
        c.headroom = 0.05  # bucket = (1 + headroom) x the smallest that meets max_forced
        c.hysteresis = 0.1  # shrink only below (1 - hysteresis) x the current bucket
        return c

    @classmethod
    def validate(cls, e: ExitSettings, facts: ModelFacts) -> None:
        if not e.enabled:
            return
        layers = facts.num_layers
        if e.first < 1 or e.every < 1:
            raise ConfigError(f"early_exit.first={e.first} and early_exit.every={e.every} "
                              "must be >= 1")
        if e.first >= layers:
            raise ConfigError(
                f"early_exit.first={e.first} leaves no exit point before the last of "
                f"model.num_layers={layers} layers: set early_exit.first < {layers}"
            )
        if not 0 < e.threshold <= 1:
            raise ConfigError(f"early_exit.threshold={e.threshold} must be in (0, 1]")
        if e.start_step < 0:
            raise ConfigError(f"early_exit.start_step={e.start_step} must be >= 0")
        n = len(exit_layers(e, layers))
        weights = e.loss_weights
        if weights and (len(weights) != n or min(weights) < 0):
            raise ConfigError(
                f"early_exit.loss_weights={weights} needs {n} weights >= 0, one per exit point "
                f"(after layers {[i + 1 for i in exit_layers(e, layers)]}), or () for the default"
            )
        if not 0 <= e.max_forced < 1 or e.window < 1:
            raise ConfigError(f"early_exit.max_forced={e.max_forced} must be in [0, 1) and "
                              f"early_exit.window={e.window} >= 1")
        if e.headroom < 0 or not 0 <= e.hysteresis < 1:
            raise ConfigError(f"early_exit.headroom={e.headroom} must be >= 0 and "
                              f"early_exit.hysteresis={e.hysteresis} in [0, 1)")

    def claims(self) -> dict[str, range]:
        """Every layer's wrapper, token set and attention: buckets of remaining tokens."""
        every = range(self.facts.num_layers)
        return {"block_wrapper": every, "token_set": every, "attention": every}

    def initial_plan(self, plan: Plan) -> Plan:
        return plan.with_part(
            NAME,
            tokens=(self.facts.seq_len,) * self.facts.num_layers,
            active=self.settings.start_step == 0,
        )

    def layer_options(self, plan: Plan) -> Sequence[Any] | None:
        e, layers = self.settings, self.facts.num_layers
        part = plan.part(NAME)
        weights = dict(zip(exit_layers(e, layers), exit_weights(e, layers), strict=True))
        first = exit_layers(e, layers)[0]
        return tuple(
            None if i < first else ExitLayer(
                tokens=int(tokens),
                exit_weight=weights.get(i, 0.0),
                confidence=e.confidence,
                threshold=float(e.threshold),
                active=bool(part["active"]),
            )
            for i, tokens in enumerate(part["tokens"])
        )

    def layer_costs(self, plan: Plan) -> Sequence[float] | None:
        """Seed 000 §2.5: the share of the tokens a layer processes (its bucket)."""
        seq = self.facts.seq_len
        return [t / seq for t in plan.part(NAME)["tokens"]]

    def policies(self) -> list[Policy]:
        e, first = self.settings, exit_layers(self.settings, self.facts.num_layers)[0]
        return [ExitBuckets(seq_len=self.facts.seq_len, first=first,
                            start_step=e.start_step, max_forced=e.max_forced, window=e.window,
                            headroom=e.headroom, hysteresis=e.hysteresis)]


class ExitBuckets:
    """Turns exits on at ``start_step``, then sizes each layer's bucket from the per-sequence
    remaining-token histograms of the newest ``window`` steps: the smallest bucket forcing out
    at most ``max_forced`` of the remaining tokens, times ``1 + headroom``, bucketed. Grows at
    once when the current bucket forces out more; shrinks only below ``(1 - hysteresis)`` x the
    current one, so noise does not recompile. Pure."""

    name = NAME

    def __init__(self, *, seq_len: int, first: int, start_step: int, max_forced: float,
                 window: int, headroom: float, hysteresis: float) -> None:
        self.seq_len, self.first, self.start_step = seq_len, first, start_step
        self.max_forced, self.window = max_forced, window
        self.headroom, self.hysteresis = headroom, hysteresis

    def propose(self, history: History, plan: Plan) -> Proposal | None:
        part = plan.part(NAME)
        latest = history.latest_step
        if not part["active"]:
            if latest is None or latest < self.start_step:
                return None
            record = {"event": "early_exit_start", "metrics_step": latest}
            return Proposal(plan.with_part(NAME, active=True),
                            f"tokens exit from step {latest}", records=(record,))
        hists = history.values(NEEDED_HIST, self.window)
        if len(hists) < self.window:
            return None
        hist = np.sum([np.asarray(h, dtype=float) for h in hists], axis=0)  # [L - first, S + 1]
        have = tuple(part["tokens"])
        want = list(have)
        for j, layer_hist in enumerate(hist):  # hist[j]: sequences entering layer first + j
            layer = self.first + j
            if layer > self.first:  # the first exit point's layer computes every token
                want[layer] = resized_budget(
                    layer_hist, have[layer], max_overflow=self.max_forced,
                    headroom=self.headroom, hysteresis=self.hysteresis,
                    bucket=lambda n: bucket_tokens(n, self.seq_len))
        want = tuple(want)
        if want == have:
            return None
        record = {"event": "early_exit_buckets", "old": list(have), "new": list(want),
                  "window": self.window}
        return Proposal(
            plan.with_part(NAME, tokens=want),
            f"early-exit buckets {list(have)} -> {list(want)} of {self.seq_len} tokens",
            records=(record,),
        )

