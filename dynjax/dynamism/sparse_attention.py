"""Hash-based dynamic sparse attention as a dynamism plugin (Pagliardini et al. 2023; seed 000
§2.4, §4.2.4).

Every layer attends within angular-LSH buckets (`dynjax.model.hashed_attention`): its XLA path
computes a static budget of key blocks per query block. The Plan holds each layer's budget
(``parts.sparse_attention.budgets``, bucketed by `bucket_blocks`); a fresh run starts at every
causal block (exact), and `AttentionBudget` sizes each layer's budget from the needed-block
counts the steps report, with headroom and hysteresis, so that at most
``sparse_attention.max_overflow`` of the needed blocks fall beyond it. A change is a Plan change,
compiled in the background; only stages whose layers' budgets changed recompile. A layer's cost
for the balancer is the fraction of (query block, key block) pairs its budget computes (seed 000
§2.4).

``sparse_attention.kernel="pallas"`` runs the GPU path instead: the Pallas block-sparse flash
attention kernel computes every needed block (no budget, no policy, no recompiles), and a layer's
cost is the fraction of pairs the step's blocks needed, read from its metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import ml_collections
import numpy as np

from dynjax.dynamism.base import Plugin
from dynjax.dynamism.histograms import overflow_at, resized_budget
from dynjax.errors import ConfigError
from dynjax.model.facts import ModelFacts
from dynjax.model.hashed_attention import (
    HOOKS,
    NAME,
    NEEDED_HIST,
    OVERFLOW,
    PAIR_FRACTION,
    HashedAttention,
)
from dynjax.model.sparse_linear import bucket_blocks
from dynjax.recompile import History, Proposal
from pallas_kernels import backend

if TYPE_CHECKING:
    from dynjax.recompile import Plan, Policy


@dataclasses.dataclass(frozen=True)
class AttentionSettings:
    """The `sparse_attention` section (its keys' defaults and meanings:
    `SparseAttention.config`)."""

    enabled: bool
    buckets: int
    block: int
    max_overflow: float
    window: int
    headroom: float
    hysteresis: float
    seed: int
    kernel: Literal["xla", "pallas"]


def num_blocks(settings: AttentionSettings, seq_len: int) -> int:
    """Key blocks of a sequence."""
    return seq_len // settings.block


def bucket_budget(blocks: int, num: int) -> int:
    """A static budget covering ``blocks`` key blocks out of ``num`` (at least one)."""
    return max(1, bucket_blocks(min(max(blocks, 0), num), num))


class SparseAttention(Plugin):
    name = NAME
    hook_sets = (HOOKS,)  # its metrics' reductions: the attention reads its record itself
    logged_metrics = (OVERFLOW, PAIR_FRACTION)
    Settings = AttentionSettings
    settings: AttentionSettings

    @classmethod
    def config(cls) -> ml_collections.ConfigDict:
        c = ml_collections.ConfigDict()
        c.enabled = False
        c.buckets = 8  # LSH buckets per head (even: bucket = argmax([xR, -xR]))
        c.block = 64  # tokens per block of the sorted order; must divide data.seq_len
        c.max_overflow = 0.01  # the policy keeps dropped needed blocks at most this fraction
        c.window = 10  # steps of needed-block counts the policy reads
        c.headroom = 0.25  # budget = (1 + headroom) x the smallest that meets max_overflow
        c.hysteresis = 0.25  # shrink only below (1 - hysteresis) x the current budget
        c.seed = 0  # the layers' fixed LSH rotations
        # "xla": the budgeted XLA path (any backend); "pallas": the Pallas kernel, every needed
        # block (compiled on GPU, interpreted, slowly, elsewhere)
        c.kernel = "xla"
        return c

    @classmethod
    def validate(cls, a: AttentionSettings, facts: ModelFacts) -> None:
        if not a.enabled:
            return
        seq_len = facts.seq_len
        if a.buckets < 2 or a.buckets % 2:
            raise ConfigError(
                f"sparse_attention.buckets={a.buckets} must be even and >= 2 (argmax of [xR, -xR])"
            )
        if a.block < 1 or seq_len % a.block:
            raise ConfigError(
                f"sparse_attention.block={a.block} must divide data.seq_len={seq_len}"
            )
        if seq_len // a.block < 2:
            raise ConfigError(
                f"sparse_attention.block={a.block} leaves one block of data.seq_len="
                f"{seq_len}: nothing to skip; use a block of at most half the sequence"
            )
        if a.kernel == "pallas":
            # The same config must lower on a GPU: Triton tiles are powers of two >= 16.
            head_dim = facts.model.d_model // facts.model.num_heads
            for key, size in (("sparse_attention.block", a.block), ("model.d_model", head_dim)):
                try:
                    backend.check_tile(key, size, interpret=False)
                except ValueError:
                    raise ConfigError(
                        f"{key}: sparse_attention.kernel='pallas' needs a block and a head "
                        f"dimension (model.d_model / model.num_heads) that are powers of two "
                        f">= 16 (Triton tiles); got block={a.block}, head_dim={head_dim}; "
                        "change them or use sparse_attention.kernel='xla'"
                    ) from None
        if not 0 <= a.max_overflow < 1:
            raise ConfigError(f"sparse_attention.max_overflow={a.max_overflow} must be in [0, 1)")
        if a.window < 1:
            raise ConfigError(f"sparse_attention.window={a.window} must be >= 1")
        if a.headroom < 0 or not 0 <= a.hysteresis < 1:
            raise ConfigError(
                f"sparse_attention.headroom={a.headroom} must be >= 0 and "
                f"sparse_attention.hysteresis={a.hysteresis} in [0, 1)"
            )

    def claims(self) -> dict[str, range]:
        """Every layer's attention: its blocks hold whole runs of the sequence's tokens."""
        return {"attention": range(self.facts.num_layers)}

    @property
    def num_blocks(self) -> int:
        return num_blocks(self.settings, self.facts.seq_len)

    def initial_plan(self, plan: Plan) -> Plan:
        return plan.with_part(NAME, budgets=(self.num_blocks,) * self.facts.num_layers)

    def layer_options(self, plan: Plan) -> Sequence[Any] | None:
        a = self.settings
        return tuple(
            HashedAttention(a.buckets, a.block, int(budget), a.seed, layer, a.kernel)
            for layer, budget in enumerate(plan.part(NAME)["budgets"])
        )

    def layer_costs(self, plan: Plan) -> Sequence[float] | None:
        """Seed 000 §2.4: the fraction of (query block, key block) pairs computed. The dense
        layer it is relative to computes every pair (XLA's causal attention masks the upper
        triangle but computes it), so a budget of b of the nb key blocks costs b / nb. The
        Pallas path has no budget: its cost comes from the metrics (`metric_costs`)."""
        if self.settings.kernel == "pallas":
            return None
        nb = self.num_blocks
        return [b / nb for b in plan.part(NAME)["budgets"]]

    def metric_costs(self, metrics: Mapping[str, Any]) -> Sequence[float] | None:
        """The Pallas path computes every needed block: a layer costs its needed pairs over all
        nb x nb pairs (the budget path's unit), i.e. ``pair_fraction`` x (nb + 1) / (2 nb)."""
        fraction = metrics.get(PAIR_FRACTION)
        if self.settings.kernel != "pallas" or fraction is None:
            return None
        nb = self.num_blocks
        return [float(f) * (nb + 1) / (2 * nb) for f in np.asarray(fraction)]

    def policies(self) -> list[Policy]:
        a = self.settings
        if a.kernel == "pallas":  # no budget to size
            return []
        return [AttentionBudget(num_blocks=self.num_blocks, max_overflow=a.max_overflow,
                                window=a.window, headroom=a.headroom, hysteresis=a.hysteresis)]


class AttentionBudget:
    """Each layer's key-block budget from the needed-block histograms of the newest ``window``
    steps: the smallest budget whose overflow is at most ``max_overflow``, times
    ``1 + headroom``, bucketed. Grows at once when the current budget overflows; shrinks only
    below ``(1 - hysteresis)`` x the current one, so noise does not recompile. Pure."""

    name = NAME

    def __init__(self, *, num_blocks: int, max_overflow: float, window: int, headroom: float,
                 hysteresis: float) -> None:
        self.num_blocks, self.max_overflow, self.window = num_blocks, max_overflow, window
        self.headroom, self.hysteresis = headroom, hysteresis

    def propose(self, history: History, plan: Plan) -> Proposal | None:
        hists = history.values(NEEDED_HIST, self.window)
        if len(hists) < self.window:
            return None
        hist = np.sum([np.asarray(h, dtype=float) for h in hists], axis=0)  # [L, nb + 1]
        have = tuple(plan.part(NAME)["budgets"])
        want = [
            resized_budget(layer_hist, budget, max_overflow=self.max_overflow,
                           headroom=self.headroom, hysteresis=self.hysteresis,
                           bucket=lambda n: bucket_budget(n, self.num_blocks))
            for layer_hist, budget in zip(hist, have, strict=True)
        ]
        want = tuple(want)
        if want == have:
            return None
        overflow = [round(overflow_at(h, b), 4) for h, b in zip(hist, have, strict=True)]
        record = {"event": "attention_budget", "old": list(have), "new": list(want),
                  "overflow": overflow, "window": self.window}
        return Proposal(
            plan.with_part(NAME, budgets=want),
            f"attention budgets {list(have)} -> {list(want)} of {self.num_blocks} key blocks",
            records=(record,),
        )

