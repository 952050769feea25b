"""MPipeMoE's chunked MoE layer (seed 002 §III-B, §III-D; issue 12 §3): n partitions of the
dispatch groups, each its own all-to-all -> experts -> all-to-all, under every memory reuse
strategy, against the unchunked layer (outputs and gradients, with expert parallelism)."""

import contextlib
import io
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dynjax.config import validate_config
from dynjax.dynamism.moe.granularity import (
    RESTORE,
    STEP_CHUNKS,
    STEP_ROWS,
    STEP_SECONDS,
    STRATEGIES,
    AdaptiveGranularity,
    GranularityTable,
    Speeds,
    choose_reuse,
    chunks_of,
    reuse_costs,
    saved_bytes,
    workload,
)
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.model import MoE, RaggedCapacities
from dynjax.model.moe import REUSE, Chunking
from dynjax.parallel import expert_parallel, make_mesh
from dynjax.recompile import History, Plan
from dynjax.train import train
from dynjax.writers import read_jsonl

from ..tiny import tiny_config

D, H, E, K, S, G = 16, 24, 4, 2, 8, 64  # 64 groups: 8 per shard of the (2 data, 4 expert) mesh
CAPACITIES = (3, 5, 4, 6)  # tight and uneven: some pairs drop


@pytest.fixture(scope="module")
def moe():
    return MoE(D, H, E, K, out_std=0.1, rngs=nnx.Rngs(5))


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(0).normal(size=(G, S, D)).astype(np.float32)


@pytest.fixture(scope="module")
def parallel():
    return expert_parallel(make_mesh(1, 2, 4))


def loss_and_grads(moe, x, parallel, chunking, ragged=False):
    graphdef, params = nnx.split(moe)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)
    caps = RaggedCapacities(jnp.asarray(CAPACITIES), 12) if ragged else CAPACITIES

    def loss(p, v):
        y, stats = nnx.merge(graphdef, p)(v, capacities=caps, parallel=parallel, chunking=chunking)
        return jnp.sum(y * cot) + 0.1 * jnp.mean(stats.aux_loss), (y, stats.dropped)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a backend without pinned host memory says so
        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        (_, (y, dropped)), grads = fn(params, jnp.asarray(x))
    return jax.device_get((y, dropped, grads))


@pytest.fixture(scope="module")
def unchunked(moe, x, parallel):
    return {r: loss_and_grads(moe, x, parallel, None, ragged=r) for r in (False, True)}


def assert_same(a, b):
    (y1, d1, g1), (y2, d2, g2) = a, b
    np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(d1, d2)
    for u, v in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("reuse", REUSE)
@pytest.mark.parametrize("chunks", [1, 2, 4, 8])
def test_chunked_equals_unchunked_static(moe, x, parallel, unchunked, chunks, reuse):
    out = loss_and_grads(moe, x, parallel, Chunking(chunks, reuse))
    assert out[1].sum() > 0  # the capacities drop pairs: the drop rule is exercised too
    assert_same(out, unchunked[False])


@pytest.mark.parametrize("reuse", ["none", "S1", "S4"])
@pytest.mark.parametrize("chunks", [2, 8])
def test_chunked_equals_unchunked_ragged(moe, x, parallel, unchunked, chunks, reuse):
    assert_same(loss_and_grads(moe, x, parallel, Chunking(chunks, reuse), True), unchunked[True])


def test_chunks_must_divide_the_groups_per_shard(moe, x, parallel):
    with pytest.raises(ValueError, match=r"moe.chunks=3 does not divide the 8 dispatch groups"):
        loss_and_grads(moe, x, parallel, Chunking(3))


def test_bad_chunking_names_the_key():
    with pytest.raises(ValueError, match="moe.chunks=0"):
        Chunking(0)
    with pytest.raises(ValueError, match="moe.memory_reuse='S5'"):
        Chunking(2, "S5")


def _residual_names(moe, x, chunking):
    """Names of the residuals the layer's VJP keeps for the backward."""
    graphdef, params = nnx.split(moe)
    fn = lambda p, v: nnx.merge(graphdef, p)(v, capacities=CAPACITIES, chunking=chunking)[0]
    out = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(out):
        warnings.simplefilter("ignore")
        jax.ad_checkpoint.print_saved_residuals(fn, params, jnp.asarray(x[:8]))
    return out.getvalue()


