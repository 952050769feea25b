"""Hash-based sparse attention: the XLA path against a dense masked NumPy reference built from the
same buckets, the budget's overflow, the block list, the smaller compiled step, the budget
policy, and the plugin in training."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynjax.config import validate_config
from dynjax.dynamism.histograms import overflow_at, smallest_budget
from dynjax.dynamism.sparse_attention import AttentionBudget
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.model.hashed_attention import (
    NEEDED_HIST,
    OVERFLOW,
    PAIR_FRACTION,
    HashedAttention,
    hashed_attention,
    lsh_buckets,
    needed_blocks,
    rotations,
)
from dynjax.recompile import Plan
from dynjax.train import train
from dynjax.writers import read_jsonl

from ..helpers import histogram, histories, qkv, sorted_blocks, train_with_warm_cache
from ..tiny import tiny_config

history = functools.partial(histories, NEEDED_HIST)  # this scheme's histograms over steps


def numpy_reference(q, k, v, record):
    """Dense attention in NumPy: a query sees the keys of its own bucket at positions not after
    its own; a query that sees none outputs zeros."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, s, h, d = q.shape
    rot = np.asarray(rotations(record, h, d), np.float64)
    bucket = lambda x: np.argmax(np.concatenate(
        [np.einsum("bshd,hdr->bshr", x, rot), -np.einsum("bshd,hdr->bshr", x, rot)], -1), -1)
    qb, kb = bucket(q), bucket(k)
    out = np.zeros_like(q)
    for i in range(b):
        for j in range(h):
            logits = q[i, :, j] @ k[i, :, j].T / np.sqrt(d)
            visible = (qb[i, :, j][:, None] == kb[i, :, j][None, :]) & np.tri(s, dtype=bool)
            logits = np.where(visible, logits, -np.inf)
            peak = np.max(logits, -1, keepdims=True)
            w = np.where(visible, np.exp(logits - np.where(np.isfinite(peak), peak, 0)), 0)
            total = w.sum(-1, keepdims=True)
            out[i, :, j] = (w / np.where(total > 0, total, 1)) @ v[i, :, j]
    return out, qb, kb


def test_lsh_buckets_are_the_argmax_of_the_rotated_vectors_and_their_negation():
    x = jax.random.normal(jax.random.key(4), (2, 16, 3, 8))
    rec = HashedAttention(buckets=6, block=4, budget=4, seed=1, layer=2)
    rot = np.asarray(rotations(rec, 3, 8))
    proj = np.einsum("bshd,hdr->bshr", np.asarray(x), rot)
    want = np.argmax(np.concatenate([proj, -proj], -1), -1)
    np.testing.assert_array_equal(lsh_buckets(x, rotations(rec, 3, 8)), want)
    assert set(np.unique(want)) <= set(range(6))
    other = rotations(HashedAttention(6, 4, 4, 1, 3), 3, 8)  # another layer: other rotations
    assert not np.allclose(rot, other)


