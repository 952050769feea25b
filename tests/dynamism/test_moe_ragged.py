"""The ragged MoE path (``moe.dispatch="ragged"``) against the static path: same outputs,
gradients and dropped (token, choice) pairs for the same per-expert capacities, and runtime
capacities that change without a recompile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dynjax.config import validate_config
from dynjax.dynamism.moe.part import capacities_of
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.model import MoE, RaggedCapacities
from dynjax.model.moe import grouped_ffn
from dynjax.parallel import expert_parallel, make_mesh
from dynjax.recompile import Plan, Proposal
from dynjax.train import train
from dynjax.writers import read_jsonl

from ..helpers import events_of
from ..tiny import tiny_config

D, H, E, K, S, G = 16, 24, 4, 2, 12, 8
CAPACITIES = [(S,) * E, (1, 3, 2, 5), (4, 4, 4, 4), (0, 6, 2, 3)]


@pytest.fixture(scope="module")
def moe():
    return MoE(D, H, E, K, out_std=0.1, rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(0).normal(size=(G, S, D)).astype(np.float32)


def shard_total(capacities, shards):
    """The largest expert shard's summed capacities: the least buffer that holds its pairs."""
    return int(np.asarray(capacities).reshape(shards, -1).sum(axis=1).max())


def _loss_and_grads(moe, x, parallel=None, ragged=False, capacities=None, total=None):
    graphdef, params = nnx.split(moe)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=(G, S, D)), jnp.float32)

    def loss(p, v, caps):
        caps = RaggedCapacities(caps, total) if ragged else caps
        y, stats = nnx.merge(graphdef, p)(v, capacities=caps, parallel=parallel)
        return jnp.sum(y * cot) + 0.1 * jnp.mean(stats.aux_loss), (y, stats)

    caps = jnp.asarray(capacities, jnp.int32) if ragged else tuple(capacities)
    fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    if ragged:
        fn = jax.jit(fn)
    else:
        fn = jax.jit(fn, static_argnums=2)
    (_, (y, stats)), grads = fn(params, jnp.asarray(x), caps)
    return y, stats, grads


def _assert_same(a, b):
    (y1, s1, g1), (y2, s2, g2) = a, b
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y2), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(s1.dropped), np.asarray(s2.dropped))
    np.testing.assert_array_equal(np.asarray(s1.group_loads), np.asarray(s2.group_loads))
    for u, v in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("capacities", CAPACITIES)
def test_ragged_equals_static(moe, x, capacities):
    static = _loss_and_grads(moe, x, capacities=capacities)
    total = shard_total(capacities, 1)
    ragged = _loss_and_grads(moe, x, ragged=True, capacities=capacities, total=total)
    _assert_same(ragged, static)
    assert (int(np.asarray(static[1].dropped).sum()) > 0) == (capacities[0] < S)


