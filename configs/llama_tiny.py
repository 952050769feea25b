"""Small Llama-family model on the embedded corpus (docs/models.md): RMSNorm, SwiGLU, grouped-query
attention (4 query heads sharing 2 key/value heads), RoPE at Llama 3's base, no biases; an MoE
block in every other layer with Mixtral-style SwiGLU experts, renormalised top-2 gates and a
shared expert. Five steps (``--config.train.steps=5``) took 45 s on two shared CPU cores.

``--config.moe.every=0 --config.moe.shared_expert_dim=0`` makes it dense;
``--config.moe.normalize_topk=False`` gives OLMoE's and Qwen1.5-MoE's gates.
"""

from dynjax.config import default_config


def get_config():
    c = default_config()
    c.train.steps = 300
    c.train.log_every = 20
    c.model.family = "llama"
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.mlp_dim = 344  # SwiGLU's three matrices at about the GELU MLP's 512-wide two
    c.model.norm_eps = 1e-5
    c.model.rope_base = 500_000.0
    c.moe.every = 2
    c.moe.num_experts = 8
    c.moe.top_k = 2
    c.moe.expert_mlp_dim = 128
    c.moe.shared_expert_dim = 128
    return c