@pytest.mark.parametrize(
    "s, block, buckets, heads", [(64, 8, 4, 2), (96, 16, 8, 1), (128, 32, 2, 3), (64, 16, 16, 2)]
)
def test_an_ample_budget_equals_the_dense_masked_reference(s, block, buckets, heads):
    q, k, v = qkv(2, s, heads, 8, seed=s + buckets)
    rec = HashedAttention(buckets, block, s // block, seed=0, layer=1)
    y, metrics = hashed_attention(q, k, v, rec)
    want, _, _ = numpy_reference(q, k, v, rec)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert float(metrics[OVERFLOW]) == 0.0
    assert float(metrics[NEEDED_HIST].sum()) == 2 * heads * (s // block)


@pytest.mark.slow
@settings(max_examples=10, deadline=None, derandomize=True)  # the same examples in every CI
@given(
    blocks=st.integers(2, 8),
    block=st.sampled_from([4, 8, 16]),
    buckets=st.sampled_from([2, 4, 6, 8, 16]),
    heads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_any_ample_budget_equals_the_dense_masked_reference(blocks, block, buckets, heads, seed):
    """Lengths, block sizes, bucket counts and heads drawn at random (hypothesis)."""
    s = blocks * block
    q, k, v = qkv(1, s, heads, 8, seed=seed)
    rec = HashedAttention(buckets, block, blocks, seed=seed % 7, layer=seed % 5)
    y, metrics = hashed_attention(q, k, v, rec)
    want, _, _ = numpy_reference(q, k, v, rec)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert float(metrics[OVERFLOW]) == 0.0


def test_gradients_equal_the_dense_masked_reference_in_jax():
    q, k, v = qkv(2, 64, 2, 8, seed=7)
    rec = HashedAttention(4, 8, 8, seed=0, layer=0)
    rot = rotations(rec, 2, 8)
    qb, kb = lsh_buckets(q, rot), lsh_buckets(k, rot)  # fixed: buckets carry no gradient

    def reference(q, k, v):
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(8.0)
        visible = (jnp.moveaxis(qb, 1, 2)[..., :, None] == jnp.moveaxis(kb, 1, 2)[..., None, :])
        visible &= jnp.tril(jnp.ones((64, 64), bool))
        logits = jnp.where(visible, logits, -1e30)
        peak = jax.lax.stop_gradient(logits.max(-1, keepdims=True))
        w = jnp.where(visible, jnp.exp(logits - peak), 0)
        total = w.sum(-1, keepdims=True)
        return jnp.einsum("bhqk,bkhd->bqhd", w / jnp.where(total > 0, total, 1), v)

    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    got = jax.grad(loss(lambda *a: hashed_attention(*a, rec)[0]), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        assert float(jnp.abs(w).max()) > 0
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_the_block_list_skips_only_blocks_without_a_visible_pair():
    q, k, _ = qkv(2, 128, 2, 8, seed=3)
    rec = HashedAttention(8, 16, 8, seed=0, layer=0)
    qb, qp, kb, kp = sorted_blocks(q, k, rec)
    need = np.asarray(needed_blocks(*(jnp.asarray(a) for a in (qb, qp, kb, kp)), 16))
    nb = 8
    pairs = (qb[..., :, None] == kb[..., None, :]) & (kp[..., None, :] <= qp[..., :, None])
    real = pairs.reshape(2, 2, nb, 16, nb, 16).any(axis=(3, 5))  # block pairs with work
    assert np.all(need[real])  # never skips a block with a visible pair
    assert need.sum() < nb * nb * 4  # and does skip: blocks that cannot match
    # What it keeps beyond the real ones is only what ranges cannot rule out.
    assert need.sum() <= 1.5 * real.sum()


def test_a_tight_budget_drops_and_counts_exactly_the_blocks_beyond_it():
    q, k, v = qkv(1, 128, 2, 8, seed=5)
    full = HashedAttention(4, 16, 8, seed=0, layer=0)
    want, _, _ = numpy_reference(q, k, v, full)
    qb, qp, kb, kp = sorted_blocks(q, k, full)
    need = np.asarray(needed_blocks(*(jnp.asarray(a) for a in (qb, qp, kb, kp)), 16))
    counts = need.sum(-1)  # [B, H, nb]
    budget = int(np.median(counts))
    y, metrics = hashed_attention(q, k, v, HashedAttention(4, 16, budget, seed=0, layer=0))
    dropped = np.maximum(counts - budget, 0).sum() / counts.sum()
    assert dropped > 0
    np.testing.assert_allclose(float(metrics[OVERFLOW]), dropped, rtol=1e-6)
    np.testing.assert_allclose(float(metrics[PAIR_FRACTION]), counts.sum() / (2 * 8 * 9 / 2))
    hist = np.bincount(counts.reshape(-1), minlength=9)
    np.testing.assert_array_equal(metrics[NEEDED_HIST], hist)
    # Query blocks within their budget are exact; the others lost needed blocks.
    y = np.asarray(y)
    for h in range(2):
        for blk in np.flatnonzero(counts[0, h] <= budget):
            rows = qp[0, h, blk * 16 : (blk + 1) * 16]
            np.testing.assert_allclose(y[0, rows, h], want[0, rows, h], rtol=1e-5, atol=1e-5)
    assert not np.allclose(y, want, rtol=1e-5, atol=1e-5)


def sa_config(**overrides):
    base = dict(sparse_attention__enabled=True, data__seq_len=128, sparse_attention__block=16,
                sparse_attention__buckets=4, model__num_layers=2)
    return tiny_config(**{**base, **overrides})


def step_flops(plan_budgets=None, **overrides):
    exp = Experiment.from_config(sa_config(**overrides))
    plan = exp.initial_plan()
    if plan_budgets is not None:
        plan = plan.with_part("sparse_attention", budgets=plan_budgets)
    return exp.lower_train_step(plan).compile().cost_analysis()["flops"]


@pytest.mark.slow
def test_the_budget_shrinks_the_compiled_step():
    dense = Experiment.from_config(tiny_config(data__seq_len=128, model__num_layers=2))
    dense_flops = dense.lower_train_step(dense.initial_plan()).compile().cost_analysis()["flops"]
    flops = {b: step_flops((b, b)) for b in (8, 4, 2)}
    assert flops[2] < flops[4] < flops[8]
    assert flops[2] < 0.8 * dense_flops, (flops, dense_flops)


def test_budget_policy_shrinks_grows_and_holds_within_hysteresis():
    policy = AttentionBudget(num_blocks=8, max_overflow=0.0, window=4, headroom=0.0,
                             hysteresis=0.25)
    plan = Plan().with_part("sparse_attention", budgets=(8, 8))
    proposal = policy.propose(history([[1, 2, 2, 3], [3, 3, 3, 3]]), plan)
    assert proposal.plan.part("sparse_attention")["budgets"] == (3, 3)
    assert proposal.records[0]["event"] == "attention_budget"
    shrunk = proposal.plan
    assert policy.propose(history([[1, 2, 2, 3], [3, 3, 3, 3]]), shrunk) is None
    # Overflow grows the budget at once...
    grown = policy.propose(history([[5, 5, 1, 1], [3, 3, 3, 3]]), shrunk)
    assert grown.plan.part("sparse_attention")["budgets"] == (5, 3)
    # ...but a small shrink (3 -> 3 * 0.8) is noise: kept.
    assert policy.propose(history([[1, 2, 2, 3], [1, 1, 1, 1]], steps=4), shrunk).plan.part(
        "sparse_attention")["budgets"] == (3, 1)
    assert policy.propose(history([[1, 2], [3, 3]], steps=3), plan) is None  # window not full


def test_overflow_and_smallest_budget_follow_the_histogram():
    hist = histogram(np.array([1, 2, 2, 4]))
    assert overflow_at(hist, 4) == 0 and overflow_at(hist, 2) == pytest.approx(2 / 9)
    assert smallest_budget(hist, 0.0) == 4 and smallest_budget(hist, 0.25) == 2


@pytest.mark.parametrize(
    "overrides, key",
    [
        (dict(sparse_attention__buckets=3), "sparse_attention.buckets"),
        (dict(sparse_attention__block=24), "sparse_attention.block"),
        (dict(sparse_attention__block=128), "sparse_attention.block"),
        (dict(sparse_attention__max_overflow=1.0), "sparse_attention.max_overflow"),
        (dict(sparse_attention__window=0), "sparse_attention.window"),
        (dict(mod__enabled=True, model__num_layers=4), "mod.enabled"),
    ],
)
def test_bad_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_config(sa_config(**overrides), 8)


@pytest.mark.slow
def test_training_shrinks_the_budgets_in_the_background_and_stays_close_to_dense(tmp_path):
    settings = dict(train__eval_every=200, sparse_attention__window=4,
                    sparse_attention__buckets=8, sparse_attention__max_overflow=0.02,
                    sparse_attention__headroom=0.0, train__checkpoint_every=100,
                    train__log_every=10)
    config = sa_config(train__steps=200, **settings)
    # The first run fills the compilation cache with the budgets the policy picks, so the
    # second one swaps them in within a few steps even on busy cores.
    workdir, summary = train_with_warm_cache(config, tmp_path)
    events = read_jsonl(workdir / "events.jsonl")
    budgets = [e for e in events if e["event"] == "attention_budget"]
    assert budgets and budgets[0]["old"] == [8, 8] and max(budgets[0]["new"]) < 8
    assert summary.recompiles >= 1
    rows = read_jsonl(workdir / "metrics.jsonl")
    overflow = [r[OVERFLOW] for r in rows if OVERFLOW in r]
    assert len(overflow) >= 19 and np.median(np.asarray(overflow)[-5:]) <= 0.05
    costs = read_jsonl(workdir / "layer_costs.jsonl")
    assert min(costs[-1]["layer_cost"]) < 1.0
    # Close to dense: the same run with dense attention reaches an eval loss of 1.96, this one
    # 2.01-2.02; attention that sees no other position gives 2.13, a mask that lets a query see
    # later positions 0.97.
    dense = train(sa_config(train__steps=200, sparse_attention__enabled=False, **settings),
                  tmp_path / "dense", progress=False)
    assert abs(summary.eval_loss - dense.eval_loss) < 0.1, (summary.eval_loss, dense.eval_loss)
    # A resume keeps the budgets the policy chose.
    resumed = train(sa_config(train__steps=201, **settings), workdir, progress=False)
    compile_event = [e for e in read_jsonl(workdir / "events.jsonl")
                     if e["event"] == "compile"][-1]
    assert resumed.start_step == 200
    swaps = [e for e in events if e["event"] == "recompile"]
    saved = [e for e in budgets if e["step"] <= swaps[-1]["step"]][-1]["new"]
    assert compile_event["plan"]["parts"]["sparse_attention"]["budgets"] == saved


@pytest.mark.slow
def test_a_pipeline_equals_one_program_with_the_same_budgets(tmp_path):
    base = dict(train__steps=6, train__microbatches=2, sparse_attention__window=1000,
                pipeline__profile_on_change=False, train__checkpoint_every=100)
    train(sa_config(**base), tmp_path / "one", progress=False)
    train(sa_config(**base, mesh__stage=2, pipeline__stage_layers="(1,1)"), tmp_path / "two",
          progress=False)
    loss = lambda d: [r["loss"] for r in read_jsonl(tmp_path / d / "metrics.jsonl") if "loss" in r]
    np.testing.assert_allclose(loss("two"), loss("one"), rtol=1e-4)
