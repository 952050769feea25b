"""Early exit: the bucketed layers against a token-by-token reference, exited tokens untouched by
later layers, forced exits, the smaller compiled step, the bucket policy, the config checks and
the plugin in training."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dynjax.config import gpt_config, validate_config
from dynjax.dynamism.early_exit import EarlyExit, ExitBuckets, exit_layers, exit_weights
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.model import GPT
from dynjax.model.attention import CausalSelfAttention
from dynjax.model.early_exit import (
    EXIT_CE,
    EXITED,
    FORCED,
    LOSS,
    NAME,
    NEEDED_HIST,
    PROCESSED,
    ExitLayer,
    confidence,
)
from dynjax.recompile import Plan
from dynjax.writers import read_jsonl

from ..helpers import histories, train_with_warm_cache
from ..tiny import tiny_config

S, L = 16, 4

history = functools.partial(histories, NEEDED_HIST)  # this scheme's histograms over steps


def ee_config(**overrides):
    base = dict(early_exit__enabled=True, early_exit__first=1, early_exit__every=1,
                early_exit__start_step=0, model__num_layers=L, data__seq_len=S)
    return tiny_config(**{**base, **overrides})


def model_and_batch(seed=0, batch=3, **overrides):
    cfg = ee_config(**overrides)
    model = GPT(gpt_config(cfg), rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, model.cfg.vocab_size, (batch, S + 1)), jnp.int32)
    return model, cfg, tokens[:, :-1], tokens[:, 1:]


def records(cfg, tokens, threshold, measure="softmax_max", active=True):
    """Each layer's record: exit points after the layers of `exit_layers`."""
    e, layers = EarlyExit.read(cfg.early_exit), cfg.model.num_layers
    weights = dict(zip(exit_layers(e, layers), exit_weights(e, layers), strict=True))
    first = exit_layers(e, layers)[0]
    return tuple(
        () if i < first else ((NAME, ExitLayer(tokens[i], weights.get(i, 0.0), measure,
                                               threshold, active)),)
        for i in range(cfg.model.num_layers)
    )


def token_by_token(model, cfg, inputs, targets, threshold, measure="softmax_max", tokens=None):
    """CALM one token at a time: each token runs up the layers, each layer's attention over the
    states that the tokens before it (and itself) entered that layer with, so an exited token's
    frozen state is what later tokens attend to. A token exits at an exit point when confident
    and is forced out at a layer whose bucket already holds ``tokens[l]`` remaining tokens of
    its sequence before it. Returns the final states, each exit's (ce sum, count), the forced
    counts per layer and [L, B, S] which tokens each layer computed."""
    x0 = np.asarray(model.embed(inputs))
    b, s, d = x0.shape
    exits = set(exit_layers(EarlyExit.read(cfg.early_exit), cfg.model.num_layers))
    entering = np.zeros((L, b, s, d), np.float32)
    alive_at = np.zeros((L, b, s), bool)  # remaining (not exited, not forced) inside layer l
    final = np.zeros_like(x0)
    ce_sums = {e: np.zeros(2) for e in exits}
    forced = np.zeros(L, int)
    for t in range(s):
        h, alive = x0[:, t].copy(), np.ones(b, bool)
        for layer in range(L):
            entering[layer, :, t] = h
            if tokens is not None:
                before = alive_at[layer, :, :t].sum(axis=1)
                over = alive & (before >= tokens[layer])
                forced[layer] += over.sum()
                alive &= ~over
            alive_at[layer, :, t] = alive
            out, _, _ = model.layers[layer](jnp.asarray(entering[layer, :, : t + 1]))
            new = np.asarray(out[:, t])
            prev, h = h, np.where(alive[:, None], new, h)
            if layer in exits:
                logits = model.readout(jnp.asarray(h))
                ce = np.asarray(optax.softmax_cross_entropy_with_integer_labels(
                    logits, targets[:, t]))
                ce_sums[layer] += [np.sum(ce * alive), alive.sum()]
                conf = np.asarray(confidence(measure, jnp.asarray(prev), jnp.asarray(h), logits))
                alive &= ~(conf >= threshold)
        final[:, t] = h
    return final, ce_sums, forced, alive_at


def exit_threshold(model, cfg, inputs, measure="softmax_max"):
    """The median confidence at the first exit point: about half the tokens exit there."""
    x = model.embed(inputs)
    for layer in range(exit_layers(EarlyExit.read(cfg.early_exit), cfg.model.num_layers)[0] + 1):
        prev, (x, _, _) = x, model.layers[layer](x)
    return float(np.median(confidence(measure, prev, x, model.readout(x))))


