"""Hugging Face model configs as dynjax config keys: each supported architecture exactly, any
other architecture or option refused by name (docs/models.md#hugging-face-checkpoints).

A config is mapped only when dynjax computes what `transformers` computes for it: the logits of
tiny random models of every architecture here match `transformers`' (tests/hf/test_logits.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dynjax.errors import ConfigError

# model_type -> (MoE config style or None for dense, attention style)
ARCHITECTURES: dict[str, tuple[str | None, str]] = {
    "llama": (None, "plain"),
    "mistral": (None, "plain"),
    "qwen2": (None, "qkv_bias"),
    "qwen3": (None, "qk_norm_head"),
    "mixtral": ("mixtral", "plain"),
    "qwen2_moe": ("qwen_moe", "qkv_bias"),
    "qwen3_moe": ("qwen_moe", "qk_norm_head"),
    "olmoe": ("olmoe", "qk_norm_full"),
}
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}


class UnsupportedModel(ConfigError):
    """A Hugging Face config dynjax cannot compute exactly; the message names the option."""


def dynjax_overrides(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The dynjax config keys (``"section.key"``) that give the model of ``hf`` (a parsed
    ``config.json``)."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise UnsupportedModel(
            f"model_type {kind!r} is not supported: dynjax imports {', '.join(ARCHITECTURES)}"
        )
    moe_style, attention = ARCHITECTURES[kind]
    _refuse_options(hf, kind)
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    out = {
        "model.family": "llama",
        "model.positions": "rope",
        "model.vocab_size": hf["vocab_size"],
        "model.num_layers": hf["num_hidden_layers"],
        "model.d_model": d,
        "model.num_heads": heads,
        "model.num_kv_heads": hf.get("num_key_value_heads") or heads,
        "model.mlp_dim": hf["intermediate_size"],
        "model.norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "model.qkv_bias": attention == "qkv_bias",
        "model.qk_norm": {"qk_norm_head": "head", "qk_norm_full": "full"}.get(attention, "none"),
        **_rope(hf),
    }
    if moe_style is not None:
        out.update(_moe(hf, moe_style))
    return out


def _refuse_options(hf: Mapping[str, Any], kind: str) -> None:
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // heads
    problems = {
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
        "head_dim": head_dim * heads != d,
        "attention_bias": kind in ("llama", "mistral") and bool(hf.get("attention_bias")),
        "mlp_bias": bool(hf.get("mlp_bias")),
        "sliding_window": bool(hf.get("use_sliding_window", kind == "mistral"))
        and hf.get("sliding_window") is not None
        and hf["sliding_window"] < hf.get("max_position_embeddings", 0),
        "clip_qkv": hf.get("clip_qkv") is not None,
        "mlp_only_layers": bool(hf.get("mlp_only_layers")),
        "router_jitter_noise": bool(hf.get("router_jitter_noise")),
    }
    bad = [k for k, v in problems.items() if v]
    if bad:
        shown = ", ".join(f"{k}={hf.get(k)!r}" for k in bad)
        raise UnsupportedModel(
            f"{kind} with {shown} is not supported: dynjax computes only the standard form "
            "of each architecture, and refuses a model it would compute differently"
        )


def _rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE's base and scaling, from ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (earlier configs)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModel(
            f"rope_type {rope_type!r} is not supported: dynjax has {', '.join(ROPE_TYPES)}"
        )
    out = {
        "model.rope_base": float(params.get("rope_theta", hf.get("rope_theta", 10_000.0))),
        "model.rope_scaling": ROPE_TYPES[rope_type],
    }
    if rope_type != "default":
        out["model.rope_factor"] = float(params["factor"])
    if rope_type == "llama3":
        out.update({
            "model.rope_low_freq_factor": float(params["low_freq_factor"]),
            "model.rope_high_freq_factor": float(params["high_freq_factor"]),
            "model.rope_original_max_len": int(params["original_max_position_embeddings"]),
        })
    return out


def _moe(hf: Mapping[str, Any], style: str) -> dict[str, Any]:
    if style == "mixtral":
        experts, width, normalize = hf["num_local_experts"], hf["intermediate_size"], True
    else:
        # transformers 5 names Qwen3-MoE's expert count like Mixtral's
        experts = hf.get("num_experts") or hf["num_local_experts"]
        normalize = bool(hf.get("norm_topk_prob", False))
        width = hf.get("moe_intermediate_size") or hf["intermediate_size"]
    out = {
        "moe.every": int(hf.get("decoder_sparse_step", 1)),
        "moe.num_experts": experts,
        "moe.top_k": hf["num_experts_per_tok"],
        "moe.expert_mlp_dim": width,
        "moe.normalize_topk": normalize,
    }
    shared = hf.get("shared_expert_intermediate_size") or 0
    if shared:
        out["moe.shared_expert_dim"] = shared
        out["moe.shared_expert_gate"] = True  # Qwen-MoE's sigmoid gate on the shared expert
    return out
