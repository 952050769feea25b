"""Decoding with a key/value cache that keeps each scheme's dynamism (issue 30 §4).

A `Decoder` runs a trained `GPT` (either family: GQA, qk-norm, RoPE scaling or learned
positions) causally. A *prefill* program computes the prompt at once and fills every layer's
cache of keys and values; a *step* then computes one new token per sequence against it. The
cache has a static length T (prompt + new tokens rounded up to a `bucket`), so prompts and
lengths within a bucket reuse one compiled program; the whole generation (prefill, then the
steps in a ``jax.lax.fori_loop``, sampling included) is one program.

Each layer's cache holds, per position, a key, a value and whether the position is *visible*
there: the layers' attention is the training forward's, and a scheme that changes which tokens
a layer computes changes only what it writes and marks:

- early exit (CALM, Schuster et al. 2022 §3.2): at an exit point (`ExitLayer` records with a
  loss weight, once the Plan turned exits on) a token whose confidence reaches the threshold
  stops; its hidden state is its output (the readout of it is its prediction) and the later
  layers only project it through their key/value columns into their caches (state
  propagation, as the training forward's later layers attend to exited tokens' kept states).
  In a step, a run of layers between exit points that no sequence of the batch still needs is
  skipped by a ``jax.lax.cond``: its FLOPs are saved, not masked. Prompt tokens exit as in the
  training forward (the prefill computes them all, masked);
- mixture of depths (Raposo et al. 2024 §3.5): a routed layer routes by its causal predictor,
  as evaluation does (`dynjax.model.mod.predicted_members`): a token goes through the block iff
  its predictor logit is positive and fewer than the record's ``tokens`` members came before it
  in its window of the training sequence length (the budget one training sequence has); its
  key and value are visible in that layer only then, and a step skips the layer by a
  ``jax.lax.cond`` when no sequence routes its token there;
- MoE: no capacities: every token is computed by its top-k experts (a step gathers just those
  experts' weights); expert choice looks at the whole sequence and cannot decode;
- sparse attention: a query sees the visible keys of its own LSH bucket (`hashed_attention`'s
  rule, which its budgeted path equals when the budget covers the needed blocks);
- pruning: the pruned weights are the zeros the parameters hold, multiplied densely.

The model runs in its parameters' dtype.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dynjax.errors import ConfigError
from dynjax.model import early_exit, mod
from dynjax.model.early_exit import ExitLayer, confidence
from dynjax.model.gpt import GPT, Block, GPTConfig, abstract_gpt
from dynjax.model.hashed_attention import HashedAttention, hashed_record
from dynjax.model.hooks import LayerOptions
from dynjax.model.mod import RoutedBlock
from dynjax.model.moe import BIAS, MoE, expert_activation, route

MIN_BUCKET = 16  # the smallest cache length; buckets above it are powers of two

LayerCache = dict[str, jax.Array]  # "k", "v" [B, T, Hkv, Dh], "valid" [B, T]; "count" [B] (MoD)


def bucket(n: int) -> int:
    """The static length a cache of ``n`` positions is compiled for: a power of two, at least
    `MIN_BUCKET`, so lengths within a bucket share one program."""
    return max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length())


@dataclasses.dataclass(frozen=True)
class ExitPoint:
    """An exit point after ``layer``: tokens whose ``measure`` reaches ``threshold`` stop."""

    layer: int
    measure: str
    threshold: float


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """What a decoder compiles in from a model's layer options: the exit points, the routed
    (MoD) layers with their records, each layer's hashed attention (None: dense) and the
    window a routed layer's token budget applies to (the training sequence length)."""

    num_layers: int
    exits: tuple[ExitPoint, ...] = ()
    routed: tuple[tuple[int, RoutedBlock], ...] = ()
    hashed: tuple[HashedAttention | None, ...] = ()
    window: int = 0

    @classmethod
    def of(
        cls, cfg: GPTConfig, options: Sequence[LayerOptions] | None, *, exits: bool = True
    ) -> DecodeSpec:
        """The spec of ``cfg`` run with ``options`` (each layer's records under a Plan; None:
        none, as an empty sequence: a run without layer records); ``exits=False`` decodes at
        full depth whatever the exit records say."""
        options = tuple(options or ((),) * cfg.num_layers)
        if len(options) != cfg.num_layers:
            raise ValueError(f"{len(options)} layer options for {cfg.num_layers} layers")
        if cfg.moe_layers and cfg.routing != "token_choice":
            raise ConfigError(
                f"moe.routing={cfg.routing!r}: each expert picks its tokens from the whole "
                "sequence, which decoding has not seen yet; only token_choice models decode"
            )
        points, routed = [], []
        for i, opts in enumerate(options):
            records = dict(opts)
            record = records.get(early_exit.NAME)
            if isinstance(record, ExitLayer) and exits and record.active and record.exit_weight:
                points.append(ExitPoint(i, record.confidence, record.threshold))
            if isinstance(records.get(mod.NAME), RoutedBlock):
                routed.append((i, records[mod.NAME]))
        return cls(
            num_layers=cfg.num_layers,
            exits=tuple(points),
            routed=tuple(routed),
            hashed=tuple(hashed_record(o) for o in options),
            window=cfg.max_len,
        )


