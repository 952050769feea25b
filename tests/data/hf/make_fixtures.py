"""Reference logits of tiny random Hugging Face models, made once with `transformers` (PyTorch).

dynjax never imports PyTorch: this script runs in a separate environment with `transformers` and
`torch`, writes each architecture's `config.json`, `model.safetensors`, a fixed batch of token ids
and the float32 logits `transformers` computes for it, plus the versions that made them
(`versions.json`). tests/hf/test_logits.py reads each directory's weights into dynjax and compares
its logits with these. Mistral's weights equal Llama's (same seed and shapes); its config differs.

    python tests/data/hf/make_fixtures.py tests/data/hf
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

BASE = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
)
MOE = dict(num_experts_per_tok=2)
MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(attention_bias=False, mlp_bias=False)),
    "llama_tied_rope_scaled": (
        LlamaConfig, LlamaForCausalLM,
        dict(tie_word_embeddings=True, num_key_value_heads=4, rope_theta=500000.0,
             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                               high_freq_factor=4.0, original_max_position_embeddings=16)),
    ),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=None)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict()),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=8)),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=4, **MOE)),
    "qwen2_moe": (
        Qwen2MoeConfig, Qwen2MoeForCausalLM,
        dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
             norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], **MOE),
    ),
    "qwen3_moe": (
        Qwen3MoeConfig, Qwen3MoeForCausalLM,
        dict(num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, head_dim=8,
             decoder_sparse_step=1, mlp_only_layers=[], **MOE),
    ),
    "olmoe": (OlmoeConfig, OlmoeForCausalLM, dict(num_experts=4, norm_topk_prob=False, **MOE)),
}


def main(out: Path) -> None:
    tokens = np.random.default_rng(0).integers(0, BASE["vocab_size"], (2, 12))
    for name, (config_cls, model_cls, extra) in MODELS.items():
        torch.manual_seed(0)
        config = config_cls(**{**BASE, **extra})
        model = model_cls(config).float().eval()
        with torch.no_grad():  # random weights of a visible scale (the default init is tiny)
            for p in model.parameters():
                p.normal_(0.0, 0.3 if p.ndim > 1 else 0.1)
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
        with torch.no_grad():
            logits = model(torch.tensor(tokens)).logits.float().numpy()
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(d, safe_serialization=True)
        np.save(d / "tokens.npy", tokens.astype(np.int32))
        np.save(d / "logits.npy", logits.astype(np.float32))
        (d / "versions.json").write_text(json.dumps(
            {"transformers": transformers.__version__, "torch": torch.__version__}) + "\n")
        print(name, logits.shape, float(np.abs(logits).mean()))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
