"""Small MoE GPT: 8 experts, top-2, an MoE block in every other layer (layers 1 and 3)."""

from dynjax.config import default_config


def get_config():
    c = default_config()
    c.train.steps = 300
    c.train.log_every = 20
    c.moe.every = 2
    c.moe.num_experts = 8
    c.moe.top_k = 2
    c.moe.expert_mlp_dim = 256
    return c