@dataclasses.dataclass(frozen=True)
class Generation:
    """What `Decoder.generate` returns: the new ``tokens`` [B, N]; ``depths`` [B, N - 1], the
    layers each token decoded by a step ran (its exit layer, or the depth), the last new token
    being sampled but not run; ``seconds`` of running the compiled program (not compiling)."""

    tokens: np.ndarray
    depths: np.ndarray
    seconds: float


def sample(
    logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array
) -> jax.Array:
    """[B] next tokens from float32 ``logits`` [B, V]: the argmax at ``temperature`` 0, else a
    draw at that temperature from the smallest set of most likely tokens whose probability
    reaches ``top_p`` (nucleus sampling, Holtzman et al. 2020). Both traced: no recompile."""
    scaled = logits / jnp.maximum(temperature, 1e-6)
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
    kept = jnp.sum(before < top_p, axis=-1, keepdims=True)  # >= 1: the first always counts
    kept = jnp.where(top_p >= 1, ordered.shape[-1], kept)  # all, whatever the rounding
    floor = jnp.take_along_axis(ordered, kept - 1, axis=-1)
    drawn = jax.random.categorical(key, jnp.where(scaled >= floor, scaled, -jnp.inf))
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


def dropless(moe: MoE, x: jax.Array) -> jax.Array:
    """The MoE block's output on ``x`` [B, S, D] with every token computed by its top-k
    experts. One token per sequence (a step) gathers just those experts' weights; a prefill
    runs the block with a capacity of the whole sequence per expert, which drops nothing."""
    b, s, _ = x.shape
    if s > 1:
        return moe(x, capacities=(s,) * moe.w_in.shape[0])[0]
    logits = x.astype(jnp.float32) @ moe.router[...].astype(jnp.float32)
    bias = getattr(moe, BIAS)[...] if hasattr(moe, BIAS) else None
    _, gates, experts, _ = route(logits, moe.top_k, None, bias, moe.normalize_topk)
    w_in, w_out = moe.w_in[...][experts], moe.w_out[...][experts]  # [B, 1, k, D|H, H|D]
    h = expert_activation(jnp.einsum("bsd,bskdh->bskh", x, w_in.astype(x.dtype)), w_out)
    out = jnp.einsum("bskh,bskhd->bskd", h, w_out.astype(x.dtype))
    y = jnp.einsum("bskd,bsk->bsd", out, gates.astype(x.dtype))
    return y + moe.shared_output(x) if hasattr(moe, "shared") else y


def _write(cache: LayerCache, k: jax.Array, v: jax.Array, visible: jax.Array, start) -> LayerCache:
    """``cache`` with the keys, values and visibility of positions ``start``.. written."""
    put = lambda a, new: jax.lax.dynamic_update_slice_in_dim(a, new.astype(a.dtype), start, 1)
    return {**cache, "k": put(cache["k"], k), "v": put(cache["v"], v),
            "valid": put(cache["valid"], visible)}


