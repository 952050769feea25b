"""Routing variants (issue 12 §2): expert-choice routing and auxiliary-loss-free bias balancing
against NumPy references, on both dispatch paths, with expert parallelism on 8 fake devices;
the bias kept out of the optimizer and across checkpoint and resume; the MoE layer cost from the
busiest expert-parallel rank."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dynjax.checkpoint import Checkpointer
from dynjax.config import validate_config
from dynjax.dynamism import BUILTIN
from dynjax.dynamism.moe import MoEPlugin
from dynjax.dynamism.moe.checkpoint import EXPERT_STACKS
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.model import MoE, RaggedCapacities
from dynjax.model.moe import BIAS
from dynjax.parallel import expert_parallel, make_mesh
from dynjax.train import train
from dynjax.writers import read_jsonl

from ..helpers import gelu
from ..tiny import tiny_config

D, H, E, K, S, G = 16, 24, 4, 2, 12, 8
S_TINY = 32  # tiny_config's data.seq_len


def weights(moe: MoE):
    return (np.asarray(v[...], np.float64) for v in (moe.router, moe.w_in, moe.w_out))


def softmax(logits):
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def expert_choice_reference(moe: MoE, x: np.ndarray, capacities):
    """Per expert: its min(C_e, S) tokens of highest probability, each weighted by it.
    Returns (y, chosen [G, S, E] bool)."""
    router, w_in, w_out = weights(moe)
    probs = softmax(x @ router)
    y = np.zeros_like(x)
    chosen = np.zeros((x.shape[0], x.shape[1], E), bool)
    for g in range(x.shape[0]):
        for e in range(E):
            for s in np.argsort(-probs[g, :, e], kind="stable")[: capacities[e]]:
                chosen[g, s, e] = True
                y[g, s] += probs[g, s, e] * (gelu(x[g, s] @ w_in[e]) @ w_out[e])
    return y, chosen


def biased_token_choice_reference(moe: MoE, x: np.ndarray, bias: np.ndarray):
    """Top-k of probs + bias per token (no drops), gates the unbiased probs renormalised.
    Returns (y, experts [G, S, K], gates [G, S, K])."""
    router, w_in, w_out = weights(moe)
    probs = softmax(x @ router)
    experts = np.argsort(-(probs + bias), axis=-1, kind="stable")[..., :K]
    gates = np.take_along_axis(probs, experts, -1)
    gates /= gates.sum(-1, keepdims=True)
    y = np.zeros_like(x)
    for g, s, c in np.ndindex(*experts.shape):
        e = experts[g, s, c]
        y[g, s] += gates[g, s, c] * (gelu(x[g, s] @ w_in[e]) @ w_out[e])
    return y, experts, gates


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(0).normal(size=(G, S, D)).astype(np.float32)


@pytest.fixture(scope="module")
def ec_moe():
    return MoE(D, H, E, K, out_std=0.1, rngs=nnx.Rngs(3), routing="expert_choice")


def _run(moe, x, capacities, parallel=None, ragged=False, total=None):
    """(y, stats, grads of sum(y * cot) by parameters and input) through one jitted call."""
    graphdef, params = nnx.split(moe)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)

    def loss(p, v, caps):
        caps = RaggedCapacities(caps, total) if ragged else caps
        y, stats = nnx.merge(graphdef, p)(v, capacities=caps, parallel=parallel)
        return jnp.sum(y * cot), (y, stats)

    fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    caps = jnp.asarray(capacities, jnp.int32) if ragged else tuple(capacities)
    fn = jax.jit(fn) if ragged else jax.jit(fn, static_argnums=2)
    (_, (y, stats)), grads = fn(params, jnp.asarray(x), caps)
    return y, stats, grads, cot


def _dense_expert_choice_grads(moe, x, chosen, cot):
    """JAX dense reference: every expert on every token, masked by the reference's choice."""
    graphdef, params = nnx.split(moe)

    def loss(p, v):
        m = nnx.merge(graphdef, p)
        probs = jax.nn.softmax(v @ m.router[...], axis=-1)
        h = jax.nn.gelu(jnp.einsum("gsd,edh->gseh", v, m.w_in[...]))
        out = jnp.einsum("gseh,ehd->gsed", h, m.w_out[...])
        y = jnp.einsum("gsed,gse->gsd", out, jnp.where(chosen, probs, 0.0))
        return jnp.sum(y * cot)

    return jax.grad(loss, argnums=(0, 1))(params, jnp.asarray(x))


