"""Gradual global magnitude pruning math (seed 000 §3.2 Alg. 1, eq. 3): the cubic schedule, the
default name filter on the real model, scores, and exact distributed global top-k against a
single-device NumPy top-k with the same tie rule."""

import doctest
import re
import threading

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynjax.dynamism import pruning_math as pm
from dynjax.parallel.peers import Rounds

from ..helpers import Store

PAPER = dict(initial=0.0, final=0.9, start=3000, every=1000, steps=4)


def test_docstring_examples():
    result = doctest.testmod(pm)
    assert result.attempted > 0 and result.failed == 0


# --- schedule ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "step, expected",
    [
        (0, 0.0),  # before t0: dense
        (2999, 0.0),
        (3000, 0.0),  # t0: S_i
        (3999, 0.0),  # held until the next event
        (4000, 0.9 * (1 - (3 / 4) ** 3)),  # 0.5203125
        (4999, 0.9 * (1 - (3 / 4) ** 3)),
        (5000, 0.9 * (1 - (2 / 4) ** 3)),  # 0.7875
        (6000, 0.9 * (1 - (1 / 4) ** 3)),  # 0.8859375
        (6999, 0.9 * (1 - (1 / 4) ** 3)),
        (7000, 0.9),  # t0 + nΔt: S_f
        (10**7, 0.9),
    ],
)
def test_schedule_table_of_the_papers_run(step, expected):
    assert pm.sparsity_at(step, **PAPER) == pytest.approx(expected, abs=1e-15)


def test_schedule_ends_are_exact_and_values_follow_eq3():
    kw = dict(initial=0.3, final=0.7, start=10, every=5, steps=3)
    assert pm.sparsity_at(9, **kw) == 0.0
    assert pm.sparsity_at(10, **kw) == 0.3  # exactly S_i at t0
    assert pm.sparsity_at(25, **kw) == 0.7  # exactly S_f at t0 + nΔt
    assert pm.sparsity_at(26, **kw) == 0.7
    for t in (10, 15, 20, 25):
        eq3 = 0.7 + (0.3 - 0.7) * (1 - (t - 10) / (3 * 5)) ** 3
        assert pm.sparsity_at(t, **kw) == pytest.approx(eq3, abs=1e-15)
        assert pm.sparsity_at(t + 4, **kw) == pm.sparsity_at(t, **kw)


def test_pruning_steps_are_t0_to_t0_plus_n_every():
    events = [t for t in range(0, 9000) if pm.is_pruning_step(t, start=3000, every=1000, steps=4)]
    assert events == [3000, 4000, 5000, 6000, 7000]


@pytest.mark.parametrize(
    "kw",
    [
        dict(initial=0.0, final=0.9, start=0, every=0, steps=1),
        dict(initial=0.0, final=0.9, start=0, every=1, steps=0),
        dict(initial=0.0, final=0.9, start=-1, every=1, steps=1),
        dict(initial=0.5, final=0.4, start=0, every=1, steps=1),
        dict(initial=0.0, final=1.5, start=0, every=1, steps=1),
    ],
)
def test_schedule_rejects_bad_settings(kw):
    with pytest.raises(ValueError):
        pm.sparsity_at(0, **kw)


def test_keep_count_rounds_to_nearest():
    assert pm.keep_count(100, 0.9) == 10  # (1 - 0.9) * 100 = 9.999...
    assert pm.keep_count(7, 0.0) == 7
    assert pm.keep_count(7, 1.0) == 0
    assert pm.keep_count(3, 0.5) == 2  # 1.5 -> 2 (ties to even)
    assert pm.keep_count(5, 0.5) == 2  # 2.5 -> 2


# --- which weights -------------------------------------------------------------------------------


