"""Decoding with a key/value cache (`dynjax.model.decode`) against the model's own forward,
recomputed without a cache, and ``python -m dynjax.generate`` end to end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dynjax import config as config_lib
from dynjax.data import TextCodec
from dynjax.generate import main as generate_main
from dynjax.hf.convert import workdir_config
from dynjax.model import GPT, GPTConfig, fresh_params, mod
from dynjax.model import early_exit as ee
from dynjax.model import hashed_attention as sa
from dynjax.model.attention import Rope
from dynjax.model.decode import Decoder, bucket, sample
from dynjax.model.hashed_attention import HashedAttention
from dynjax.model.hooks import Hooks, layer_options
from dynjax.model.moe import static_options
from dynjax.parallel import make_mesh, param_shardings
from dynjax.train import main as train_main
from dynjax.train import newest_params

from .helpers import ROOT

VOCAB, SEQ = 61, 24


def config(**overrides) -> GPTConfig:
    base = dict(vocab_size=VOCAB, num_layers=3, d_model=32, num_heads=4, mlp_dim=64, max_len=32)
    return GPTConfig(**{**base, **overrides})


FAMILIES = {
    "gpt": config(),
    "gpt_learned": config(positions="learned"),
    "llama_gqa": config(family="llama", num_kv_heads=2, qk_norm="head", qkv_bias=True,
                        rope=Rope(scaling="llama3", factor=4.0, original_max_len=8)),
    "llama_mqa": config(family="llama", num_kv_heads=1, qk_norm="full",
                        rope=Rope(scaling="linear", factor=2.0)),
}


def tokens(batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, length)).astype(np.int32)


def peaked(params, scale: float = 30.0):
    """``params`` with a sharper LM head, so a random model's confidences spread out."""
    params = jax.tree.map(lambda a: a, params)
    params["head"]["kernel"] = params["head"]["kernel"] * scale
    return params


def teacher_forced(decoder: Decoder, params, seq: np.ndarray, prompt: int):
    """Decoder logits [B, S, V] and layers run [B, S] of ``seq``: a prefill of its first
    ``prompt`` tokens (padded with other tokens to their bucket), then one step per token."""
    b, s = seq.shape
    length = bucket(s)
    width = bucket(prompt)
    padded = np.array(tokens(b, width, seed=9))
    padded[:, :prompt] = seq[:, :prompt]
    prefill = jax.jit(lambda p, t: decoder.prefill(
        decoder.model(p), t, prompt, decoder.cache(b, length)))
    step = jax.jit(lambda p, t, at, c: decoder.step(decoder.model(p), t, at, c))
    logits, cache, depth = prefill(params, padded)
    out, depths = [logits[:, :prompt]], [depth[:, :prompt]]
    for at in range(prompt, s):
        one, cache, d = step(params, jnp.asarray(seq[:, at]), at, cache)
        out.append(one[:, None])
        depths.append(d[:, None])
    return np.concatenate(out, 1), np.concatenate(depths, 1)


def greedy_reference(forward, prompt: np.ndarray, new: int) -> np.ndarray:
    """``new`` tokens, each the argmax of ``forward`` recomputing the whole sequence without a
    cache. The sequence is padded to its final length, so one program serves every token: the
    models are causal, the padding after a token does not change its logits."""
    b, p = prompt.shape
    seq = np.zeros((b, p + new), np.int32)
    seq[:, :p] = prompt
    run = jax.jit(forward)
    for at in range(p, p + new):
        seq[:, at] = np.argmax(np.asarray(run(jnp.asarray(seq)))[:, at - 1], -1)
    return seq[:, p:]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_decoding_with_the_cache_equals_the_full_forward(name):
    cfg = FAMILIES[name]
    params = fresh_params(cfg, 0)
    model = nnx.merge(nnx.graphdef(GPT(cfg, rngs=nnx.Rngs(0))), params)
    decoder = Decoder(cfg)
    seq = tokens(2, SEQ)
    full = np.asarray(model(jnp.asarray(seq))[0])
    logits, depth = teacher_forced(decoder, params, seq, prompt=5)
    np.testing.assert_allclose(logits, full, atol=2e-5, rtol=1e-4)
    assert (depth == cfg.num_layers).all()

    prompt = seq[:, :7]
    got = decoder.generate(params, prompt, max_new_tokens=9)
    np.testing.assert_array_equal(got.tokens, greedy_reference(lambda t: model(t)[0], prompt, 9))
    decoder.generate(params, seq[:, :6], max_new_tokens=8)  # same buckets: no new program
    assert len(decoder._programs) == 1