EC_CASES = [(3, 3, 3, 3), (1, 5, 2, 6), (S, 2, 7, 4)]


@pytest.mark.parametrize("capacities", EC_CASES)
@pytest.mark.parametrize("path", ["static", "static_ep", "ragged", "ragged_ep"])
def test_expert_choice_matches_reference(ec_moe, x, capacities, path):
    """Outputs and stats against the per-expert NumPy loop, gradients against a dense JAX
    reference; expert parallel: 4 expert x 2 data shards."""
    par = expert_parallel(make_mesh(1, 2, 4)) if path.endswith("_ep") else None
    shards = 4 if par else 1
    ragged = path.startswith("ragged")
    total = int(np.asarray(capacities).reshape(shards, -1).sum(1).max())
    y, stats, grads, cot = _run(ec_moe, x, capacities, par, ragged, total)
    y_ref, chosen = expert_choice_reference(ec_moe, x.astype(np.float64), capacities)
    np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-4, atol=1e-5)
    loads = np.broadcast_to(np.minimum(capacities, S), (G, E))
    np.testing.assert_array_equal(np.asarray(stats.group_loads), loads)
    np.testing.assert_array_equal(np.asarray(stats.expert_tokens), chosen.sum(1))
    np.testing.assert_array_equal(np.asarray(stats.unrouted), (~chosen.any(-1)).sum(-1))
    assert int(np.asarray(stats.dropped).sum()) == 0
    if capacities == (3, 3, 3, 3):  # 12 slots for 12 tokens: some token is left out
        assert int(np.asarray(stats.unrouted).sum()) > 0
    want = _dense_expert_choice_grads(ec_moe, x, chosen, cot)
    for u, v in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-4, atol=1e-6)


def test_bias_changes_selection_not_gates(x):
    """The bias moves tokens to expert 0 and 3 (selection), while the gates stay the unbiased
    probabilities: outputs equal the reference's, and differ from the unbiased routing's."""
    moe = MoE(D, H, E, K, out_std=0.1, rngs=nnx.Rngs(3), routed_bias=True)
    bias = np.array([0.2, -0.1, 0.0, 0.15], np.float32)
    getattr(moe, BIAS)[...] = jnp.asarray(bias)
    caps = (S,) * E  # no drops: the reference has none
    for par in (None, expert_parallel(make_mesh(1, 2, 4))):
        y, stats, grads, _ = _run(moe, x, caps, par)
        y_ref, experts, _ = biased_token_choice_reference(moe, x.astype(np.float64), bias)
        np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(stats.router_experts), experts)
        np.testing.assert_array_equal(
            np.asarray(stats.group_loads), np.eye(E, dtype=int)[experts].sum((1, 2))
        )
        assert not np.asarray(grads[0][BIAS][...]).any()  # no gradient reaches it
    unbiased, unbiased_experts, _ = biased_token_choice_reference(moe, x.astype(np.float64), 0)
    assert (unbiased_experts != experts).any()
    assert not np.allclose(unbiased, y_ref, atol=1e-5)


def _biases(params) -> np.ndarray:
    layers = params["layers"]
    return np.stack([np.asarray(layers[i]["moe"][BIAS]) for i in sorted(layers)
                     if "moe" in layers[i]])