@pytest.mark.parametrize("reuse", ["S1", "S2", "S3", "S4"])
def test_strategy_keeps_only_its_residuals(moe, x, reuse):
    """Table II: T_DI is offloaded (S1, S3) or dispatched again (S2, S4), T_M offloaded (S1,
    S2) or recomputed (S3, S4); the combined outputs stay; `none` keeps them all."""
    saved = _residual_names(moe, x, Chunking(2, reuse))
    # Stacked over the 2 partitions of the scan: T_DI [2, g, 1 shard, 18 slots, D] and T_M
    # [2, g, 1, C_e, H] in host memory; on device only the combined outputs (T_DI's shape)
    assert bool(re.search(rf"<host>\[2,4,1,18,{D}\]", saved)) == (reuse in ("S1", "S3"))
    assert bool(re.search(rf"<host>\[2,4,1,\d+,{H}\]", saved)) == (reuse in ("S1", "S2"))
    assert not re.search(rf"f32\[2,4,1,\d+,{H}\]", saved)
    assert saved.count(f"f32[2,4,1,18,{D}]") == 1
    assert "moe_hidden" in _residual_names(moe, x, Chunking(2, "none"))


# -- the train step: a Plan change of n recompiles and the step gives the same loss ------------


def _one_step(exp, plan, state):
    placed = exp.place_state(state)
    step = exp.lower_train_step(plan).compile()
    batch = exp.device_batch(exp.order.batch(0), plan=plan)
    return step, jax.device_get(step(placed["params"], placed["opt_state"], batch))


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["static", "ragged"])
def test_plan_change_of_chunks_recompiles_with_equal_step(dispatch):
    """2 MoE layers, (2 data, 2 expert) mesh, 2 microbatches: n = 1 against n = 2 and 4 with
    memory reuse; a different Plan is a different program, the step's loss and update equal."""
    cfg = tiny_config(
        moe__every=1, moe__dispatch=dispatch, mesh__expert=2, mesh__data=2, train__batch_size=32,
        train__microbatches=2,
    )
    exp = Experiment.from_config(cfg)
    first = exp.initial_plan()
    part = first.part("moe")  # beside its capacities and cached routing
    assert (part["chunks"], part["memory_reuse"]) == ((1, 1), "none")
    records = [dict(o)["moe"] for o in exp.layer_options(first) if "moe" in dict(o)]
    assert len(records) == 2 and all(r.chunking is None for r in records)  # the plain layer
    state = jax.device_get(exp.init_state())
    ref_step, (p0, o0, m0) = _one_step(exp, first, state)
    for chunks, reuse in ((2, "S2"), (4, "S4")):
        plan = first.with_part("moe", chunks=(chunks, chunks), memory_reuse=reuse)
        assert exp.compile_key(plan) != exp.compile_key(first)
        step, (p, o, m) = _one_step(exp, plan, state)
        assert step.as_text() != ref_step.as_text()  # a new program
        np.testing.assert_allclose(m["loss"], m0["loss"], rtol=1e-6)
        np.testing.assert_array_equal(m["moe/dropped"], m0["moe/dropped"])
        for a, b in zip(jax.tree.leaves((p, o)), jax.tree.leaves((p0, o0)), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"moe__chunks": 3}, r"moe.chunks=3 must be >= 1 and divide the 4 dispatch groups"),
        ({"moe__chunks": 0}, r"moe.chunks=0"),
        ({"moe__memory_reuse": "S5"}, r"moe.memory_reuse='S5' is not one of"),
        (
            {"moe__granularity__enabled": True, "moe__granularity__trials": 0},
            r"moe.granularity.trials",
        ),
    ],
)
def test_bad_mpipe_config_names_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate_config(tiny_config(moe__every=1, mesh__data=2, **overrides), num_devices=8)


def test_mpipe_keys_need_moe_layers():
    with pytest.raises(ConfigError, match=r"moe.chunks=2 .*needs MoE layers"):
        validate_config(tiny_config(moe__chunks=2), num_devices=8)


# -- the cost model (eq. 10, Table II) on synthetic speeds -----------------------------------