def test_sampling_is_greedy_at_temperature_zero_and_keeps_the_nucleus():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = [jax.random.key(i) for i in range(200)]
    draw = lambda t, p: {int(sample(logits, k, jnp.float32(t), jnp.float32(p))[0]) for k in keys}
    assert draw(0.0, 1.0) == {0}
    assert draw(1.0, 0.6) == {0, 1}  # 0.5 < 0.6: the second token completes the nucleus
    assert draw(1.0, 0.5) == {0}
    assert draw(1.0, 1.0) == {0, 1, 2, 3}


def exit_model(measure: str):
    """A 4-layer model with exit points after layers 1 and 3 (counting from 1), its layer
    options with ``measure`` and a threshold that sends about half the tokens out at the first
    point, and its parameters."""
    cfg = config(num_layers=4, hooks=Hooks((ee.HOOKS,)))
    params = peaked(fresh_params(cfg, 1))
    model = nnx.merge(nnx.graphdef(GPT(cfg, rngs=nnx.Rngs(0))), params)
    x = model.embed(jnp.asarray(tokens(1, SEQ, seed=3)))
    y = model.layers[0](x)[0]
    conf = ee.confidence(measure, x, y, model.readout(y))
    threshold = float(np.median(np.asarray(conf)))
    record = lambda w: ee.ExitLayer(SEQ, w, measure, threshold, active=True)
    options = [layer_options({ee.NAME: record(0.5 if i in (0, 2) else 0.0)}) for i in range(4)]
    return cfg, params, model, options, threshold


def plain_exits(model, seq, measure: str, threshold: float, exits=(0, 2)):
    """Early exit recomputed plainly, without a cache: every token through every layer, where
    a token that has exited keeps its state. (logits [B, S, V], layers run [B, S])."""
    x = model.embed(seq)
    done = jnp.zeros(seq.shape, bool)
    depth = jnp.full(seq.shape, len(model.layers))
    for i, block in enumerate(model.layers):
        before, (y, _, _) = x, block(x)
        x = jnp.where(done[..., None], x, y)
        if i in exits:
            leaving = ~done & (ee.confidence(measure, before, x, model.readout(x)) >= threshold)
            depth, done = jnp.where(leaving, i + 1, depth), done | leaving
    return model.readout(x), depth


@pytest.mark.parametrize("measure", ["softmax_max", "state"])
def test_early_exit_decoding_equals_a_plain_recompute(measure):
    cfg, params, model, options, threshold = exit_model(measure)
    seq = jnp.asarray(tokens(1, SEQ, seed=4))
    plain, plain_depth = plain_exits(model, seq, measure, threshold)
    # the plain recompute is what training's forward does with these records
    trained = model.forward(seq, options=options, targets=jnp.zeros_like(seq), inference=True)
    np.testing.assert_allclose(np.asarray(trained[0]), plain, atol=2e-5, rtol=1e-4)

    decoder = Decoder(cfg, options)
    logits, depth = teacher_forced(decoder, params, np.asarray(seq), prompt=4)
    np.testing.assert_allclose(logits, plain, atol=2e-5, rtol=1e-4)
    np.testing.assert_array_equal(depth, plain_depth)
    assert {1, 3, 4} <= set(depth[0, 4:].tolist())  # steps exit at both points and run through

    prompt, new = np.asarray(seq[:, :6]), 12
    got = decoder.generate(params, prompt, max_new_tokens=new)
    forward = lambda t: plain_exits(model, t, measure, threshold)[0]
    expected = greedy_reference(forward, prompt, new)
    np.testing.assert_array_equal(got.tokens, expected)
    whole = jnp.asarray(np.concatenate([prompt, expected], 1))
    depths = np.asarray(plain_exits(model, whole, measure, threshold)[1])
    np.testing.assert_array_equal(got.depths, depths[:, 6 : 6 + new - 1])
    full = Decoder(cfg, options, exits=False)
    assert full.spec.exits == ()
    assert (full.generate(params, prompt, max_new_tokens=3).depths == 4).all()