def test_default_filter_selects_exactly_the_matrices_of_the_real_model(tiny):
    from dynjax.config import gpt_config
    from dynjax.model import fresh_params

    cfg = tiny(moe__every=2, model__positions="learned")  # layer 1 is MoE; learned `pos` exists
    params = fresh_params(gpt_config(cfg), seed=0)
    kept = pm.prunable_leaves(params)
    assert list(kept) == [
        "layers/0/attn/out/kernel",
        "layers/0/attn/qkv/kernel",
        "layers/0/mlp/down/kernel",
        "layers/0/mlp/up/kernel",
        "layers/1/attn/out/kernel",
        "layers/1/attn/qkv/kernel",
        "layers/1/moe/w_in",
        "layers/1/moe/w_out",
    ]
    every = [
        jax.tree_util.keystr(p, simple=True, separator="/")
        for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    ]
    left_out = set(every) - set(kept)
    assert {"pos", "embed/embedding", "head/kernel", "layers/1/moe/router"} <= left_out
    assert all(re.search(r"^(embed|pos|head)|norm|bias$|router$", n) for n in left_out)
    assert list(pm.prunable_leaves(params, "moe/w_")) == ["layers/1/moe/w_in", "layers/1/moe/w_out"]


def test_filter_applies_to_stage_local_paths():
    assert pm.prunable("3/attn/qkv/kernel") and pm.prunable("moe/w_out")
    assert not pm.prunable("layers/0/attn/qkv/bias")
    assert not pm.prunable("layers/0/moe/w_in_scale")


# --- scores --------------------------------------------------------------------------------------


def test_block_scores_are_per_expert_frobenius_norms():
    w = np.random.default_rng(0).normal(size=(3, 8, 12)).astype(np.float32)
    got = np.asarray(pm.block_scores(w, 4))
    ref = np.sqrt((w.reshape(3, 2, 4, 3, 4) ** 2).sum(axis=(2, 4)))
    assert got.shape == (3, 2, 3)
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    mask = np.zeros((3, 2, 3), bool)
    mask[1, 0, 2] = True
    np.testing.assert_array_equal(np.asarray(pm.block_scores(w, 4, mask)) > 0, mask)
    with pytest.raises(ValueError):
        pm.block_scores(w, 5)


def test_expand_blocks_covers_each_block():
    bm = np.array([[[True, False], [False, True]]])
    em = np.asarray(pm.expand_blocks(bm, 3))
    assert em.shape == (1, 6, 6)
    np.testing.assert_array_equal(em, np.kron(bm[0], np.ones((3, 3), bool))[None])


def test_element_scores_zero_the_pruned_entries():
    w = np.array([-3.0, 2.0, -1.0], np.float32)
    np.testing.assert_array_equal(pm.element_scores(w), [3.0, 2.0, 1.0])
    np.testing.assert_array_equal(pm.element_scores(w, np.array([True, False, True])), [3, 0, 1])


# --- exact global selection ----------------------------------------------------------------------


def reference_masks(stage_scores, keep):
    """Single-device global top-k: concatenate everything in global order, stable sort by score."""
    flat = [np.asarray(a, np.float32).ravel() for s in stage_scores for a in s.values()]
    allv = np.concatenate(flat) if flat else np.zeros(0, np.float32)
    order = np.lexsort((np.arange(allv.size), -allv))  # score descending, then global index
    kept = np.zeros(allv.size, bool)
    kept[order[:keep]] = True
    out, i = [], 0
    for s in stage_scores:
        out.append({})
        for name, a in s.items():
            n = int(np.prod(a.shape))
            out[-1][name] = kept[i : i + n].reshape(a.shape)
            i += n
    return out


def on_devices(stage_arrays):
    """Stage s's arrays committed to device s, as on a pipeline."""
    return [
        {n: jax.device_put(a, jax.devices()[s]) for n, a in arrays.items()}
        for s, arrays in enumerate(stage_arrays)
    ]


def assert_same(got, want, stage_scores):
    assert len(got) == len(want)
    for s, (g, w, sc) in enumerate(zip(got, want, stage_scores, strict=True)):
        assert list(g) == list(w)
        for name in w:
            assert g[name].devices() == sc[name].devices(), (s, name)
            np.testing.assert_array_equal(np.asarray(g[name]), w[name], err_msg=f"{s}/{name}")