def _block(
    block: Block, x, positions, cache: LayerCache, start, visible, hashed
) -> tuple[jax.Array, LayerCache]:
    """One layer on new tokens ``x`` [B, S, D] at ``positions`` [B, S]: their keys and values
    written (marked ``visible`` [B, S]), attention over the cache's visible keys up to each
    token's own position, then the MLP, or the MoE without drops."""
    q, k, v = block.attn.project(block.norm1(x), positions)
    cache = _write(cache, k, v, visible, start)
    length = cache["valid"].shape[1]
    sees = cache["valid"][:, None, :] & (jnp.arange(length) <= positions[..., None])
    x = x + block.attn.attend(q, cache["k"], cache["v"], sees, hashed)
    h = block.norm2(x)
    return x + (dropless(block.moe, h) if block.is_moe else block.mlp(h)), cache


def _propagate(block: Block, x, positions, cache: LayerCache, start, visible) -> LayerCache:
    """The cache of a layer the tokens ``x`` skip: their kept states' keys and values."""
    k, v = block.attn.project_keys(block.norm1(x), positions)
    return _write(cache, k, v, visible, start)


def _routed(
    block: Block, x, positions, cache: LayerCache, start, real, last, record: RoutedBlock,
    window: int, hashed, skip: bool,
) -> tuple[jax.Array, LayerCache]:
    """A mixture-of-depths layer routed by its causal predictor (module docstring): the first
    ``record.tokens`` predicted members of each ``window`` positions go through the block,
    scaled by their router weight as in training; the others keep their state and leave no
    key in this layer. ``real`` [B, S]: the tokens that count (not a prefill's padding);
    ``last``: the index of the last of them, whose running member count the cache keeps."""
    part = getattr(block, mod.NAME)
    member = (part.predict(x) > 0) & real
    window_of = positions // window
    # members before each token in its window: those carried in, then the chunk's own
    opens = (start % window == 0) | (window_of != start // window)
    carried = jnp.where(opens, 0, cache["count"][:, None])
    total = jnp.cumsum(member, axis=1)
    first = jnp.clip(window_of * window - start, 0, None)  # the chunk index its window opens at
    base = jnp.where(first > 0, jnp.take_along_axis(total, jnp.maximum(first - 1, 0), 1), 0)
    earlier = carried + total - member - base
    routed = member & (earlier < record.tokens)
    count = jnp.take_along_axis(earlier + member, jnp.full_like(earlier[:, :1], last), 1)[:, 0]

    def run(x, cache):
        y, cache = _block(block, x, positions, cache, start, routed, hashed)
        weight = jax.nn.sigmoid(part.router(x)[..., 0].astype(jnp.float32))[..., None]
        return jnp.where(routed[..., None], x + weight.astype(x.dtype) * (y - x), x), cache

    if skip:
        x, cache = jax.lax.cond(jnp.any(routed), run, lambda x, cache: (x, cache), x, cache)
    else:
        x, cache = run(x, cache)
    return x, {**cache, "count": count.astype(jnp.int32)}


class Decoder:
    """Decodes one model (``cfg``) under its layer options (see the module docstring); the
    compiled generation programs are kept per (batch, prompt bucket, cache length)."""

    def __init__(
        self, cfg: GPTConfig, options: Sequence[LayerOptions] | None = None, *,
        exits: bool = True,
    ) -> None:
        self.cfg = cfg
        self.spec = DecodeSpec.of(cfg, options, exits=exits)
        self.graphdef = nnx.graphdef(abstract_gpt(cfg))
        self._routed = dict(self.spec.routed)
        self._programs: dict[tuple[int, int, int], Any] = {}

    def model(self, params: Any) -> GPT:
        """The model of ``params`` (the pure dict a checkpoint holds)."""
        return nnx.merge(self.graphdef, params)

    def cache(self, batch: int, length: int, dtype: Any = jnp.float32) -> list[LayerCache]:
        """An empty cache of ``length`` positions for ``batch`` sequences, one entry a layer."""
        cfg = self.cfg
        kv, dh = cfg.num_kv_heads or cfg.num_heads, cfg.d_model // cfg.num_heads
        empty = lambda i: {
            "k": jnp.zeros((batch, length, kv, dh), dtype),
            "v": jnp.zeros((batch, length, kv, dh), dtype),
            "valid": jnp.zeros((batch, length), bool),
            **({"count": jnp.zeros((batch,), jnp.int32)} if i in self._routed else {}),
        }
        return [empty(i) for i in range(cfg.num_layers)]

    def _layers(
        self, model: GPT, x, positions, cache: list[LayerCache], start, real, last, skip: bool
    ) -> tuple[jax.Array, list[LayerCache], jax.Array]:
        """Every layer on new tokens ``x`` (see `prefill`, `step`): (the final hidden states,
        the cache, the layers each token ran). Between exit points, a ``skip`` program (a
        step) runs a layer run by ``jax.lax.cond``: only its key/value columns when every
        token has exited, the whole layers otherwise (an exited token keeping its state)."""
        spec, layers, cache = self.spec, list(model.layers), list(cache)
        done = jnp.zeros(x.shape[:2], bool)
        depth = jnp.full(x.shape[:2], spec.num_layers, jnp.int32)
        begin = 0
        for point in (*spec.exits, None):
            end = spec.num_layers - 1 if point is None else point.layer
            run = range(begin, end + 1)

            def compute(x, held, done=done, run=run):
                held, before = list(held), x
                for j, i in enumerate(run):
                    before = x
                    if i in self._routed:
                        y, held[j] = _routed(layers[i], x, positions, held[j], start, real, last,
                                             self._routed[i], spec.window, spec.hashed[i], skip)
                    else:
                        y, held[j] = _block(layers[i], x, positions, held[j], start,
                                            real, spec.hashed[i])
                    x = jnp.where(done[..., None], x, y)
                return x, held, before

            def propagate(x, held, run=run):
                held = [_propagate(layers[i], x, positions, held[j], start, real)
                        for j, i in enumerate(run)]
                return x, held, x

            held = [cache[i] for i in run]
            if skip and begin > 0:
                x, held, before = jax.lax.cond(jnp.all(done), propagate, compute, x, held)
            else:
                x, held, before = compute(x, held)
            for j, i in enumerate(run):
                cache[i] = held[j]
            if point is not None:
                conf = confidence(point.measure, before, x, model.readout(x))
                leaving = ~done & (conf >= point.threshold)
                depth = jnp.where(leaving, end + 1, depth)
                done = done | leaving
            begin = end + 1
        return x, cache, depth

    def prefill(
        self, model: GPT, tokens: jax.Array, length: jax.Array | int, cache: list[LayerCache]
    ) -> tuple[jax.Array, list[LayerCache], jax.Array]:
        """The prompt ``tokens`` [B, S] (the first ``length`` real, the rest padding) at
        positions 0..S-1: (float32 logits [B, S, V], the cache holding them, the layers each
        ran [B, S])."""
        b, s = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(s), (b, s))
        real = positions < length
        x, cache, depth = self._layers(
            model, model.embedded(tokens, positions), positions, cache, 0, real,
            jnp.asarray(length) - 1, skip=False,
        )
        return model.readout(x), cache, depth

    def step(
        self, model: GPT, token: jax.Array, position: jax.Array | int, cache: list[LayerCache]
    ) -> tuple[jax.Array, list[LayerCache], jax.Array]:
        """One new ``token`` [B] per sequence at ``position`` (all sequences alike): (float32
        logits [B, V] of the next token, the cache, the layers it ran [B])."""
        b = token.shape[0]
        positions = jnp.full((b, 1), position, jnp.int32)
        x, cache, depth = self._layers(
            model, model.embedded(token[:, None], positions), positions, cache, position,
            jnp.ones((b, 1), bool), 0, skip=True,
        )
        return model.readout(x)[:, 0], cache, depth[:, 0]

    def cache_length(self, prompt: int, new: int) -> int:
        """The static cache length for ``prompt`` tokens and ``new`` ones (`bucket`); a model
        with learned positions has them for its ``max_len`` only."""
        if self.cfg.positions == "learned":
            if prompt + new > self.cfg.max_len:
                raise ConfigError(
                    f"the prompt's {prompt} tokens + --max-new-tokens={new} exceed the "
                    f"{self.cfg.max_len} positions this model learned (data.seq_len): ask for "
                    f"at most {max(self.cfg.max_len - prompt, 0)} new tokens or shorten the prompt"
                )
            return min(bucket(prompt + new), self.cfg.max_len)
        return bucket(prompt + new)

    def _run(self, cache_length: int):
        def run(params, prompt, length, new, key, temperature, top_p):
            model = self.model(params)
            b = prompt.shape[0]
            cache = self.cache(b, cache_length, model.embed.embedding[...].dtype)
            logits, cache, depth = self.prefill(model, prompt, length, cache)
            last = jax.lax.dynamic_index_in_dim(logits, length - 1, 1, keepdims=False)
            tokens = jnp.zeros((b, cache_length), jnp.int32).at[:, : prompt.shape[1]].set(prompt)
            depths = jnp.zeros((b, cache_length), jnp.int32).at[:, : prompt.shape[1]].set(depth)
            put = lambda a, new, at: jax.lax.dynamic_update_slice_in_dim(a, new[:, None], at, 1)
            first = sample(last, jax.random.fold_in(key, 0), temperature, top_p)
            tokens = put(tokens, first, length)

            def body(i, carry):
                tokens, depths, cache = carry
                at = length + i - 1
                token = jax.lax.dynamic_index_in_dim(tokens, at, 1, keepdims=False)
                logits, cache, depth = self.step(model, token, at, cache)
                chosen = sample(logits, jax.random.fold_in(key, i), temperature, top_p)
                return put(tokens, chosen, at + 1), put(depths, depth, at), cache

            tokens, depths, _ = jax.lax.fori_loop(1, new, body, (tokens, depths, cache))
            return tokens, depths

        return jax.jit(run)

    def generate(
        self,
        params: Any,
        prompt: np.ndarray,
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        rounds: int = 1,
    ) -> Generation:
        """``max_new_tokens`` new tokens after each prompt of ``prompt`` [B, P] (equal lengths),
        greedy at ``temperature`` 0, else sampled (`sample`). Compiles on the first call for a
        (batch, prompt bucket, cache length); ``seconds`` times the run alone, the median of
        ``rounds`` runs after an untimed one (the same tokens each: the seed fixes the draws)."""
        prompt = np.asarray(prompt, np.int32)
        b, p = prompt.shape
        if p < 1 or max_new_tokens < 1:
            raise ConfigError(f"a prompt of {p} tokens and max_new_tokens={max_new_tokens}: "
                              "both must be >= 1")
        length = self.cache_length(p, max_new_tokens)
        width = min(bucket(p), length)
        padded = np.zeros((b, width), np.int32)
        padded[:, :p] = prompt
        args = (params, padded, np.int32(p), np.int32(max_new_tokens), jax.random.key(seed),
                np.float32(temperature), np.float32(top_p))
        key = (b, width, length)
        if key not in self._programs:
            self._programs[key] = self._run(length).lower(*args).compile()
        if rounds > 1:  # a timed comparison: the program's first run (allocations) untimed
            jax.block_until_ready(self._programs[key](*args))
        times = []
        for _ in range(rounds):
            began = time.perf_counter()
            tokens, depths = jax.block_until_ready(self._programs[key](*args))
            times.append(time.perf_counter() - began)
        seconds = statistics.median(times)
        tokens, depths = np.asarray(tokens), np.asarray(depths)
        stop = p + max_new_tokens
        return Generation(tokens[:, p:stop], depths[:, p : stop - 1], seconds)


def mean_depth(generation: Generation) -> float:
    """The mean layers a decoded token ran (NaN when no token was decoded by a step)."""
    return float(np.mean(generation.depths)) if generation.depths.size else math.nan
