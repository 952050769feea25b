"""Mixture of depths as a dynamism plugin (Raposo et al. 2024; seed 000 §2.6, §4.2.6).

Every ``mod.every``-th block is routed (`dynjax.model.mod`): it computes ``mod.capacity`` of
each sequence's tokens, the rest take the residual path. The token count is static, part of the
layer's record, so the compiled block really is that much smaller. For the balancer a routed
layer costs its capacity (seed 000 §4.2.6: the skipped share is a "shadow" layer that takes no
time).

Evaluation routes causally by default (``mod.eval_routing="predictor"``, the paper's §3.5): the
``eval_loss`` a run logs is the loss sampling would see, not the top-k's, which looks ahead in
the sequence; ``"topk"`` evaluates with the training's routing instead, for comparison.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import ml_collections

from dynjax.dynamism.base import Plugin
from dynjax.errors import ConfigError
from dynjax.model.facts import ModelFacts, moe_layer_indices
from dynjax.model.hooks import BlockPart
from dynjax.model.mod import (
    ACCURACY,
    EVAL_ROUTINGS,
    HOOKS,
    NAME,
    PREDICTOR_LOSS,
    ROUTER_WEIGHT,
    RoutedBlock,
)

if TYPE_CHECKING:
    from dynjax.recompile import Plan


@dataclasses.dataclass(frozen=True)
class MoDSettings:
    """The `mod` section (its keys' defaults and meanings: `MixtureOfDepths.config`)."""

    enabled: bool
    every: int
    capacity: float
    predictor_hidden: int
    predictor_weight: float
    # "predictor" (causal, as sampling routes) or "topk" (the training's routing)
    eval_routing: Literal[EVAL_ROUTINGS]


def routed_layers(settings: MoDSettings, num_layers: int) -> tuple[int, ...]:
    """Indices of the routed layers: every ``mod.every``-th, as `moe.every` places MoE blocks."""
    return moe_layer_indices(num_layers, settings.every)


def routed_tokens(settings: MoDSettings, seq_len: int) -> int:
    """Tokens per sequence a routed block computes: ``mod.capacity`` of the sequence."""
    return max(1, round(settings.capacity * seq_len))


class MixtureOfDepths(Plugin):
    name = NAME
    hook_sets = (HOOKS,)
    # The routers and predictors are parameters of the routed layers.
    fixed_on_resume = ("mod.enabled", "mod.every", "mod.predictor_hidden")
    logged_metrics = (ACCURACY, PREDICTOR_LOSS, ROUTER_WEIGHT)
    Settings = MoDSettings
    settings: MoDSettings

    @classmethod
    def config(cls) -> ml_collections.ConfigDict:
        c = ml_collections.ConfigDict()
        c.enabled = False
        c.every = 2  # route every n-th block (the paper's best: every other block)
        c.capacity = 0.125  # fraction of each sequence's tokens a routed block computes
        c.predictor_hidden = 64  # hidden width of the causal predictor
        c.predictor_weight = 0.01  # weight of its binary cross entropy in the loss
        # How evaluation routes: "predictor" (causal, as sampling can) or "topk" (as training)
        c.eval_routing = "predictor"
        return c

    @classmethod
    def validate(cls, m: MoDSettings, facts: ModelFacts) -> None:
        if not m.enabled:
            return
        if m.every < 1:
            raise ConfigError(f"mod.every={m.every} must be >= 1 (1 = route every block)")
        if not 0 < m.capacity <= 1:
            raise ConfigError(f"mod.capacity={m.capacity} must be in (0, 1]: a fraction of tokens")
        if m.predictor_hidden < 1:
            raise ConfigError(f"mod.predictor_hidden={m.predictor_hidden} must be >= 1")
        if m.predictor_weight < 0:
            raise ConfigError(f"mod.predictor_weight={m.predictor_weight} must be >= 0")
        if not routed_layers(m, facts.num_layers):
            raise ConfigError(
                f"mod.every={m.every} routes no layer of model.num_layers="
                f"{facts.num_layers}: set mod.every <= model.num_layers"
            )

    @classmethod
    def block_parts(cls, m: MoDSettings, facts: ModelFacts) -> Sequence[BlockPart]:
        return tuple((i, NAME, m.predictor_hidden) for i in routed_layers(m, facts.num_layers))

    @property
    def routed(self) -> tuple[int, ...]:
        return routed_layers(self.settings, self.facts.num_layers)

    def claims(self) -> dict[str, tuple[int, ...]]:
        """A routed block's wrapper, token set (a dense block: every token of the layer) and
        attention (over the routed tokens only)."""
        return {"block_wrapper": self.routed, "token_set": self.routed, "attention": self.routed}

    def layer_options(self, plan: Plan) -> Sequence[Any] | None:
        m = self.settings
        tokens = routed_tokens(m, self.facts.seq_len)
        record = RoutedBlock(tokens, float(m.predictor_weight), m.eval_routing)
        routed = set(self.routed)
        return tuple(record if i in routed else None for i in range(self.facts.num_layers))

    def layer_costs(self, plan: Plan) -> Sequence[float] | None:
        fraction = routed_tokens(self.settings, self.facts.seq_len) / self.facts.seq_len
        routed = set(self.routed)
        return [fraction if i in routed else 1.0 for i in range(self.facts.num_layers)]