TABLE_II = {  # seed 002 Table II with H = 4M: (Q_fw, Q_bw)
    "none": ((2, 2, 0), (4, 2, 0)),
    "S1": ((2, 2, 5), (4, 2, 5)),
    "S2": ((2, 2, 4), (4, 3, 4)),
    "S3": ((2, 2, 1), (5, 2, 1)),
    "S4": ((2, 2, 0), (5, 3, 0)),
}


def test_workload_is_table_ii():
    for strategy, q in TABLE_II.items():
        assert workload(strategy, 4.0) == q


def _eq10(q, speeds, mu, eta, b, m, h):
    v = (2 * b * h * m, 4 * b * m, 4 * b * m)
    w = (speeds.comp, mu * speeds.comm, eta * speeds.mem)
    return max(qi * vi / wi if qi else 0.0 for qi, vi, wi in zip(q, v, w, strict=True))


@pytest.mark.parametrize("comp", [1e9, 1e11, 1e13])
@pytest.mark.parametrize("comm", [1e8, 1e10, 1e12])
@pytest.mark.parametrize("mem", [1e8, 1e10, 1e12])
def test_choice_follows_eq10(comp, comm, mem):
    b, m, h = 512, 64, 256
    speeds = Speeds(comp, comm, mem, mu_comp=0.9, mu_all=0.6, eta_all=0.7)
    mus = {"S1": 0.6, "S2": 0.6, "S3": 0.6, "S4": 0.9}
    cost = {
        s: sum(_eq10(q, speeds, mus[s], 0.7, b, m, h) for q in TABLE_II[s]) for s in STRATEGIES
    }
    chosen = choose_reuse(speeds, b, m, h)
    assert cost[chosen] == pytest.approx(min(cost.values()))
    assert reuse_costs(speeds, b, m, h)[chosen] == pytest.approx(cost[chosen])


def test_choice_moves_with_the_bottleneck():
    b, m, h = 512, 64, 256
    slow_net = Speeds(comp=1e12, comm=1e8, mem=1e12)  # re-communicating T_DI is dear: offload it
    assert RESTORE[choose_reuse(slow_net, b, m, h)][0] == "offload"
    slow_copy = Speeds(comp=1e12, comm=1e12, mem=1e8)  # copies are dear: restore on device
    assert choose_reuse(slow_copy, b, m, h) == "S4"
    slow_gemm = Speeds(comp=1e9, comm=1e12, mem=1e12)  # recomputing T_M is dear: offload it
    assert RESTORE[choose_reuse(slow_gemm, b, m, h)][1] == "offload"
    assert choose_reuse(Speeds(comp=1e12, comm=1e8, mem=0.0), b, m, h) == "S4"  # no host memory


def test_saved_bytes_is_eq5():
    b, m, h = 1024, 64, 256
    assert saved_bytes(b, m, h, 4) == b * (2 * m * 2 / 4 + h * 3 / 4) * 4
    assert saved_bytes(b, m, h, 2) == b * h / 2 * 4  # two buffers of T_DI, T_DO: no saving


# -- Alg. 1: the range bookkeeping and the policy on synthetic timings ------------------------


def test_table_ranges_stay_disjoint_and_grow():
    t = GranularityTable()
    assert t.lookup(100) is None
    assert t.record(100, 1) and t.record(400, 2) and t.record(200, 1)
    assert t.ranges == {1: (100, 200), 2: (400, 400)}
    assert t.lookup(150) == 1 and t.cache[150] == 1  # inside n=1's range, cached
    assert t.lookup(300) is None  # between ranges: searched
    assert t.record(800, 4) and t.record(600, 2)
    assert t.ranges == {1: (100, 200), 2: (400, 600), 4: (800, 800)}
    assert not t.record(900, 1)  # would swallow n=2's and n=4's ranges: not monotone
    assert t.ranges[1] == (100, 200) and t.lookup(900) == 1


def _history(steps):
    """(rows, chunks, seconds) per step -> the History a policy sees."""
    return History.of(
        (i, {STEP_ROWS: r, STEP_CHUNKS: n, STEP_SECONDS: s}) for i, (r, n, s) in enumerate(steps)
    )


