"""What a run's plugins know of its model and batch: read once from the config at the edge
(`dynjax.config.model_facts`) and handed down frozen, so a plugin never reads the config."""

from __future__ import annotations

import dataclasses

from dynjax.model.gpt import GPTConfig


def moe_layer_indices(num_layers: int, every: int) -> tuple[int, ...]:
    """Indices of the layers that hold an MoE block: every ``every``-th (none for 0)."""
    return tuple(i for i in range(num_layers) if every > 0 and (i + 1) % every == 0)


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """The model (with every enabled scheme's block parts) and the batch one step trains on.

    ``microbatches`` is `train.microbatches` resolved; ``data_shards``, ``expert_shards`` are the
    mesh's data and expert axes; ``pipeline_stages`` the stages of the run's mesh (0: none)."""

    model: GPTConfig
    seq_len: int
    batch_size: int
    microbatches: int
    data_shards: int
    expert_shards: int
    pipeline_stages: int

    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    @property
    def batch_shards(self) -> int:
        """Devices one stage splits a microbatch over."""
        return self.data_shards * self.expert_shards