def test_queries_of_a_subset_against_the_whole_sequence_equal_full_attention_gathered():
    attn = CausalSelfAttention(32, 2, rope=True, out_std=0.02, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, S, 32))
    chosen = jnp.array([[0, 3, 4, 9, 15], [2, 5, 6, 14, 15]])
    full, _ = attn(x)
    subset, _ = attn(jnp.take_along_axis(x, chosen[..., None], axis=1), positions=chosen,
                     context=x)
    np.testing.assert_allclose(subset, jnp.take_along_axis(full, chosen[..., None], axis=1),
                               rtol=2e-5, atol=2e-6)


@pytest.mark.slow
@pytest.mark.parametrize("measure", ["softmax_max", "state"])
@pytest.mark.parametrize("bucketed", [False, True])
def test_early_exit_equals_a_token_by_token_reference(measure, bucketed):
    model, cfg, inputs, targets = model_and_batch()
    threshold = exit_threshold(model, cfg, inputs, measure)
    final, ce_sums, forced, alive = token_by_token(model, cfg, inputs, targets, threshold,
                                                   measure)
    assert not forced.any()
    # Bucketed: the smallest buckets holding every sequence's remaining tokens (the gather
    # path, exact); else every layer computes the whole sequence.
    tokens = [S] + [int(a.sum(axis=1).max()) for a in alive[1:]] if bucketed else [S] * L
    logits, _, metrics = model.forward(
        inputs, options=records(cfg, tokens, threshold, measure), targets=targets)
    np.testing.assert_allclose(logits, model.readout(jnp.asarray(final)), rtol=1e-4, atol=1e-4)
    e = EarlyExit.read(cfg.early_exit)
    for j, layer in enumerate(exit_layers(e, cfg.model.num_layers)):
        total, count = ce_sums[layer]
        np.testing.assert_allclose(metrics[layer][EXIT_CE], total / count, rtol=1e-5)
        assert float(metrics[layer][LOSS]) == pytest.approx(
            exit_weights(e, cfg.model.num_layers)[j] * total / count, rel=1e-5)
    assert 0 < float(metrics[0][EXITED]) < 1  # about half exit at the first point
    assert all(float(m[FORCED]) == 0 for m in metrics)
    for layer, m in enumerate(metrics):
        assert float(m[PROCESSED]) == pytest.approx(alive[layer].mean(), abs=1e-6)
    if bucketed:
        assert min(tokens) < S  # the gather path ran


def test_tokens_beyond_a_bucket_are_forced_out_and_counted_as_the_reference_does():
    model, cfg, inputs, targets = model_and_batch(1)
    threshold = exit_threshold(model, cfg, inputs)
    tokens = [S, 6, 4, 3]
    final, ce_sums, forced, alive = token_by_token(model, cfg, inputs, targets, threshold,
                                                   tokens=tokens)
    assert forced[1:].sum() > 0
    logits, _, metrics = model.forward(inputs, options=records(cfg, tokens, threshold),
                                       targets=targets)
    np.testing.assert_allclose(logits, model.readout(jnp.asarray(final)), rtol=1e-4, atol=1e-4)
    assert [float(m[FORCED]) for m in metrics] == forced.tolist()
    for layer in exit_layers(EarlyExit.read(cfg.early_exit), cfg.model.num_layers):
        total, count = ce_sums[layer]
        np.testing.assert_allclose(metrics[layer][EXIT_CE], total / count, rtol=1e-5)
    # The processed share: the tokens each layer computed for real, of all tokens.
    for layer, m in enumerate(metrics):
        assert float(m[PROCESSED]) == pytest.approx(alive[layer].mean(), abs=1e-6)


@pytest.mark.slow
def test_an_exited_token_gives_later_layers_no_gradient():
    model, cfg, inputs, targets = model_and_batch(2, batch=1)
    threshold = exit_threshold(model, cfg, inputs)
    opts = records(cfg, [S, 12, 12, 12], threshold)
    graphdef, state = nnx.split(model)
    _, _, metrics = model.forward(inputs, options=opts, targets=targets)
    first = exit_layers(EarlyExit.read(cfg.early_exit), cfg.model.num_layers)[0]
    x = model.layers[first](model.embed(inputs))[0]
    conf = np.asarray(jnp.max(jax.nn.softmax(model.readout(x), -1), -1))[0]
    exited, stayed = int(np.argmax(conf >= threshold)), int(np.argmin(conf >= threshold))
    assert conf[exited] >= threshold > conf[stayed]

    def token_loss(state, t):
        logits, _, _ = nnx.merge(graphdef, state).forward(inputs, options=opts, targets=targets)
        return optax.softmax_cross_entropy_with_integer_labels(logits[0, t], targets[0, t])

    for t, later_zero in ((exited, True), (stayed, False)):
        grads = nnx.to_pure_dict(jax.grad(token_loss)(state, t))["layers"]
        later = sum(float(optax.tree.norm(grads[i])) for i in range(first + 1, L))
        assert (later == 0.0) is later_zero, (t, later)
        assert float(optax.tree.norm(grads[first])) > 0


