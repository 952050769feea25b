"""The `moe` section as frozen records: `MoESettings` and one nested record per nested section
(``moe.capacity``, ``moe.caching``, ``moe.granularity``, ``moe.bias_balancing``). Each key's
one default and meaning is `MoEPlugin.config`'s; the edge reads the section into these once and
checks them (`MoEPlugin.validate`), and the plugin and its policies read their attributes."""

from __future__ import annotations

import dataclasses
from typing import Literal

from dynjax.model.moe import REUSE, ROUTINGS


@dataclasses.dataclass(frozen=True)
class BiasBalancingSettings:
    """``moe.bias_balancing``: auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2)."""

    enabled: bool
    rate: float


@dataclasses.dataclass(frozen=True)
class CapacitySettings:
    """``moe.capacity``: the static factor, and the dynamic policy's (seed 001 §4.1)."""

    factor: float
    policy: Literal["static", "dynamic"]
    target_drop_rate: float
    min_factor: float
    max_factor: float
    window: int
    headroom: float
    bucket: float
    hysteresis: float


@dataclasses.dataclass(frozen=True)
class CachingSettings:
    """``moe.caching``: sample-assignment caching (seed 001 §4.2)."""

    enabled: bool
    on_threshold: float
    off_threshold: float
    warmup_steps: int
    window: int
    max_entries: int


@dataclasses.dataclass(frozen=True)
class GranularitySettings:
    """``moe.granularity``: MPipeMoE's adaptive partitions (seed 002 Alg. 1)."""

    enabled: bool
    max_chunks: int
    trials: int
    warmup: int


@dataclasses.dataclass(frozen=True)
class MoESettings:
    """The `moe` section."""

    num_experts: int
    top_k: int
    every: int
    expert_mlp_dim: int
    aux_loss_weight: float
    z_loss_weight: float
    dispatch: Literal["static", "ragged"]
    routing: Literal[ROUTINGS]
    normalize_topk: bool
    shared_expert_dim: int
    shared_expert_gate: bool
    bias_balancing: BiasBalancingSettings
    capacity: CapacitySettings
    caching: CachingSettings
    chunks: int
    memory_reuse: Literal[(*REUSE, "auto")]
    granularity: GranularitySettings
