"""Model FLOPs per token, known accelerator peaks, and model FLOPs utilization (MFU).

MFU (PaLM, Chowdhery et al. 2022, §4.1 and Appendix B) is the throughput a run achieves,
counted in the FLOPs the *model* needs (not the FLOPs the hardware happened to execute:
rematerialisation, padding and dropped MoE slots do not count), over the device's peak:

    MFU = tokens/s per device x model FLOPs per token / peak FLOP/s per device

Everything here is pure Python on plain numbers, so it is unit-testable and usable from a
notebook; `config_flops_per_token` unpacks a dynjax config at the edge.

>>> f = model_flops_per_token(d_model=128, num_layers=4, num_heads=4, mlp_dim=512,
...                           vocab_size=256, seq_len=128)
>>> f  # the quickstart model, training (forward + backward)
5701632.0
>>> peak_flops("NVIDIA H100 80GB HBM3", "bfloat16")
989500000000000.0
>>> round(mfu(50_000.0, f, peak_flops("NVIDIA A100-SXM4-80GB", "bfloat16")), 6)
0.000914
>>> peak_flops("cpu", "float32") is None
True
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dynjax.model.gpt import GPTConfig

# Training = forward + backward; the backward computes two matmuls (input and weight gradient)
# per forward matmul: 3 x forward (PaLM Appendix B; Kaplan et al. 2020 §2.1's 6N).
TRAINING_MULTIPLIER = 3


def model_flops_per_token(
    *,
    d_model: int,
    num_layers: int,
    num_heads: int,
    mlp_dim: int,
    vocab_size: int,
    seq_len: int,
    moe_layers: Collection[int] = (),
    top_k: int = 0,
    num_experts: int = 0,
    expert_mlp_dim: int = 0,
    num_kv_heads: int = 0,
    gated: bool = False,
    shared_expert_dim: int = 0,
    shared_expert_gate: bool = False,
    training: bool = True,
    half_causal_attention: bool = False,
) -> float:
    """Model FLOPs per token of dynjax's GPT or Llama (a multiply-add = 2 FLOPs), training by
    default.

    Forward, per token:
      - token (and learned position) embedding: a lookup, 0;
      - per layer, attention: Q projection 2 * d * d, K and V projections 2 * 2 * d * d_kv
        (d_kv = d * num_kv_heads / num_heads: grouped-query attention's smaller keys and
        values; ``num_kv_heads`` 0 = ``num_heads``), output projection 2 * d * d; scores Q K^T
        and weighted values A V 2 * 2 * seq_len * d (every query head attends);
      - per dense layer, MLP: 2 * 2 * d * mlp_dim (up and down projections), or with ``gated``
        (the Llama family's SwiGLU) 3 * 2 * d * mlp_dim (gate, up and down);
      - per MoE layer (index in ``moe_layers``): ``top_k`` experts of 2 * 2 * d * expert_mlp_dim
        each (3 * 2 * ... gated; ``expert_mlp_dim`` 0 = ``mlp_dim``, as in the config), the
        shared expert's 2 * 2 * d * ``shared_expert_dim`` (3 * 2 * ... gated; its gate 2 * d
        with ``shared_expert_gate``) and the router 2 * d * E; capacity slots that stay
        empty or drop do not count (dropless model FLOPs, MaxText);
      - head (logits): 2 * d * vocab_size.
    Norms, softmax, activations, the loss, biases and RoPE are left out (a few per cent at
    most), as in PaLM and MaxText. ``num_heads`` does not change the count: the heads split d.

    The attention score matrix is counted **in full** (seq_len x seq_len per sequence), though
    half of it is masked: PaLM's definition (Appendix B: 6N + 12 L H Q T per token for training,
    whose 12 L H Q T is 3 x our 2 * 2 * seq_len * d per layer), which most published MFU numbers
    use. MaxText (``calculate_tflops_training_per_device`` in ``maxtext_utils.py``, since 2025),
    Megatron-LM and NeMo count only the causal half; ``half_causal_attention=True`` does that.

    training: forward + backward = 3 x the forward (no remat recomputation: model FLOPs).
    """
    if min(d_model, num_layers, num_heads, mlp_dim, vocab_size, seq_len) < 1:
        raise ValueError("every model size must be >= 1")
    moe = set(moe_layers)
    if moe and (not 0 <= min(moe) <= max(moe) < num_layers or top_k < 1 or num_experts < top_k):
        raise ValueError(
            f"moe_layers {sorted(moe)} must index the {num_layers} layers, with "
            f"1 <= top_k ({top_k}) <= num_experts ({num_experts})"
        )
    kv = num_kv_heads or num_heads
    if num_heads % kv or d_model % num_heads:
        raise ValueError(
            f"num_kv_heads ({kv}) must divide num_heads ({num_heads}), which must divide "
            f"d_model ({d_model})"
        )
    d, d_kv = d_model, d_model // num_heads * kv
    scores = 2 * 2 * seq_len * d * (0.5 if half_causal_attention else 1.0)
    attention = 2 * d * (d + 2 * d_kv) + 2 * d * d + scores
    matrices = 3 if gated else 2  # an MLP's matrices: SwiGLU's gate, up and down
    dense_mlp = matrices * 2 * d * mlp_dim
    expert = top_k * matrices * 2 * d * (expert_mlp_dim or mlp_dim)
    shared = matrices * 2 * d * shared_expert_dim + (2 * d if shared_expert_gate else 0)
    moe_mlp = expert + shared + 2 * d * num_experts
    layers = sum(attention + (moe_mlp if i in moe else dense_mlp) for i in range(num_layers))
    forward = layers + 2 * d * vocab_size
    return float(forward * (TRAINING_MULTIPLIER if training else 1))


def config_flops_per_token(cfg: Any, **kwargs: Any) -> float:
    """`model_flops_per_token` of a dynjax config (``ml_collections.ConfigDict``)."""
    from dynjax.config import gpt_config  # the one place the config is unpacked for the model

    return gpt_flops_per_token(gpt_config(cfg), **kwargs)


def gpt_flops_per_token(m: GPTConfig, **kwargs: Any) -> float:
    """`model_flops_per_token` of a model's sizes (`dynjax.model.GPTConfig`), one token of a
    sequence of its ``max_len``."""
    return model_flops_per_token(
        d_model=m.d_model,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        mlp_dim=m.mlp_dim,
        vocab_size=m.vocab_size,
        seq_len=m.max_len,
        moe_layers=m.moe_layers,
        top_k=m.top_k,
        num_experts=m.num_experts,
        expert_mlp_dim=m.expert_mlp_dim,
        num_kv_heads=m.num_kv_heads,
        gated=m.family == "llama",
        shared_expert_dim=m.shared_expert_dim,
        shared_expert_gate=m.shared_expert_gate,
        **kwargs,
    )


# Dense (no 2:4 structured sparsity) peak FLOP/s per device. NVIDIA's datasheets print tensor
# core figures "with sparsity" (marked *): the dense figure is half of it.
#
# "float32" is what a float32 matmul runs at under JAX's default precision: on Ampere and newer
# GPUs XLA computes it with TF32 tensor cores (JAX docs, "Matmul precision": "float32 dot
# products may be computed with reduced-precision arithmetic internally (... TF32 on recent
# GPUs)"), so it is the dense TF32 figure there; V100 and T4 have no TF32 and use their FP32
# (non-tensor) figure. `peak_flops(..., tf32=False)` gives the FP32 (non-tensor) figure for runs
# with ``jax_default_matmul_precision="highest"``. "float16" is FP16 tensor with FP32
# accumulate. A dtype the device has no fast path for (bfloat16 on V100 and T4) is None.
_T = 1e12
_PEAKS: tuple[tuple[tuple[str, ...], str, dict[str, float]], ...] = (
    # (tokens every one of which the device kind must contain, name, peaks); first match wins.
    # H100 SXM5 / PCIe / NVL datasheet: FP32 67 / 51 / 60; TF32 989* / 756* / 835*;
    # BF16 and FP16 1,979* / 1,513* / 1,671*.
    (
        ("h100", "pcie"),
        "H100 PCIe",
        {"bfloat16": 756.5, "float16": 756.5, "tf32": 378.0, "fp32": 51.0},
    ),
    (
        ("h100", "nvl"),
        "H100 NVL",
        {"bfloat16": 835.5, "float16": 835.5, "tf32": 417.5, "fp32": 60.0},
    ),
    (("h100",), "H100 SXM", {"bfloat16": 989.5, "float16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    # H200 SXM / NVL datasheet: FP32 67 / 60; TF32 989* / 835*; BF16 and FP16 1,979* / 1,671*.
    (
        ("h200", "nvl"),
        "H200 NVL",
        {"bfloat16": 835.5, "float16": 835.5, "tf32": 417.5, "fp32": 60.0},
    ),
    (("h200",), "H200 SXM", {"bfloat16": 989.5, "float16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    # A100 40/80 GB, SXM and PCIe datasheet: FP32 19.5; TF32 156 (312*); BF16, FP16 312 (624*).
    (("a100",), "A100", {"bfloat16": 312.0, "float16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    # L40S datasheet: FP32 91.6; TF32 366*; BF16, FP16 733*.
    (("l40s",), "L40S", {"bfloat16": 366.5, "float16": 366.5, "tf32": 183.0, "fp32": 91.6}),
    # L40 datasheet: FP32 90.5; TF32 181*; BF16, FP16 362.1*.
    (("l40",), "L40", {"bfloat16": 181.05, "float16": 181.05, "tf32": 90.5, "fp32": 90.5}),
    # L4 datasheet: FP32 30.3; TF32 120*; BF16, FP16 242*.
    (("l4",), "L4", {"bfloat16": 121.0, "float16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    # A10 datasheet: FP32 31.2; TF32 62.5 (125*); BF16, FP16 125 (250*). NVIDIA publishes no
    # A10G (AWS G5) datasheet; it is a GA102 A10 variant, given the A10's figures here.
    (("a10g",), "A10G", {"bfloat16": 125.0, "float16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (("a10",), "A10", {"bfloat16": 125.0, "float16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    # T4 datasheet: FP32 8.1; mixed-precision FP16/FP32 65; no BF16 or TF32.
    (("t4",), "T4", {"float16": 65.0, "fp32": 8.1}),
    # V100 SXM2 / PCIe / V100S PCIe datasheet: FP32 15.7 / 14 / 16.4; tensor (FP16) 125 / 112 /
    # 130; no BF16 or TF32.
    (("v100s",), "V100S PCIe", {"float16": 130.0, "fp32": 16.4}),
    (("v100", "pcie"), "V100 PCIe", {"float16": 112.0, "fp32": 14.0}),
    (("v100",), "V100 SXM2", {"float16": 125.0, "fp32": 15.7}),
    # Ada GPU architecture whitepaper, GeForce RTX 4090: FP16 and BF16 tensor with FP32
    # accumulate 165.2 (330.4*); TF32 82.6 (165.2*); FP32 82.6.
    (
        ("rtx", "4090"),
        "RTX 4090",
        {"bfloat16": 165.2, "float16": 165.2, "tf32": 82.6, "fp32": 82.6},
    ),
    # Ampere GA102 whitepaper, GeForce RTX 3090: FP16 and BF16 tensor with FP32 accumulate
    # 71 (142*); TF32 35.6 (71*); FP32 35.6.
    (("rtx", "3090"), "RTX 3090", {"bfloat16": 71.0, "float16": 71.0, "tf32": 35.6, "fp32": 35.6}),
    # Google Cloud TPU system architecture pages, BF16 per chip: v4 275, v5e 197, v5p 459,
    # v6e (Trillium) 918. float32 matmuls on TPU run as bf16 passes whose number depends on the
    # precision: no single float32 peak (None).
    (("tpu", "v4"), "TPU v4", {"bfloat16": 275.0}),
    (("tpu", "v5", "lite"), "TPU v5e", {"bfloat16": 197.0}),
    (("tpu", "v5e"), "TPU v5e", {"bfloat16": 197.0}),
    (("tpu", "v5p"), "TPU v5p", {"bfloat16": 459.0}),
    (("tpu", "v5"), "TPU v5p", {"bfloat16": 459.0}),
    (("tpu", "v6", "lite"), "TPU v6e", {"bfloat16": 918.0}),
    (("tpu", "v6e"), "TPU v6e", {"bfloat16": 918.0}),
)
_DTYPES = ("bfloat16", "float16", "float32")


def _tokens(device_kind: str) -> set[str]:
    """'NVIDIA A100-SXM4-80GB' -> {'nvidia', 'a100', 'sxm4', '80gb'}: whole words, so that
    'a10' never matches an A100 and 'l4' never an L40S."""
    return set(re.split(r"[\s\-_/]+", device_kind.strip().lower())) - {""}


def device_name(device_kind: str) -> str | None:
    """The table's name for a ``jax.Device.device_kind`` (e.g. 'H100 SXM'), None if unknown."""
    words = _tokens(device_kind)
    for needed, name, _ in _PEAKS:
        if words.issuperset(needed):
            return name
    return None