@pytest.mark.slow
@pytest.mark.parametrize(
    "setup",
    [{}, {"mesh__expert": 2, "mesh__data": 2, "train__microbatches": 2, "moe__dispatch": "ragged"}],
    ids=["static_one_device", "ragged_expert_parallel_microbatches"],
)
def test_bias_rule_matches_numpy_and_stays_out_of_the_optimizer(setup):
    rate = 0.02
    cfg = tiny_config(moe__every=1, moe__bias_balancing__enabled=True,
                      moe__bias_balancing__rate=rate, **setup)
    exp = Experiment.from_config(cfg)
    plan = exp.initial_plan()
    step = exp.lower_train_step(plan).compile()
    state = exp.init_state()
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(state["opt_state"])[0]]
    assert paths and not [p for p in paths if BIAS in p]  # no moments, no decay: not there
    params, opt_state = state["params"], state["opt_state"]
    want = np.zeros((2, E), np.float32)
    for t in range(3):
        params, opt_state, metrics = step(
            params, opt_state, exp.device_batch(exp.order.batch(t), plan=plan)
        )
        loads = np.asarray(metrics["moe/tokens_per_expert"], np.float32)
        want = want + np.float32(rate) * np.sign(loads.mean(-1, keepdims=True) - loads)
        np.testing.assert_array_equal(_biases(jax.device_get(params)), want)
    assert np.abs(want).sum() > 0


def _bias_at(workdir, step, exp) -> np.ndarray:
    ckpt = Checkpointer(workdir / "checkpoints", stacks=EXPERT_STACKS, keep=10, async_save=False)
    state, _ = ckpt.restore(step, exp.abstract_state)
    ckpt.close()
    return _biases(state["params"])


@pytest.mark.slow
def test_bias_is_checkpointed_and_resumed_bit_for_bit(tmp_path):
    """A run resumed from step 4 ends at step 8 with the uninterrupted run's bias."""
    cfg = tiny_config(moe__every=1, moe__bias_balancing__enabled=True,
                      moe__bias_balancing__rate=0.01, train__steps=8, train__checkpoint_every=4,
                      train__eval_every=1000)
    exp = Experiment.from_config(cfg)
    train(cfg, tmp_path / "a", progress=False)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "8")
    summary = train(cfg, tmp_path / "b", progress=False)
    assert summary.start_step == 4
    at4, at8 = _bias_at(tmp_path / "a", 4, exp), _bias_at(tmp_path / "a", 8, exp)
    assert np.abs(at4).sum() > 0 and (at8 != at4).any()
    np.testing.assert_array_equal(_bias_at(tmp_path / "b", 8, exp), at8)


@pytest.mark.slow
@pytest.mark.parametrize("microbatches", [1, 2])
def test_bias_on_the_pipeline_equals_the_single_program(tmp_path, microbatches):
    """Two pipeline stages, one MoE layer each: each stage moves its own layer's bias."""
    got = []
    runs = {"single": {}, "pipe": {"pipeline__stage_layers": "1,1", "mesh__stage": 2}}
    for name, stages in runs.items():
        cfg = tiny_config(moe__every=1, moe__bias_balancing__enabled=True,
                          moe__bias_balancing__rate=0.02, train__steps=3,
                          train__microbatches=microbatches, train__eval_every=1000,
                          train__checkpoint_every=3, **stages)
        train(cfg, tmp_path / name, progress=False)
        got.append(_bias_at(tmp_path / name, 3, Experiment.from_config(cfg)))
    assert np.abs(got[0]).sum() > 0
    np.testing.assert_array_equal(got[1], got[0])


def test_static_cost_is_the_busiest_ranks_slots():
    """Capacities (2, 5, 3, 4) over 2 expert ranks: every rank computes max(2, 3) + max(5, 4) = 8
    slots per group (the padded layout), against 2 * base at factor 1."""
    exp = Experiment.from_config(tiny_config(moe__every=2, mesh__expert=2))
    plan = exp.initial_plan().with_part("moe", capacities=((2, 5, 3, 4),))
    base = S_TINY * 2 / 4
    assert MoEPlugin(MoEPlugin.read(exp.cfg.moe), exp.facts).layer_costs(plan) == pytest.approx(
        [1.0, 8 / (2 * base)]
    )
    one = Experiment.from_config(tiny_config(moe__every=2))
    assert MoEPlugin(MoEPlugin.read(one.cfg.moe), one.facts).layer_costs(plan) == pytest.approx(
        [1.0, 14 / (4 * base)]
    )


