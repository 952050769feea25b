"""Flax NNX model blocks: attention, MLP, MoE and the GPT that lists them."""

from dynjax.model.gpt import (
    GPT,
    Block,
    GPTConfig,
    ModelParts,
    abstract_gpt,
    abstract_params,
    fresh_params,
    lm_loss,
)
from dynjax.model.moe import (
    ExpertParallel,
    MoE,
    MoEStats,
    RaggedCapacities,
    SlotLayout,
    assign_slots,
    route,
)

__all__ = [
    "GPT",
    "Block",
    "GPTConfig",
    "ModelParts",
    "abstract_gpt",
    "abstract_params",
    "fresh_params",
    "lm_loss",
    "ExpertParallel",
    "MoE",
    "RaggedCapacities",
    "MoEStats",
    "SlotLayout",
    "assign_slots",
    "route",
]