def test_moe_decoding_drops_nothing():
    cfg = config(family="llama", moe_layers=(1,), num_experts=4, top_k=2, routed_bias=True,
                 shared_expert_dim=16, shared_expert_gate=True)
    params = fresh_params(cfg, 2)
    bias = params["layers"][1]["moe"]["routed_bias"]
    params["layers"][1]["moe"]["routed_bias"] = jax.random.normal(jax.random.key(5), bias.shape)
    model = nnx.merge(nnx.graphdef(GPT(cfg, rngs=nnx.Rngs(0))), params)
    seq = tokens(2, SEQ, seed=6)

    def forward(t):  # every expert may take every token of a sequence: nothing dropped
        return model(t, options=static_options(3, (1,), [(t.shape[1],) * 4]))

    full, stats = forward(jnp.asarray(seq))
    assert int(stats[0].dropped.sum()) == 0
    decoder = Decoder(cfg)
    logits, _ = teacher_forced(decoder, params, seq, prompt=5)
    np.testing.assert_allclose(logits, full, atol=2e-5, rtol=1e-4)
    prompt = seq[:, :5]
    got = decoder.generate(params, prompt, max_new_tokens=8)
    expected = greedy_reference(lambda t: forward(t)[0], prompt, 8)
    np.testing.assert_array_equal(got.tokens, expected)


def test_expert_choice_models_are_refused():
    with pytest.raises(ValueError, match="moe.routing='expert_choice'"):
        Decoder(config(moe_layers=(1,), num_experts=4, routing="expert_choice"))


def test_mod_decoding_routes_by_the_causal_predictor_as_evaluation_does():
    cfg = config(max_len=SEQ, hooks=Hooks((mod.HOOKS,)), block_parts=((1, mod.NAME, 16),))
    params = fresh_params(cfg, 3)
    model = nnx.merge(nnx.graphdef(GPT(cfg, rngs=nnx.Rngs(0))), params)
    record = mod.RoutedBlock(tokens=6, predictor_weight=0.01, eval_routing="predictor")
    options = [layer_options({mod.NAME: record} if i == 1 else {}) for i in range(3)]
    seq = jnp.asarray(tokens(1, SEQ, seed=7))
    evaluated = np.asarray(model.forward(seq, options=options, inference=True)[0])
    x = model.layers[0](model.embed(seq))[0]
    members = np.asarray(getattr(model.layers[1], mod.NAME).predict(x) > 0)[0]
    # the budget binds (later members skip), and some tokens skip by prediction: the steps
    # take both sides of the layer's cond
    assert 6 < members.sum() < SEQ - 2

    logits, _ = teacher_forced(Decoder(cfg, options), params, np.asarray(seq), prompt=4)
    np.testing.assert_allclose(logits, evaluated, atol=2e-5, rtol=1e-4)