@pytest.mark.parametrize("capacities", CAPACITIES)
@pytest.mark.parametrize("shards", [2, 4])
def test_ragged_equals_static_with_expert_parallelism(moe, x, capacities, shards):
    """2- or 4-way expert sharding, data over the rest of the 8 fake CPU devices; with 2
    experts per shard the tiles' experts must travel with the rows."""
    par = expert_parallel(make_mesh(1, 8 // shards, shards))
    static = _loss_and_grads(moe, x, parallel=par, capacities=capacities)
    total = shard_total(capacities, shards)
    ragged = _loss_and_grads(moe, x, parallel=par, ragged=True, capacities=capacities, total=total)
    _assert_same(ragged, static)


def test_runtime_capacities_change_drops_without_recompile(moe, x):
    """Within one total the capacities are a runtime input: one compile serves them all, and
    each gives the static path's drops."""
    total = 12
    graphdef, params = nnx.split(moe)
    fn = jax.jit(
        lambda p, v, caps: nnx.merge(graphdef, p)(v, capacities=RaggedCapacities(caps, total))[1]
    )
    for caps in [(3, 3, 3, 3), (1, 5, 2, 4), (6, 2, 2, 2), (0, 0, 6, 6)]:
        stats = fn(params, jnp.asarray(x), jnp.asarray(caps, jnp.int32))
        _, ref = moe(jnp.asarray(x), capacities=caps)
        np.testing.assert_array_equal(np.asarray(stats.dropped), np.asarray(ref.dropped))
    assert fn._cache_size() == 1


@pytest.mark.parametrize("shards", [1, 4])
def test_dropless_worst_case_buffer_equals_no_drop(moe, x, shards):
    """Dropless: every capacity = group tokens, and the buffer only the worst case a shard can
    receive (S * min(k, local experts) rows per group, below the summed capacities)."""
    par = expert_parallel(make_mesh(1, 8 // shards, shards)) if shards > 1 else None
    total = S * min(K, E // shards)
    static = _loss_and_grads(moe, x, parallel=par, capacities=(S,) * E)
    ragged = _loss_and_grads(moe, x, parallel=par, ragged=True, capacities=(S,) * E, total=total)
    _assert_same(ragged, static)
    assert int(np.asarray(ragged[1].dropped).sum()) == 0


def _one_step(exp, plan, state, batch):
    placed = exp.place_state(state)
    step = exp.lower_train_step(plan).compile()
    return jax.device_get(
        step(placed["params"], placed["opt_state"], exp.device_batch(batch, plan=plan))
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "setup",
    [{}, {"mesh__expert": 2, "mesh__data": 2, "train__microbatches": 2}],
    ids=["one_device", "expert_parallel_microbatches"],
)
def test_ragged_train_step_equals_static(setup):
    """The whole train step (2 MoE layers, tight uneven capacities): same loss, drops, params."""
    out = []
    for dispatch in ("static", "ragged"):
        exp = Experiment.from_config(tiny_config(moe__every=1, moe__dispatch=dispatch, **setup))
        plan = exp.initial_plan()
        plan = plan.with_part("moe", capacities=((3, 9, 5, 12), (8, 8, 2, 6)))
        out.append(_one_step(exp, plan, jax.device_get(exp.init_state()), exp.order.batch(0)))
    (p_s, o_s, m_s), (p_r, o_r, m_r) = out
    assert m_s["moe/dropped"].sum() > 0
    np.testing.assert_array_equal(m_r["moe/dropped"], m_s["moe/dropped"])
    np.testing.assert_allclose(m_r["loss"], m_s["loss"], rtol=1e-6)
    for a, b in zip(jax.tree.leaves((p_r, o_r)), jax.tree.leaves((p_s, o_s)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


class ShiftCapacity:
    """Starts from uneven capacities, then moves slots between experts every 3 steps, keeping
    every layer's total. Keeps each step's metrics it was shown (`seen`), for the test to check
    the capacities each step ran with."""

    name = "shift"

    def __init__(self, start):
        self.start, self.last, self.seen = start, None, {}

    def propose(self, history, plan):
        self.seen.update(history.entries)
        step = history.latest_step
        if self.last is None:
            self.last = step
            return Proposal(self.start, "uneven")
        if step < self.last + 3:
            return None
        self.last = step
        caps = tuple(caps[1:] + caps[:1] for caps in capacities_of(plan))
        return Proposal(plan.with_part("moe", capacities=caps), "rotate")


@pytest.mark.slow
def test_runtime_capacity_changes_swap_without_compiling(tmp_path):
    """Uneven capacities within the initial Plan's bucketed total: every swap reuses the first
    executable, none counts against a budget of zero recompiles, and the drops follow: each
    step's dropped pairs are those its routed loads drop at the capacities of the Plan swapped
    in for it."""
    cfg = tiny_config(
        moe__every=2,
        moe__dispatch="ragged",
        train__steps=30,
        recompile__delta_launch=1,
        recompile__budget__max_recompiles=0,
    )
    exp = Experiment.from_config(cfg)
    first = exp.initial_plan()  # 20 slots per expert: a total of min(80, 32 * 2) = 64 rows
    start = first.with_part("moe", capacities=((4, 12, 28, 32),))
    assert exp.compile_key(start) == exp.compile_key(first)
    policy = ShiftCapacity(start)
    summary = train(cfg, tmp_path, policies=[policy], progress=False)
    swaps = events_of(tmp_path, "recompile")
    assert summary.final_step == 30 and len(swaps) >= 3
    assert all(e["cache_hit"] and e["compile_seconds"] == 0 for e in swaps)
    assert not events_of(tmp_path, "recompile_rejected")
    # The capacities each step ran with: the newest swapped-in Plan's at or before it.
    ran_with = [(0, capacities_of(first))] + [
        (e["swap_step"], capacities_of(Plan.from_dict(e["plan"]))) for e in swaps
    ]
    assert len({caps for _, caps in ran_with}) >= 4  # the start and >= 2 distinct rotations
    checked = set()
    for step, metrics in sorted(policy.seen.items()):
        caps = next(c for s, c in reversed(ran_with) if s <= step)
        loads = np.asarray(metrics["moe/group_loads"])  # [L, G, E], before dropping
        want = np.maximum(loads - np.asarray(caps)[:, None, :], 0).sum(axis=(1, 2))
        np.testing.assert_array_equal(metrics["moe/dropped"], want, err_msg=f"step {step}")
        checked.add(caps)
    assert len(checked) >= 3 and len(policy.seen) >= 20  # steps under several capacities


@pytest.mark.slow
def test_dropless_dynamic_short_run(tmp_path):
    """Dropless ragged: nothing drops; a dynamic-capacity ragged run trains to the end."""
    dropless = tiny_config(moe__every=2, moe__dispatch="ragged", moe__capacity__factor=0.0)
    summary = train(dropless, tmp_path / "dropless", progress=False)
    records = [r for r in read_jsonl(tmp_path / "dropless" / "metrics.jsonl") if "loss" in r]
    assert summary.final_step == 12 and all(r["dropped_fraction"] == 0 for r in records)
    dynamic = tiny_config(
        moe__every=2,
        moe__dispatch="ragged",
        moe__capacity__policy="dynamic",
        moe__capacity__window=2,
        moe__capacity__factor=0.5,
    )
    summary = train(dynamic, tmp_path / "dynamic", progress=False)
    records = [r for r in read_jsonl(tmp_path / "dynamic" / "metrics.jsonl") if "loss" in r]
    assert summary.final_step == 12 and np.isfinite(records[-1]["loss"])


@pytest.mark.slow
def test_ragged_pipeline_equals_the_single_program(tmp_path):
    """Two pipeline stages (one MoE layer each, 2-way expert parallel inside each) on the ragged
    path: the single program's losses and drops over 3 steps, with capacities tight enough to
    drop pairs."""
    records = {}
    runs = {"single": {}, "pipe": {"pipeline__stage_layers": "1,1", "mesh__stage": 2}}
    for name, stages in runs.items():
        cfg = tiny_config(moe__every=1, moe__dispatch="ragged", moe__capacity__factor=0.75,
                          mesh__expert=2, train__steps=3, train__eval_every=1000,
                          train__checkpoint_every=1000, **stages)
        train(cfg, tmp_path / name, progress=False)
        records[name] = [r for r in read_jsonl(tmp_path / name / "metrics.jsonl") if "loss" in r]
    single, pipe = records["single"], records["pipe"]
    assert len(single) == len(pipe) == 3 and single[0]["dropped_fraction"] > 0
    for key in ("loss", "dropped_fraction"):
        np.testing.assert_allclose([r[key] for r in pipe], [r[key] for r in single], rtol=1e-5)


@pytest.mark.slow
def test_ragged_pipeline_takes_new_capacities_with_the_same_programs():
    """A capacity change within the stages' totals leaves every stage spec, so every compiled
    stage program, as it was; after the swap the stages drop what the single program drops
    under the new capacities."""
    cfg = tiny_config(moe__every=1, moe__dispatch="ragged", pipeline__stage_layers="1,1",
                      mesh__stage=2)
    exp = Experiment.from_config(cfg)
    first = exp.initial_plan()  # 20 slots per expert: a total of min(80, 32 * 2) = 64 rows
    tight = first.with_part("moe", capacities=((2, 30, 4, 28), (16, 16, 16, 16)))
    assert exp.pipeline_spec(tight) == exp.pipeline_spec(first)
    executable = exp.lower_train_step(first).compile()
    batch = exp.order.batch(0)
    drops = []
    for plan in (first, tight):  # each from the initial state
        runtime = exp.runtime(first)
        runtime.swap(plan, executable)
        metrics = runtime.host_metrics(0, jax.device_get(runtime.step(executable, batch, None)))
        drops.append(metrics["moe/dropped"])
    single = Experiment.from_config(tiny_config(moe__every=1, moe__dispatch="ragged"))
    plan = single.initial_plan().with_part("moe", capacities=capacities_of(tight))
    _, _, want = _one_step(single, plan, jax.device_get(single.init_state()), batch)
    before, after = drops
    assert after[0] > before[0]
    np.testing.assert_array_equal(after, want["moe/dropped"])


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"moe__dispatch": "grouped"}, r"moe.dispatch='grouped' is not one of"),
        ({"moe__capacity__factor": 0.0}, r"needs moe.dispatch='ragged'"),
        (
            {
                "moe__dispatch": "ragged",
                "moe__capacity__factor": -1.0,
                "moe__capacity__policy": "dynamic",
            },
            r"leaves nothing for moe.capacity.policy='dynamic'",
        ),
    ],
)
def test_bad_dispatch_config_names_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate_config(tiny_config(moe__every=1, **overrides), num_devices=8)


@pytest.mark.slow
@pytest.mark.parametrize("tile", [1, 8])
def test_grouped_ffn_tiles_and_ragged_dot_equal_per_row_reference(tile):
    """Both grouped matmuls against a per-row loop: tiles of every expert in any order, an
    empty expert and unused tiles (expert E, zero rows, output 0); gradients agree."""
    rng = np.random.default_rng(tile)
    expert = rng.choice([0, 1, 3, E], size=30)  # expert 2 gets nothing
    buf = rng.normal(size=(30, tile, D)) * (expert < E)[:, None, None]
    x = jnp.asarray(buf, jnp.float32)
    w_in = jnp.asarray(rng.normal(size=(E, D, H)) * 0.3, jnp.float32)
    w_out = jnp.asarray(rng.normal(size=(E, H, D)) * 0.3, jnp.float32)
    ref = np.zeros(buf.shape)
    for i, e in enumerate(expert):
        if e < E:
            h = buf[i] @ np.asarray(w_in[e], np.float64)
            gelu = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
            ref[i] = gelu @ np.asarray(w_out[e], np.float64)
    grads = []
    for tiles in (True, False):
        fn = lambda a, b, c, tiles=tiles: grouped_ffn(a, jnp.asarray(expert), b, c, tiles=tiles)
        np.testing.assert_allclose(
            np.asarray(jax.jit(fn)(x, w_in, w_out)), ref, rtol=1e-4, atol=1e-4
        )
        grads.append(
            jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2))(x, w_in, w_out)
        )
    for a, b in zip(*grads, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