def test_ties_are_broken_in_global_order():
    # global order: a[0], a[1], a[2], b[0, 0], b[0, 1], b[1, 0], b[1, 1]; -0.0 counts as 0
    stages = on_devices(
        [
            {"a": np.array([1.0, 2.0, 2.0], np.float32)},
            {"b": np.array([[-0.0, 2.0], [2.0, 3.0]], np.float32)},
        ]
    )
    for keep, want_a, want_b in [
        (0, [0, 0, 0], [[0, 0], [0, 0]]),
        (1, [0, 0, 0], [[0, 0], [0, 1]]),
        (2, [0, 1, 0], [[0, 0], [0, 1]]),
        (4, [0, 1, 1], [[0, 1], [0, 1]]),
        (5, [0, 1, 1], [[0, 1], [1, 1]]),
        (6, [1, 1, 1], [[0, 1], [1, 1]]),
        (7, [1, 1, 1], [[1, 1], [1, 1]]),
    ]:
        a, b = (pm.global_masks(stages, keep)[s][n] for s, n in ((0, "a"), (1, "b")))
        np.testing.assert_array_equal(np.asarray(a), np.array(want_a, bool), err_msg=str(keep))
        np.testing.assert_array_equal(np.asarray(b), np.array(want_b, bool), err_msg=str(keep))


def test_global_not_per_layer():
    stages = on_devices(
        [
            {"big": np.arange(1, 11, dtype=np.float32)},
            {"small": np.arange(1, 11, dtype=np.float32) / 100},
        ]
    )
    masks = pm.global_masks(stages, pm.keep_count(20, 0.5))
    assert np.asarray(masks[0]["big"]).all() and not np.asarray(masks[1]["small"]).any()


