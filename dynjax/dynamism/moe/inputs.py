"""What the MoE layers read at runtime rather than compile in (issue 12 §1), and the routing
cache that supplies and learns the cached routes.

On the ragged path each MoE layer's per-expert capacities are a step input, so Plans whose
capacities differ within the same bucketed totals share one executable (`compiled_part`); with
cached routing each batch carries its samples' cached routes (seed 001 §4.2). `MoEPlugin`'s
input hooks delegate here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from dynjax.dynamism.moe.caching import STABILITY, AssignmentCache
from dynjax.dynamism.moe.capacity import ragged_totals
from dynjax.dynamism.moe.part import NAME, MoEContext, cached_routing_of, capacities_of
from dynjax.dynamism.moe.settings import MoESettings
from dynjax.model.facts import ModelFacts
from dynjax.model.moe import ASSIGNMENTS
from dynjax.parallel.step_inputs import InputSignature
from dynjax.recompile import Plan


@dataclasses.dataclass(eq=False)
class MoEInputs:
    """The step and batch inputs of a run's MoE layers, and its routing cache."""

    settings: MoESettings
    facts: ModelFacts
    moe: MoEContext  # the model facts the capacities are sized against

    @property
    def ragged(self) -> bool:
        """Whether the MoE layers take the ragged path (capacities as a step input)."""
        return self.settings.dispatch == "ragged"

    def step_inputs(self, plan: Plan) -> dict[str, dict[int, np.ndarray]]:
        """On the ragged path, each MoE layer's per-expert capacities (``capacities``, int32
        [E]): an input of the step, so a change within the bucketed totals compiles nothing."""
        if not self.ragged:
            return {}
        rows = zip(self.facts.model.moe_layers, capacities_of(plan), strict=True)
        return {"capacities": {layer: np.asarray(caps, np.int32) for layer, caps in rows}}

    def input_fills(self) -> dict[str, float]:
        """A layer profiled alone keeps every pair, up to its static buffer: each expert's
        capacity is the group's tokens."""
        return {"capacities": self.facts.seq_len}

    def ragged_totals(self, plan: Plan) -> tuple[int, ...]:
        """The ragged path's static buffers of ``plan``, one per MoE layer; () on the static
        path (`capacity.ragged_totals`)."""
        if not self.ragged:
            return ()
        moe = self.settings
        return ragged_totals(
            self.moe,
            capacities_of(plan),
            self.facts.expert_shards,
            moe.capacity.bucket,
            expert_choice=moe.routing == "expert_choice",
        )

    def compiled_part(self, plan: Plan) -> dict[str, Any] | None:
        """On the ragged path the capacities count only through their bucketed totals, so
        Plans that differ in per-expert capacities within the same totals share one executable
        (issue 12 §1)."""
        if not self.ragged:
            return None
        return {**plan.part(NAME), "capacities": (), "ragged_totals": self.ragged_totals(plan)}

    def batch_input_signatures(self, plan: Plan) -> tuple[InputSignature, ...]:
        """With cached routing, each MoE layer's cached routes per token (``routes``, int32
        [S, k] a sample, -1 where none is cached)."""
        if not cached_routing_of(plan):
            return ()
        shape = (self.facts.seq_len, self.moe.top_k)
        return (InputSignature("routes", tuple(self.facts.model.moe_layers), shape, "int32"),)

    def batch_inputs(
        self, step: int, sample_ids: np.ndarray, plan: Plan
    ) -> dict[str, dict[int, np.ndarray]]:
        """With cached routing, the routes the cache holds for the batch's samples."""
        if not cached_routing_of(plan):
            return {}
        routes = self.cache.lookup(sample_ids)  # [MoE layers, B, S, k]
        return {"routes": dict(zip(self.facts.model.moe_layers, routes, strict=True))}

    @functools.cached_property
    def cache(self) -> AssignmentCache | None:
        """The routing cache (`moe.caching`): the router's assignments of the samples seen,
        from the steps' ``moe/assignments``; None without caching."""
        if not self.settings.caching.enabled:
            return None
        model = self.facts.model
        return AssignmentCache(
            len(model.moe_layers),
            self.facts.seq_len,
            model.top_k,
            model.num_experts,
            max_entries=self.settings.caching.max_entries,
        )

    def observe(
        self, step: int, metrics: dict[str, Any], sample_ids: np.ndarray, plan: Plan
    ) -> None:
        """With caching, the step's assignments go into the cache (and out of the metrics),
        and the routing stability they showed into the metrics (`STABILITY`; NaN when no
        sample repeated), which the caching policy reads."""
        if self.cache is not None:
            stability = self.cache.update(sample_ids, metrics.pop(ASSIGNMENTS))
            metrics[STABILITY] = np.nan if stability is None else stability