def test_ragged_cost_is_the_busiest_ranks_tokens():
    exp = Experiment.from_config(tiny_config(moe__every=2, mesh__expert=2, moe__dispatch="ragged"))
    tokens = np.array([[100, 40, 90, 30]])  # rank 0: 140, rank 1: 120
    share = 8 * S_TINY * 2 / 2
    plugin = MoEPlugin(MoEPlugin.read(exp.cfg.moe), exp.facts)
    assert plugin.layer_costs(exp.initial_plan()) is None
    costs = plugin.metric_costs({"moe/expert_tokens": tokens})
    assert costs == pytest.approx([1.0, 140 / share])


@pytest.mark.slow
def test_an_expert_choice_run_trains_and_logs_its_unrouted_tokens(tmp_path):
    cfg = tiny_config(moe__every=1, moe__routing="expert_choice", moe__capacity__factor=0.5,
                      train__steps=4, train__eval_every=1000, train__checkpoint_every=1000)
    train(cfg, tmp_path, progress=False)
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 4 and rows[-1]["loss"] < rows[0]["loss"]
    assert all(r["dropped_fraction"] == 0 for r in rows)
    # factor 0.5: 4 experts x 8 slots for 32 tokens, so a token is left out whenever two
    # experts share one
    unrouted = np.array([r["moe/unrouted"] for r in rows])
    assert unrouted.shape == (4, 2) and unrouted.sum() > 0 and (unrouted < 8 * 32).all()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"moe__routing": "hash"}, "moe.routing='hash'"),
        ({"moe__bias_balancing__enabled": True, "moe__bias_balancing__rate": 0.0},
         "moe.bias_balancing.rate=0.0"),
        ({"moe__routing": "expert_choice", "moe__bias_balancing__enabled": True},
         "moe.bias_balancing.enabled=True"),
        ({"moe__routing": "expert_choice", "moe__capacity__policy": "dynamic"},
         "moe.capacity.policy='dynamic'"),
        ({"moe__routing": "expert_choice", "moe__caching__enabled": True},
         "moe.caching.enabled=True"),
        ({"moe__routing": "expert_choice", "moe__capacity__factor": 0.0,
          "moe__dispatch": "ragged"}, "dropless"),
        ({"moe__every": 0, "moe__bias_balancing__enabled": True},
         "moe.bias_balancing.enabled=True needs MoE layers"),
    ],
)
def test_bad_routing_config_names_the_key(overrides, match):
    cfg = tiny_config(**{"moe__every": 2, **overrides})
    with pytest.raises(ConfigError, match=match):
        validate_config(cfg, num_devices=8)


def test_the_bias_stays_float32_in_a_bfloat16_step():
    """Steps of 1e-3 on a bias near 0.1 are below bfloat16's resolution there."""
    from dynjax.parallel.stage import cast_floats

    params = {"layers": {1: {"moe": {BIAS: jnp.full((E,), 0.1001), "router": jnp.ones((D, E))}}}}
    cast = cast_floats(params, jnp.bfloat16, BUILTIN.hooks())["layers"][1]["moe"]
    assert cast[BIAS].dtype == jnp.float32 and cast["router"].dtype == jnp.bfloat16
    assert float(cast[BIAS][0]) == pytest.approx(0.1001, abs=1e-7)


@pytest.mark.parametrize("ragged", [False, True])
def test_expert_tokens_are_the_kept_pairs(x, ragged):
    """What the ragged cost reads: each expert's kept pairs, min(load, C_e) per group."""
    moe = MoE(D, H, E, K, out_std=0.1, rngs=nnx.Rngs(3))
    caps = (2, 7, 3, 5)
    _, stats, _, _ = _run(moe, x, caps, ragged=ragged, total=sum(caps))
    loads = np.asarray(stats.group_loads)
    assert (loads > caps).any()
    np.testing.assert_array_equal(np.asarray(stats.expert_tokens), np.minimum(loads, caps))
