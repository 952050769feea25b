"""Hugging Face checkpoints read into dynjax compute transformers' logits (fixtures made by
tests/data/hf/make_fixtures.py), each device reading only its slice; unknown options refused."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dynjax.checkpoint.huggingface import SafeTensors, leaves, load_params, read_slice, to_hf
from dynjax.config import check_run, model_facts
from dynjax.hf.architectures import UnsupportedModel, dynjax_overrides
from dynjax.hf.convert import layout_of
from dynjax.model.gpt import GPT
from tests.helpers import moe_options
from tests.tiny import tiny_config

FIXTURES = Path(__file__).parents[1] / "data" / "hf"
ARCHITECTURES = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file())


def imported_model(name: str, **overrides):
    """The GPTConfig of fixture ``name`` and its HF config."""
    hf = json.loads((FIXTURES / name / "config.json").read_text())
    keys = {k.replace(".", "__"): v for k, v in dynjax_overrides(hf).items()}
    cfg = tiny_config(**keys, data__seq_len=12, moe__dispatch="static", **overrides)
    return model_facts(cfg, check_run(cfg, 1)).model, hf


def abstract_params(model, sharding):
    pure = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: GPT(model, rngs=nnx.Rngs(0)))))
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), pure)


def logits_of(model, params, tokens):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(model, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, params)
    every = (tokens.size * model.top_k,) * model.num_experts  # no token dropped
    options = moe_options(model, tuple(every for _ in model.moe_layers))
    logits, _ = nnx.merge(graphdef, state)(jnp.asarray(tokens), options=options)
    return np.asarray(logits)


def test_every_listed_architecture_has_a_fixture():
    assert ARCHITECTURES == sorted([
        "llama", "llama_tied_rope_scaled", "mistral", "mixtral", "olmoe", "qwen2", "qwen2_moe",
        "qwen3", "qwen3_moe",
    ])


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_logits_equal_transformers(name):
    model, hf = imported_model(name)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = load_params(abstract_params(model, one), layout_of(model, hf),
                         SafeTensors(FIXTURES / name))
    got = logits_of(model, params, np.load(FIXTURES / name / "tokens.npy"))
    want = np.load(FIXTURES / name / "logits.npy")
    # float32 through two layers: 1.6e-5 at most on logits up to 7.3 (2.5e-6 relative)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)


class CountingReads(SafeTensors):
    """Counts the elements read from each tensor."""

    def __init__(self, directory):
        super().__init__(directory)
        self.elements: dict[str, int] = {}

    def read(self, name, index):
        out = super().read(name, index)
        self.elements[name] = self.elements.get(name, 0) + out.size
        return out


def test_each_device_reads_only_its_slice():
    """Sharded over 8 devices (experts over 4, columns over 2), the leaves are read a slice per
    device: every element once per device holding it, never a whole leaf per device."""
    model, hf = imported_model("mixtral")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("expert", "tensor"))
    src = CountingReads(FIXTURES / "mixtral")
    layout = layout_of(model, hf)
    abstract = abstract_params(model, NamedSharding(mesh, P()))
    w_in = abstract["layers"][0]["moe"]["w_in"]
    abstract["layers"][0]["moe"]["w_in"] = jax.ShapeDtypeStruct(
        w_in.shape, w_in.dtype, sharding=NamedSharding(mesh, P("expert", None, "tensor"))
    )
    params = load_params(abstract, layout, src)
    expert_weights = [k for k in src.elements if "layers.0.block_sparse_moe.experts" in k]
    # each expert's w1 and w3 (gate and up): 2 devices hold each expert, each half its columns
    assert all(src.elements[k] == 64 * 32 for k in expert_weights if ".w2." not in k)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    whole = load_params(abstract_params(model, one), layout, SafeTensors(FIXTURES / "mixtral"))
    np.testing.assert_array_equal(np.asarray(params["layers"][0]["moe"]["w_in"]),
                                  np.asarray(whole["layers"][0]["moe"]["w_in"]))


@pytest.mark.parametrize("name", ["llama", "qwen2_moe", "olmoe"])
def test_export_writes_back_the_tensors_it_read(name):
    model, hf = imported_model(name)
    src, layout = SafeTensors(FIXTURES / name), layout_of(model, hf)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = load_params(abstract_params(model, one), layout, src)
    tensors = to_hf(jax.device_get(params), layout)
    assert set(tensors) == set(src.files)
    for name_, array in tensors.items():
        np.testing.assert_array_equal(array, src.read(name_, (slice(None),) * array.ndim))


def test_a_slice_of_the_fused_projection_reads_the_heads_it_covers():
    model, hf = imported_model("llama")  # 4 query heads, 2 key/value heads of 8
    leaf = leaves(layout_of(model, hf))[("layers", 1, "attn", "qkv", "kernel")]
    src = SafeTensors(FIXTURES / "llama")
    part = read_slice(leaf, (32, 64), (slice(0, 32), slice(16, 40)), src)
    q = src.read("model.layers.1.self_attn.q_proj.weight", (slice(None), slice(None))).T
    k = src.read("model.layers.1.self_attn.k_proj.weight", (slice(None), slice(None))).T
    v = src.read("model.layers.1.self_attn.v_proj.weight", (slice(None), slice(None))).T
    group0 = np.concatenate([q[:, :16], k[:, :8], v[:, :8]], axis=1)
    group1 = np.concatenate([q[:, 16:], k[:, 8:], v[:, 8:]], axis=1)
    np.testing.assert_array_equal(part, np.concatenate([group0, group1], axis=1)[:, 16:40])


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"model_type": "gpt_neox"}, "model_type 'gpt_neox' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"head_dim": 16}, "head_dim=16"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"model_type": "mistral", "sliding_window": 8}, "sliding_window=8"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ],
)
def test_unknown_architectures_and_options_are_refused_by_name(change, words):
    hf = json.loads((FIXTURES / "llama" / "config.json").read_text())
    with pytest.raises(UnsupportedModel, match=words):
        dynjax_overrides({**hf, **change})