def test_policy_searches_then_follows_ranges():
    """Synthetic step times with a best n that grows with B (n=2 at B=100, n=4 at B=400)."""
    truth = {100: {1: 1.0, 2: 0.8, 4: 0.9}, 400: {1: 4.0, 2: 3.5, 4: 3.0}}
    policy = AdaptiveGranularity((1, 2, 4), trials=2, warmup=1, d_model=16, hidden=64)
    plan = Plan().with_part("moe", capacities=((4, 4),), chunks=(1,), memory_reuse="S4")
    steps, rows, proposals = [], 100, []
    for _ in range(40):
        n = chunks_of(plan)[0]
        steps.append((rows, n, truth[rows][n] * (1 + 0.01 * len(steps) % 3)))
        proposal = policy.propose(_history(steps), plan)
        if proposal is not None:
            proposals.append(proposal)
            plan = proposal.plan
        if len(steps) == 20:
            rows = 400  # capacities grew: B moves out of every range
    decisions = [r for p in proposals for r in p.records if r["event"] == "moe_granularity"]
    assert [(d["rows"], d["chunks"]) for d in decisions] == [(100, 2), (400, 4)]
    assert decisions[0]["timed_seconds"].keys() == {"1", "2", "4"}
    assert decisions[1]["ranges"] == {"2": [100, 100], "4": [400, 400]}
    assert decisions[0]["predicted_saved_bytes_per_layer"] == 2 * saved_bytes(100, 16, 64, 2)
    checks = [r for p in proposals for r in p.records if r["event"] == "moe_granularity_check"]
    assert [(c["rows"], c["chunks"]) for c in checks] == [(100, 2), (400, 4)]
    assert chunks_of(plan) == (4,)
    # back to a B inside n=2's range: proposed at once, without trials
    proposal = policy.propose(_history([*steps, (100, 4, 0.9)]), plan)
    assert chunks_of(proposal.plan) == (2,) and proposal.records[0]["from_range"]


@pytest.mark.slow
def test_granularity_policy_runs_in_training(tmp_path):
    """Alg. 1 in a real run: it times n = 1, tries n = 2 by RECOMPILE (S4 partitions), records
    its choice and the run goes on to the end with a finite loss. A first run with n = 2 puts
    that program in the persistent cache: the steps of the tiny model are too quick to outlast
    its compile, so the search run would end before the swap."""
    keys = dict(
        moe__every=2, moe__memory_reuse="S4", train__steps=24,
        recompile__cache_dir=str(tmp_path / "jax_cache"),
    )
    train(tiny_config(moe__chunks=2, **keys), tmp_path / "warm", progress=False)
    cfg = tiny_config(
        moe__granularity__enabled=True,
        moe__granularity__max_chunks=2,
        moe__granularity__trials=2,
        moe__granularity__warmup=1,
        **keys,
    )
    summary = train(cfg, tmp_path, progress=False)
    events = read_jsonl(tmp_path / "events.jsonl")
    swaps = [e for e in events if e["event"] == "recompile"]
    decisions = [e for e in events if e["event"] == "moe_granularity"]
    assert summary.final_step == 24 and np.isfinite(summary.final_loss)
    assert any(e["plan_diff"].get("parts.moe.chunks") == [[1], [2]] for e in swaps), events
    assert decisions and decisions[0]["timed_seconds"].keys() == {"1", "2"}
    # B: 8 groups x 4 experts x 20 slots (factor 1.25) on the one device
    assert decisions[0]["memory_reuse"] == "S4" and decisions[0]["rows"] == 8 * 4 * 20


@pytest.mark.slow
def test_auto_memory_reuse_measures_and_reports(tmp_path):
    """``moe.memory_reuse="auto"``: the Plan holds the strategy eq. 10 chose on speeds measured
    here (CPU has pinned host memory: a copy speed > 0), and the first step reports it."""
    cfg = tiny_config(moe__every=2, moe__memory_reuse="auto", moe__chunks=2, train__steps=2)
    summary = train(cfg, tmp_path, progress=False)
    events = read_jsonl(tmp_path / "events.jsonl")
    (event,) = [e for e in events if e["event"] == "moe_memory_reuse"]
    assert summary.final_step == 2 and event["step"] == 0
    assert event["strategy"] in STRATEGIES and min(event["speeds"].values()) > 0
    costs = event["predicted_seconds"]
    assert costs[event["strategy"]] == min(costs[s] for s in STRATEGIES)
    speeds = Speeds(**event["speeds"])
    assert choose_reuse(speeds, event["rows_per_chunk"], 32, 64) == event["strategy"]