def over_processes(stages, owners, keep):
    """`global_masks` with ``stages`` held by thread 'processes' (``owners[p]``: process p's
    stages, in order), each counting its own and exchanging through an in-memory store with
    the coordinator's semantics; every stage's masks in stage order, and each process's
    exchanges."""
    store = Store(len(owners))
    got, rounds = [None] * len(owners), [None] * len(owners)

    def process(p):
        rounds[p] = Rounds(store.peers(p), "prune")
        got[p] = pm.global_masks([stages[s] for s in owners[p]], keep, rounds[p])

    threads = [threading.Thread(target=process, args=(p,)) for p in range(len(owners))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(g is not None for g in got)
    return [m for part in got for m in part], [r.rounds for r in rounds]


@pytest.mark.parametrize(
    "owners", [[[0], [1, 2, 3]], [[0, 1], [2, 3]], [[0], [], [1, 2], [3]], [[], [0, 1, 2, 3]]]
)
def test_stages_over_processes_select_as_one_process(owners):
    """A pipeline over processes: each process counts its own stages and the counts of every
    bisection round are summed through the peers, so the masks are the single-device top-k
    with the global tie rule (ties across the processes' boundary included), a process with
    no stage taking part; about 33 exchanges of a few bytes each."""
    rng = np.random.default_rng(0)
    shapes = [{"a": (3, 4)}, {"b": (5,), "c": (2, 2)}, {}, {"d": (6,)}]
    stages = [{n: rng.integers(0, 4, s).astype(np.float32) for n, s in sh.items()}
              for sh in shapes]  # few values: ties everywhere
    placed = on_devices(stages)
    total = sum(a.size for s in stages for a in s.values())
    for keep in (0, 1, 7, total // 2, total - 1, total):
        got, exchanges = over_processes(placed, owners, keep)
        assert_same(got, reference_masks(stages, keep), placed)
        assert len(set(exchanges)) == 1 and exchanges[0] <= 34


DIMS = st.sampled_from([1, 3, 8])
SCORES = {
    "ties": st.integers(0, 3).map(float),
    "floats": st.floats(0, 10, width=32, allow_subnormal=True),  # subnormals must stay exact
}


@st.composite
def element_case(draw):
    n_stages = draw(st.sampled_from([1, 4]))
    scores = SCORES[draw(st.sampled_from(list(SCORES)))]
    stages = []
    for s in range(n_stages):
        arrays = {}
        for j in range(draw(st.integers(0 if n_stages > 1 else 1, 3))):
            shape = tuple(draw(st.lists(DIMS, min_size=1, max_size=3)))
            vals = draw(
                st.lists(scores, min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))
            )
            arrays[f"s{s}/w{j}"] = np.array(vals, np.float32).reshape(shape)
        stages.append(arrays)
    total = sum(a.size for s in stages for a in s.values())
    keep = draw(st.one_of(st.just(0), st.just(total), st.integers(0, total)))
    return stages, keep


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(element_case())
def test_element_masks_equal_single_device_topk(case):
    stages, keep = case
    placed = on_devices(stages)
    got = pm.global_masks(placed, keep)
    assert_same(got, reference_masks(stages, keep), placed)
    assert sum(int(np.asarray(m).sum()) for s in got for m in s.values()) == keep


@st.composite
def block_case(draw):
    bs = draw(st.sampled_from([1, 2, 4]))
    n_stages = draw(st.sampled_from([1, 4]))
    stages = []
    for s in range(n_stages):
        arrays = {}
        for j in range(draw(st.integers(1, 2))):
            lead = draw(st.sampled_from([(), (3,)]))  # expert weights: [E, in, out]
            shape = (*lead, bs * draw(st.integers(1, 3)), bs * draw(st.integers(1, 3)))
            seed = draw(st.integers(0, 2**31))
            ints = np.random.default_rng(seed).integers(-2, 3, size=shape)  # tied block norms
            arrays[f"s{s}/w{j}"] = ints.astype(np.float32)
        stages.append(arrays)
    sparsity = draw(st.sampled_from([0.0, 0.3, 0.5, 0.9, 1.0]))
    return bs, stages, sparsity


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(block_case())
def test_block_masks_equal_single_device_topk(case):
    bs, stages, sparsity = case
    placed = on_devices(stages)
    scores = [{n: pm.block_scores(w, bs) for n, w in s.items()} for s in placed]
    n_blocks = sum(int(np.prod(a.shape)) for s in scores for a in s.values())
    keep = pm.keep_count(n_blocks, sparsity)
    got = [
        {n: pm.expand_blocks(m, bs) for n, m in s.items()} for s in pm.global_masks(scores, keep)
    ]

    def np_block_norms(w):
        *lead, k, n = w.shape
        return np.sqrt((w.reshape(*lead, k // bs, bs, n // bs, bs) ** 2).sum(axis=(-3, -1)))

    ref_scores = [{n: np_block_norms(w) for n, w in s.items()} for s in stages]
    want = [
        {n: np.repeat(np.repeat(m, bs, -2), bs, -1) for n, m in s.items()}
        for s in reference_masks(ref_scores, keep)
    ]
    assert_same(got, want, placed)


def test_only_count_vectors_reach_the_host(monkeypatch):
    rng = np.random.default_rng(1)
    stages = [
        {f"l{s}/{k}": rng.normal(size=(16, 24)).astype(np.float32) for k in "ab"} for s in range(4)
    ]
    placed = on_devices(stages)
    fetched = []
    real_fetch = pm._fetch

    def spy(arrays):
        fetched.append([a.shape for a in arrays])
        return real_fetch(arrays)

    monkeypatch.setattr(pm, "_fetch", spy)
    scores = [{n: pm.element_scores(w) for n, w in s.items()} for s in placed]
    keep = pm.keep_count(4 * 2 * 16 * 24, 0.8)
    with jax.transfer_guard_device_to_device("disallow"):  # nothing moves between stages
        got = pm.global_masks(scores, keep)
    assert 30 <= len(fetched) <= 33  # bisection rounds + the ties round
    assert all(shapes == [(2,)] * 4 for shapes in fetched)  # one count per array per stage
    assert_same(
        got, reference_masks([{n: np.abs(w) for n, w in s.items()} for s in stages], keep), placed
    )


def test_current_mask_keeps_pruning_nested():
    rng = np.random.default_rng(2)
    w = rng.normal(size=(4, 64)).astype(np.float32)
    old = pm.global_masks([{"w": pm.element_scores(w)}], 128)[0]["w"]
    stale = w * 10  # pruned entries that still hold (large) values are not revived
    new = pm.global_masks([{"w": pm.element_scores(stale, old)}], 64)[0]["w"]
    assert not np.asarray(new & ~old).any() and int(np.asarray(new).sum()) == 64
