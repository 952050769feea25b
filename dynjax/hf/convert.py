"""Hugging Face model directories in and out of a dynjax workdir (docs/models.md).

``import``: the directory's ``config.json`` becomes dynjax config keys (`architectures`), written
with the base config and the user's overrides as the workdir's ``config.py``; the run's
``train.init_from`` names the directory, so its fresh start reads the weights (each device its
own slice, `dynjax.checkpoint.huggingface.load_params`), and that state is saved as the
workdir's step-0 checkpoint.
``python -m dynjax.train --workdir W`` then fine-tunes it. The directory's config and tokenizer
files are kept under ``W/hf`` for the export.

``export``: the workdir's newest checkpoint written back as ``model.safetensors`` (sharded past
`SHARD_BYTES`, with its index), the kept ``config.json`` and tokenizer files beside it. Pruned
weights are the zeros the model holds; frozen layers are as they were.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np

from dynjax import config as config_lib
from dynjax.checkpoint.huggingface import layout_of, read_hf_config, to_hf
from dynjax.dynamism import BUILTIN, Schemes
from dynjax.errors import ConfigError
from dynjax.hf.architectures import dynjax_overrides
from dynjax.model.gpt import GPTConfig

KEPT = (  # the files of a model directory an export writes back beside the weights
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
SHARD_BYTES = 2 << 30  # one safetensors file's most bytes when exporting


def import_model(
    source: str | Path, workdir: str | Path, base: str, overrides: Sequence[str] = ()
) -> Path:
    """Write ``workdir/config.py`` and the step-0 checkpoint of the HF model at ``source``."""
    from dynjax.train import write_initial_checkpoint  # the loop's own save, above this module

    source, workdir = Path(source).expanduser().resolve(), Path(workdir)
    hf = read_hf_config(source)
    mapped = [f"{k}={v}" for k, v in dynjax_overrides(hf).items()]
    implied = [f"train.init_from={source}"]
    if (source / "tokenizer.json").is_file():
        implied.append(f"data.tokenizer={source}")
    every = [*mapped, *implied, *overrides]  # the user's last: they may override any mapping
    cfg, schemes = config_lib.load_run(base, every)
    config_lib.validate_config(cfg, jax.device_count(), schemes)
    if (workdir / "checkpoints").exists() and any((workdir / "checkpoints").iterdir()):
        raise ConfigError(f"{workdir} already holds checkpoints: import into a new --workdir")
    workdir.mkdir(parents=True, exist_ok=True)
    kept = workdir / "hf"
    kept.mkdir(exist_ok=True)
    for name in KEPT:
        if (source / name).is_file():
            shutil.copy2(source / name, kept / name)
    config_file = workdir / "config.py"
    config_file.write_text(
        f'"""Fine-tunes {source} (written by python -m dynjax.hf import)."""\n\n'
        "from dynjax.config import load_run\n\n"
        f"BASE = {str(Path(base).resolve())!r}\n"
        f"OVERRIDES = {every!r}\n"
        "SCHEMES = load_run(BASE, OVERRIDES)[1]\n\n\n"
        "def get_config():\n"
        "    return load_run(BASE, OVERRIDES)[0]\n"
    )
    write_initial_checkpoint(cfg, workdir, schemes)
    return config_file


def export_model(workdir: str | Path, out: str | Path) -> Path:
    """Write the newest checkpoint of ``workdir`` as a HF model directory ``out``."""
    from dynjax.train import newest_params  # the loop's own restore, above this module

    workdir, out = Path(workdir), Path(out)
    cfg, schemes = workdir_config(workdir)
    run = config_lib.check_run(cfg, jax.device_count(), schemes)
    model = config_lib.model_facts(cfg, run, schemes).model
    kept = workdir / "hf"
    hf = read_hf_config(kept) if (kept / "config.json").is_file() else synthesized_config(model)
    tensors = to_hf(newest_params(cfg, workdir, schemes), layout_of(model, hf))
    out.mkdir(parents=True, exist_ok=True)
    _write_safetensors(tensors, out)
    for name in KEPT[1:]:
        if (kept / name).is_file():
            shutil.copy2(kept / name, out / name)
    hf = {**hf, "tie_word_embeddings": False, "torch_dtype": "float32"}
    hf.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out


def workdir_config(workdir: Path) -> tuple[ml_collections.ConfigDict, Schemes]:
    """The config a workdir was trained with: its ``config.py`` (an import's), else the
    ``config.json`` every run writes, over the built-in schemes' defaults."""
    if (workdir / "config.py").is_file():
        return config_lib.load_run(workdir / "config.py")
    if not (workdir / "config.json").is_file():
        raise ConfigError(f"{workdir} holds no config.json: give the workdir of a training run")
    cfg = config_lib.default_config(BUILTIN)
    _assign(cfg, json.loads((workdir / "config.json").read_text()))
    return cfg, BUILTIN


def _assign(node: ml_collections.ConfigDict, values: Mapping[str, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, dict):
            _assign(node[key], value)
        else:  # JSON has no tuples
            node[key] = tuple(value) if isinstance(node[key], tuple) else value


def synthesized_config(model: GPTConfig) -> dict[str, Any]:
    """The HF config of a model trained from scratch in dynjax: Llama for the dense llama
    family, Mixtral for it with an MoE block in every layer; anything else is refused by name."""
    m = model
    plain = m.family == "llama" and m.positions == "rope"
    plain = plain and not m.qkv_bias and m.qk_norm == "none"
    if not plain:
        raise ConfigError(
            f"model.family={m.family!r} (positions={m.positions!r}, qkv_bias={m.qkv_bias}, "
            f"qk_norm={m.qk_norm!r}) was not imported and has no Hugging Face architecture to "
            "export as: only a llama-family model without qkv_bias or qk_norm exports as Llama "
            "or Mixtral (import a model to export its own architecture)"
        )
    rope = None
    if m.rope.scaling != "none":
        rope = {"rope_type": m.rope.scaling, "factor": m.rope.factor}
    if m.rope.scaling == "llama3":
        rope.update(low_freq_factor=m.rope.low_freq_factor,
                    high_freq_factor=m.rope.high_freq_factor,
                    original_max_position_embeddings=m.rope.original_max_len)
    config = {
        "vocab_size": m.vocab_size, "hidden_size": m.d_model,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads or m.num_heads, "intermediate_size": m.mlp_dim,
        "rms_norm_eps": m.norm_eps, "hidden_act": "silu", "max_position_embeddings": m.max_len,
        "rope_theta": m.rope.base, "rope_scaling": rope, "tie_word_embeddings": False,
    }
    if not m.moe_layers:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **config}
    if len(m.moe_layers) != m.num_layers or m.shared_expert_dim or not m.normalize_topk:
        raise ConfigError(
            "a llama-family MoE model exports as Mixtral only with an MoE block in every layer "
            "(moe.every=1), no shared expert and moe.normalize_topk=True"
        )
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **config,
        "num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k,
        "intermediate_size": m.expert_mlp_dim or m.mlp_dim, "router_jitter_noise": 0.0,
    }


def _write_safetensors(tensors: dict[str, np.ndarray], out: Path) -> None:
    from safetensors.numpy import save_file  # the [hf] extra

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name], np.float32)
        if shards[-1] and size + array.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(a.nbytes for a in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
