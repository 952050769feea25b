"""FSDP (ZeRO-3) over the data devices: the shardings, training that equals one device, and the
per-device state that shrinks with the shard count (single program and pipeline)."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dynjax.experiment import Experiment
from dynjax.parallel import make_mesh, param_shardings
from dynjax.train import train

from ..helpers import loss_curve
from ..tiny import tiny_config


def test_every_array_is_split_over_data_along_its_largest_divisible_axis():
    mesh = make_mesh(1, 4, 2)
    tree = {
        "attn": {"qkv": {"kernel": np.zeros((32, 96)), "bias": np.zeros(96)}},
        "moe": {"w_in": np.zeros((4, 32, 64)), "router": {"kernel": np.zeros((32, 4))}},
        "norm": {"scale": np.zeros(30)},  # 30 is not a multiple of 4: replicated
        "count": np.zeros(()),
    }
    got = jax.tree.map(lambda s: s.spec, param_shardings(tree, mesh, fsdp=True))
    assert got["attn"]["qkv"]["kernel"] == P(None, "data")
    assert got["attn"]["qkv"]["bias"] == P("data")
    assert got["moe"]["w_in"] == P("expert", None, "data")
    assert got["moe"]["router"]["kernel"] == P("data")
    assert got["norm"]["scale"] == P() and got["count"] == P()
    off = jax.tree.map(lambda s: s.spec, param_shardings(tree, mesh))
    assert off["attn"]["qkv"]["kernel"] == P() and off["moe"]["w_in"] == P("expert")


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(mesh__data=4, mesh__expert=2),
                                  dict(mesh__stage=2, mesh__data=2, mesh__expert=2)])
def test_training_with_fsdp_equals_one_device(tmp_path, mesh):
    """MoE layers, 4 steps: the same losses and final parameters as one device."""
    base = dict(train__steps=4, train__eval_every=100, train__checkpoint_every=100,
                moe__every=2)
    one = train(tiny_config(**base), tmp_path / "one", progress=False)
    sharded = train(tiny_config(**base, **mesh), tmp_path / "fsdp", progress=False)
    np.testing.assert_allclose(
        loss_curve(tmp_path / "fsdp"), loss_curve(tmp_path / "one"), rtol=1e-5
    )
    assert sharded.final_loss == pytest.approx(one.final_loss, rel=1e-5)


def state_bytes_per_device(**overrides) -> int:
    """Argument bytes per device of the compiled single-program train step: the parameters,
    the optimizer state and the batch."""
    exp = Experiment.from_config(tiny_config(model__d_model=64, model__mlp_dim=256, **overrides))
    compiled = exp.lower_train_step(exp.initial_plan()).compile()
    return compiled.memory_analysis().argument_size_in_bytes


@pytest.mark.slow
def test_fsdp_divides_the_state_bytes_per_device_by_the_data_devices():
    replicated = state_bytes_per_device(mesh__data=8, parallel__fsdp=False)
    sharded = state_bytes_per_device(mesh__data=8)
    assert sharded < replicated / 7, (sharded, replicated)  # 1/8, plus unsplit scalars


def test_tensor_parallel_splits_attention_and_mlp_megatron_style():
    mesh = make_mesh(1, 2, 1, tensor=4)
    tree = {"layers": {0: {
        "attn": {"qkv": {"kernel": np.zeros((32, 96)), "bias": np.zeros(96)},
                 "out": {"kernel": np.zeros((32, 32)), "bias": np.zeros(32)}},
        "mlp": {"up": {"kernel": np.zeros((32, 64))}, "down": {"kernel": np.zeros((64, 32))}},
    }}}
    got = jax.tree.map(lambda s: s.spec, param_shardings(tree, mesh, fsdp=True))["layers"][0]
    assert got["attn"]["qkv"]["kernel"] == P("data", "tensor")  # columns; FSDP on the rest
    assert got["attn"]["qkv"]["bias"] == P("tensor")
    assert got["attn"]["out"]["kernel"] == P("tensor", "data")  # rows
    assert got["attn"]["out"]["bias"] == P("data")
    assert got["mlp"]["up"]["kernel"] == P("data", "tensor")
    assert got["mlp"]["down"]["kernel"] == P("tensor", "data")


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(mesh__tensor=4, mesh__data=2),
                                  dict(mesh__stage=2, mesh__tensor=2, mesh__data=2)])
def test_training_with_tensor_parallelism_equals_one_device(tmp_path, mesh):
    base = dict(train__steps=4, train__eval_every=100, train__checkpoint_every=100)
    one = train(tiny_config(**base), tmp_path / "one", progress=False)
    split = train(tiny_config(**base, **mesh), tmp_path / "tp", progress=False)
    np.testing.assert_allclose(loss_curve(tmp_path / "tp"), loss_curve(tmp_path / "one"), rtol=1e-5)
    assert split.final_loss == pytest.approx(one.final_loss, rel=1e-5)


@pytest.mark.slow
def test_tensor_parallelism_divides_the_matrices_bytes_per_device():
    """Exactly: every split parameter (and its two Adam moments) at a quarter, the rest whole."""
    whole = state_bytes_per_device(parallel__fsdp=False)
    split = state_bytes_per_device(mesh__tensor=4, parallel__fsdp=False)
    exp = Experiment.from_config(tiny_config(model__d_model=64, model__mlp_dim=256,
                                             mesh__tensor=4))
    specs = param_shardings(exp.abstract_params, exp.mesh)
    saved = sum(
        3 * a.size * a.dtype.itemsize * 3 // 4  # params + Adam's mu and nu, 3/4 of each
        for a, s in zip(jax.tree.leaves(exp.abstract_params), jax.tree.leaves(specs),
                        strict=True)
        if "tensor" in s.spec
    )
    assert saved > 0.5 * whole
    assert split == whole - saved


def test_a_tensor_split_that_does_not_divide_the_model_is_refused():
    from dynjax.config import validate_config
    from dynjax.errors import ConfigError

    with pytest.raises(ConfigError, match=r"mesh\.tensor=3 must divide model\.d_model=32"):
        validate_config(tiny_config(mesh__tensor=3), 8)


def test_tensor_parallel_attention_exchanges_nothing_but_megatrons_reductions():
    """Issue 15 §1: the fused projection's columns are per head, so a contiguous split over
    'tensor' gives each device whole heads; the compiled step holds only the all-reduces of
    the row-parallel matrices and their gradients (the (q/k/v, head) order needed all-to-alls
    and collective permutes: 19 collectives, 1.1 MB, against 7 and 0.46 MB here)."""
    exp = Experiment.from_config(tiny_config(
        model__d_model=64, model__num_heads=4, model__mlp_dim=256, mesh__tensor=2,
        parallel__fsdp=False,
    ))
    hlo = exp.lower_train_step(exp.initial_plan()).compile().as_text()
    kinds = re.findall(r" (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                       r"(?:-start)?\(", hlo)
    assert kinds and set(kinds) == {"all-reduce"}
