"""Small MoE GPT: 8 experts, top-2, an MoE block in every other layer."""

from dynjax.config import default_config


def get_config():
    c = default_config()
    c.train.steps = 300
    c.train.batch_size = 16
    c.train.log_every = 20
    c.train.eval_every = 100
    c.train.checkpoint_every = 100
    c.data.seq_len = 128
    c.model.num_layers = 4
    c.model.d_model = 128
    c.model.num_heads = 4
    c.model.mlp_dim = 512
    c.moe.every = 2
    c.moe.num_experts = 8
    c.moe.top_k = 2
    c.moe.expert_mlp_dim = 256
    c.moe.capacity.factor = 1.25
    c.moe.aux_loss_weight = 0.01
    return c