@pytest.mark.slow
def test_smaller_buckets_shrink_the_compiled_step():
    exp = Experiment.from_config(ee_config(data__seq_len=64, early_exit__first=1))

    def flops(tokens):
        plan = exp.initial_plan().with_part(NAME, tokens=tokens)
        return exp.lower_train_step(plan).compile().cost_analysis()["flops"]

    full, half, eighth = flops((64,) * L), flops((64, 32, 32, 32)), flops((64, 8, 8, 8))
    assert eighth < half < full
    assert eighth < 0.75 * full, (eighth, full)
    assert exp.initial_plan().part(NAME)["active"]  # start_step 0


def test_the_bucket_policy_starts_exits_then_shrinks_grows_and_holds():
    policy = ExitBuckets(seq_len=8, first=0, start_step=10, max_forced=0.0, window=4,
                         headroom=0.0, hysteresis=0.25)
    idle = Plan().with_part(NAME, tokens=(8, 8, 8, 8), active=False)
    counts = [[8, 8, 8, 8], [8, 8, 8, 8], [3, 4, 5, 4], [2, 2, 1, 2]]
    assert policy.propose(history(counts, start=0), idle) is None  # before the start step
    started = policy.propose(history(counts, start=8), idle)
    assert started.plan.part(NAME) == {"tokens": (8, 8, 8, 8), "active": True}
    assert started.records[0]["event"] == "early_exit_start"
    # hist[j] is layer first + j; the first exit layer keeps every token.
    shrunk = policy.propose(history(counts, start=20), started.plan)
    assert shrunk.plan.part(NAME)["tokens"] == (8, 8, 5, 2)
    assert shrunk.records[0]["event"] == "early_exit_buckets"
    assert policy.propose(history(counts, start=30), shrunk.plan) is None
    grown = policy.propose(history([c for c in counts[:2]] + [[6, 1, 1, 1], [2, 2, 1, 2]],
                                   start=40), shrunk.plan)
    assert grown.plan.part(NAME)["tokens"] == (8, 8, 6, 2)
    held = policy.propose(history(counts[:2] + [[4, 4, 4, 4], [2, 2, 1, 2]], start=50),
                          shrunk.plan)
    assert held is None  # 5 -> 4 is within the hysteresis


@pytest.mark.parametrize(
    "overrides, key",
    [
        (dict(early_exit__first=4), "early_exit.first"),
        (dict(early_exit__every=0), "early_exit.every"),
        (dict(early_exit__confidence="entropy"), "early_exit.confidence"),
        (dict(early_exit__threshold=1.5), "early_exit.threshold"),
        (dict(early_exit__loss_weights=(1.0,)), "early_exit.loss_weights"),
        (dict(early_exit__max_forced=1.0), "early_exit.max_forced"),
        (dict(mod__enabled=True), "mod.enabled"),
        (dict(moe__every=2), "moe.every"),
    ],
)
def test_bad_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_config(ee_config(**overrides), 8)


@pytest.mark.slow
def test_training_exits_tokens_and_shrinks_the_buckets_in_the_background(tmp_path):
    # Exits on from the start (the start step is the policy test's): the first Plan change is
    # the buckets', decided from the same metrics in both runs, so the second finds it cached.
    settings = dict(early_exit__start_step=0, early_exit__threshold=0.2, early_exit__window=4,
                    early_exit__headroom=0.0, train__eval_every=200, train__log_every=5,
                    train__checkpoint_every=100, data__seq_len=64)
    workdir, summary = train_with_warm_cache(ee_config(train__steps=200, **settings), tmp_path)
    events = read_jsonl(workdir / "events.jsonl")
    buckets = [e for e in events if e["event"] == "early_exit_buckets"]
    assert buckets and buckets[0]["old"] == [64] * L and min(buckets[0]["new"]) < 64
    assert summary.recompiles >= 1
    last = [r for r in read_jsonl(workdir / "metrics.jsonl") if "loss" in r][-1]  # not eval
    assert last[EXITED][0] > 0 and max(last[PROCESSED][1:]) < 1.0
    costs = read_jsonl(workdir / "layer_costs.jsonl")
    assert costs[-1]["layer_cost"][0] == 1.0 and min(costs[-1]["layer_cost"]) < 1.0
