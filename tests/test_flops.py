"""Model FLOPs per token, device peaks and MFU (dynjax.flops), checked against hand counts."""

import doctest

import pytest

import dynjax.flops
from dynjax.config import load_config, validate_config
from dynjax.flops import config_flops_per_token, device_name, mfu, model_flops_per_token, peak_flops

from .helpers import ROOT

CONFIGS = ROOT / "configs"


def test_quickstart_model_flops_equal_a_hand_count():
    cfg = load_config(str(CONFIGS / "quickstart.py"), [])
    d, layers, mlp, vocab, seq = 128, 4, 512, 256, 128  # configs/quickstart.py = the defaults
    assert (cfg.model.d_model, cfg.model.num_layers, cfg.model.mlp_dim) == (d, layers, mlp)
    assert (cfg.model.vocab_size, cfg.data.seq_len, cfg.moe.every) == (vocab, seq, 0)
    # Per layer, forward, per token:
    #   Q, K, V projections 2*3*128*128 = 98,304; output projection 2*128*128 = 32,768
    #   scores and weighted values (full matrix) 2*2*128*128 = 65,536
    #   MLP 2*2*128*512 = 262,144                               -> 458,752 per layer
    # 4 layers 1,835,008 + head 2*128*256 = 65,536 -> forward 1,900,544; training 3x = 5,701,632
    assert 98_304 + 32_768 + 65_536 + 262_144 == 458_752
    assert 4 * 458_752 + 65_536 == 1_900_544
    assert config_flops_per_token(cfg) == 5_701_632
    assert config_flops_per_token(cfg, training=False) == 1_900_544
    # MaxText's convention counts half of the causal score matrix: 4 layers x 32,768 less.
    assert config_flops_per_token(cfg, half_causal_attention=True) == 3 * (1_900_544 - 4 * 32_768)


def test_moe_config_counts_top_k_experts_and_the_router():
    cfg = load_config(str(CONFIGS / "moe.py"), [])  # MoE layers 1, 3: E=8, top-2, width 256
    # dense layer as above 458,752; MoE layer: attention 196,608 + 2 experts x 2*2*128*256
    # (131,072 each) + router 2*128*8 = 2,048 -> 460,800
    moe_layer = 196_608 + 2 * 131_072 + 2_048
    assert moe_layer == 460_800
    forward = 2 * 458_752 + 2 * moe_layer + 65_536
    assert config_flops_per_token(cfg) == 3 * forward
    assert (
        model_flops_per_token(
            d_model=128,
            num_layers=4,
            num_heads=4,
            mlp_dim=512,
            vocab_size=256,
            seq_len=128,
            moe_layers=(1, 3),
            top_k=2,
            num_experts=8,
            expert_mlp_dim=256,
        )
        == 3 * forward
    )


def test_llama_config_counts_swiglu_grouped_heads_and_the_shared_expert():
    cfg = load_config(str(CONFIGS / "llama_tiny.py"), [])
    validate_config(cfg, num_devices=1)
    # d 128, 4 heads of 32 sharing 2 key/value heads (d_kv 64), seq 128, vocab 256, per token:
    #   attention: Q and K, V 2*128*(128 + 2*64) = 65,536; out 32,768; scores 65,536 -> 163,840
    #   dense SwiGLU (layers 0, 2): 3 matrices 3*2*128*344 = 264,192
    #   MoE (layers 1, 3): 2 SwiGLU experts 2*3*2*128*128 = 196,608, shared expert 98,304,
    #   router 2*128*8 = 2,048 -> 296,960
    attention, dense, moe = 163_840, 264_192, 196_608 + 98_304 + 2_048
    forward = 2 * (attention + dense) + 2 * (attention + moe) + 2 * 128 * 256
    assert forward == 1_843_200
    assert config_flops_per_token(cfg) == 3 * forward


def test_expert_width_zero_means_mlp_dim():
    kw = dict(d_model=8, num_layers=2, num_heads=2, mlp_dim=16, vocab_size=10, seq_len=4)
    # top-1 of 1 expert at the MLP's width = the dense MLP plus a 2*d*1 router
    moe = model_flops_per_token(**kw, moe_layers=(0,), top_k=1, num_experts=1)
    assert moe == model_flops_per_token(**kw) + 3 * 2 * 8


@pytest.mark.parametrize(
    "bad",
    [dict(moe_layers=(4,), top_k=1, num_experts=2), dict(moe_layers=(0,), top_k=3, num_experts=2)],
)
def test_impossible_moe_layout_is_an_error(bad):
    with pytest.raises(ValueError):
        model_flops_per_token(
            d_model=8, num_layers=4, num_heads=2, mlp_dim=16, vocab_size=10, seq_len=4, **bad
        )


@pytest.mark.parametrize(
    "kind,dtype,tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989.5),  # SXM: 1,979 with sparsity / 2
        ("NVIDIA H100 80GB HBM3", "float32", 494.5),  # TF32 dense
        ("NVIDIA H100 PCIe", "bfloat16", 756.5),
        ("NVIDIA H100 NVL", "bfloat16", 835.5),
        ("NVIDIA H200", "bfloat16", 989.5),
        ("NVIDIA A100-SXM4-80GB", "bfloat16", 312.0),
        ("NVIDIA A100 80GB PCIe", "float32", 156.0),
        ("NVIDIA A10G", "bfloat16", 125.0),
        ("NVIDIA L4", "bfloat16", 121.0),
        ("NVIDIA L40S", "bfloat16", 366.5),
        ("Tesla T4", "float16", 65.0),
        ("Tesla T4", "float32", 8.1),  # no TF32 on Turing: FP32
        ("Tesla V100-SXM2-16GB", "float32", 15.7),
        ("Tesla V100-PCIE-32GB", "float16", 112.0),
        ("NVIDIA GeForce RTX 4090", "bfloat16", 165.2),
        ("TPU v5 lite", "bfloat16", 197.0),
    ],
)
def test_known_peaks(kind, dtype, tflops):
    assert peak_flops(kind, dtype) == pytest.approx(tflops * 1e12)


def test_device_names_match_whole_words():
    assert device_name("NVIDIA A100-SXM4-40GB") == "A100"  # not the A10
    assert device_name("NVIDIA A10") == "A10"
    assert device_name("NVIDIA L40S") == "L40S" and device_name("NVIDIA L4") == "L4"
    assert device_name("NVIDIA H100 PCIe") == "H100 PCIe"


def test_unknown_devices_and_dtypes_without_a_fast_path_have_no_peak():
    assert peak_flops("cpu", "float32") is None
    assert peak_flops("cpu", "bfloat16") is None
    assert peak_flops("Some Future Accelerator", "bfloat16") is None
    assert peak_flops("Tesla V100-SXM2-16GB", "bfloat16") is None  # no bf16 on Volta
    assert peak_flops("TPU v4", "float32") is None
    assert peak_flops("NVIDIA H100 80GB HBM3", "float32", tf32=False) == pytest.approx(67e12)
    with pytest.raises(ValueError):
        peak_flops("NVIDIA H100 80GB HBM3", "fp8")


def test_mfu():
    # 100,000 tokens/s x 5,701,632 FLOPs/token = 5.7e11 FLOP/s of an A100's 312e12 bf16
    assert mfu(100_000.0, 5_701_632.0, 312e12) == pytest.approx(5.701632e11 / 312e12)
    assert mfu(100_000.0, 5_701_632.0, None) is None


def test_docstring_examples():
    assert doctest.testmod(dynjax.flops).failed == 0