def test_sparse_attention_decodes_within_its_buckets():
    cfg = FAMILIES["llama_gqa"]
    params = fresh_params(cfg, 4)
    model = nnx.merge(nnx.graphdef(GPT(cfg, rngs=nnx.Rngs(0))), params)
    record = lambda i: HashedAttention(buckets=4, block=8, budget=SEQ // 8, seed=0, layer=i)
    options = [layer_options({sa.NAME: record(i)}) for i in range(cfg.num_layers)]
    seq = tokens(2, SEQ, seed=8)
    full = np.asarray(model(jnp.asarray(seq), options=options)[0])  # budget: every block
    dense = np.asarray(model(jnp.asarray(seq))[0])
    assert not np.allclose(full, dense, atol=1e-3)  # the buckets change the model
    logits, _ = teacher_forced(Decoder(cfg, options), params, seq, prompt=5)
    np.testing.assert_allclose(logits, full, atol=2e-5, rtol=1e-4)


def test_decoding_sharded_over_a_mesh_gives_the_same_tokens():
    cfg = FAMILIES["llama_gqa"]
    params = fresh_params(cfg, 0)
    mesh = make_mesh(1, 2, 1, tensor=2)
    placed = jax.device_put(params, param_shardings(params, mesh))
    decoder, prompt = Decoder(cfg), tokens(2, 6)
    alone = decoder.generate(params, prompt, max_new_tokens=6)
    sharded = Decoder(cfg).generate(placed, prompt, max_new_tokens=6)
    np.testing.assert_array_equal(sharded.tokens, alone.tokens)


QUICK = [  # the quickstart config, shrunk to a 2-step run
    "--config", str(ROOT / "configs" / "quickstart.py"), "--config.train.steps=2",
    "--config.train.batch_size=2", "--config.data.seq_len=32", "--config.data.max_tokens=20000",
    "--config.model.num_layers=2", "--config.model.d_model=32", "--config.model.num_heads=2",
    "--config.model.mlp_dim=64", "--config.train.eval_every=2", "--config.train.eval_batches=1",
    "--config.train.checkpoint_every=2", "--config.checkpoint.async_save=False",
]


def test_the_cli_continues_a_prompt_from_a_trained_run(tmp_path, capsys):
    work = tmp_path / "run"
    assert train_main([*QUICK, "--workdir", str(work)]) == 0
    capsys.readouterr()
    assert generate_main(["--workdir", str(work), "--prompt", "def main(", "--max-new-tokens",
                          "8"]) == 0
    out, err = capsys.readouterr()
    cfg, schemes = workdir_config(work)
    params = newest_params(cfg, work, schemes)
    model_cfg = config_lib.model_facts(
        cfg, config_lib.check_run(cfg, jax.device_count(), schemes), schemes
    ).model
    model = nnx.merge(nnx.graphdef(GPT(model_cfg, rngs=nnx.Rngs(0))), params)
    prompt = np.asarray([list(b"def main(")], np.int32)
    expected = greedy_reference(lambda t: model(t)[0], prompt, 8)[0].tolist()
    assert out == TextCodec().decode(expected) + "\n"
    assert "8 new tokens in" in err and "tokens/s" in err

    exits = tmp_path / "exits"
    extra = ["--config.early_exit.enabled=True", "--config.early_exit.first=1",
             "--config.early_exit.start_step=0", "--config.early_exit.threshold=0.001"]
    assert train_main([*QUICK, *extra, "--workdir", str(exits)]) == 0
    capsys.readouterr()
    assert generate_main(["--workdir", str(exits), "--prompt", "import", "--max-new-tokens", "6",
                          "--temperature", "0.8", "--top-p", "0.9"]) == 0
    err = capsys.readouterr().err
    assert "early exit: mean exit layer 1.00 of 2" in err and "at full depth" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--workdir", "{tmp}/missing"], "--workdir="),
        (["--max-new-tokens", "0"], "--max-new-tokens=0 must be >= 1"),
        (["--temperature", "-0.5"], "--temperature=-0.5 must be >= 0"),
        (["--top-p", "0"], "--top-p=0.0 must be in (0, 1]"),
        (["--top-p", "1.5"], "--top-p=1.5 must be in (0, 1]"),
        ([], "holds no config.json"),
    ],
)
def test_bad_input_stops_with_an_error(tmp_path, capsys, flags, message):
    args = ["--workdir", str(tmp_path), "--prompt", "x", *[f.format(tmp=tmp_path) for f in flags]]
    assert generate_main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_a_prompt_too_long_for_learned_positions_is_refused():
    decoder = Decoder(FAMILIES["gpt_learned"])
    with pytest.raises(ValueError, match="exceed the 32 positions"):
        decoder.generate(fresh_params(FAMILIES["gpt_learned"], 0), tokens(1, 30),
                         max_new_tokens=3)


def test_the_cache_length_is_bucketed():
    assert [bucket(n) for n in (1, 16, 17, 33, 64, 65)] == [16, 16, 32, 64, 64, 128]
