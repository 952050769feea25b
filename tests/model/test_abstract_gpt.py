"""`abstract_gpt` builds each block under a trace of its own: the result must be exactly the
model one ``nnx.eval_shape`` of ``GPT(cfg)`` traces (its graph and every leaf's shape and
dtype), whatever the family, MoE layers and plugins' block parts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dynjax.model import GPT, GPTConfig, abstract_gpt, abstract_params, fresh_params, mod
from dynjax.model.hooks import Hooks
from dynjax.model.moe import static_options

BASE = dict(vocab_size=64, num_layers=3, d_model=16, num_heads=2, mlp_dim=32, max_len=16)
CONFIGS = {
    "gpt": GPTConfig(**BASE, positions="learned"),
    "llama_moe": GPTConfig(
        **BASE, family="llama", num_kv_heads=1, moe_layers=(0, 2), num_experts=4,
        shared_expert_dim=8, routed_bias=True,
    ),
    "mod_part": GPTConfig(**BASE, hooks=Hooks((mod.HOOKS,)), block_parts=((1, mod.NAME, 16),)),
}


def leaf_types(tree):
    return jax.tree.map(lambda a: (a.shape, a.dtype), tree)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_abstract_model_is_the_traced_one(name):
    cfg = CONFIGS[name]
    traced = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    built = abstract_gpt(cfg)
    assert nnx.graphdef(built) == nnx.graphdef(traced)
    assert built.cfg == cfg and len(built.layers) == cfg.num_layers
    assert leaf_types(nnx.state(built)) == leaf_types(nnx.state(traced))
    assert leaf_types(abstract_params(cfg)) == leaf_types(fresh_params(cfg, 0))
    # A real model's values merged into its graph compute what the real model does.
    real = GPT(cfg, rngs=nnx.Rngs(1))
    merged = nnx.merge(nnx.graphdef(built), nnx.state(real))
    tokens = jnp.arange(2 * cfg.max_len).reshape(2, cfg.max_len) % cfg.vocab_size
    caps = [(2 * cfg.max_len,) * cfg.num_experts for _ in cfg.moe_layers]
    options = static_options(cfg.num_layers, cfg.moe_layers, caps) if cfg.moe_layers else None
    np.testing.assert_array_equal(
        merged(tokens, options=options)[0], real(tokens, options=options)[0]
    )