def peak_flops(device_kind: str, dtype: str, *, tf32: bool = True) -> float | None:
    """Dense peak FLOP/s of one device of ``device_kind`` (``jax.devices()[0].device_kind``)
    for matmuls in ``dtype`` ("bfloat16", "float16" or "float32"); None for a CPU, an unknown
    device or a dtype the device has no fast path for.

    "float32" is the dense TF32 tensor-core peak where the GPU has one (JAX's default matmul
    precision uses it), else the FP32 figure; ``tf32=False`` gives the FP32 (non-tensor) figure.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {_DTYPES}")
    words = _tokens(device_kind)
    for needed, _, peaks in _PEAKS:
        if words.issuperset(needed):
            if dtype == "float32":
                value = peaks.get("tf32") if tf32 else None
                value = value if value is not None else peaks.get("fp32")
            else:
                value = peaks.get(dtype)
            return None if value is None else value * _T
    return None


def mfu(
    tokens_per_sec_per_device: float, flops_per_token: float, peak: float | None
) -> float | None:
    """Model FLOPs utilization: achieved model FLOP/s per device over the device's peak
    (``peak_flops``); None when the peak is unknown (CPU)."""
    if peak is None or peak <= 0:
        return None
    return tokens_per_sec_per_device * flops_per_token / peak
