"""Decoder-only GPT whose layers are a Python list of blocks, each with its own parameters.

A list rather than a stored stack because layer shapes diverge during dynamic training (MoE
capacities, pruned widths) and layers move between pipeline stages (docs/parallelism.md).
Compile time still need not grow with depth: with ``GPTConfig.scan_layers`` the layer loop
(`run_layers`) runs each run of consecutive layers with identical static options under one
``jax.lax.scan`` over their parameters, stacked inside the traced program (`layer_runs`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dynjax.model.attention import CausalSelfAttention, Rope
from dynjax.model.hashed_attention import hashed_record
from dynjax.model.hooks import NO_HOOKS, BlockPart, Hooks, LayerContext, LayerOptions
from dynjax.model.mlp import MLP, SwiGLU
from dynjax.model.moe import MOE, MOE_HOOKS, MoE, MoEStats
from dynjax.model.moe import layer_metrics as moe_layer_metrics
from dynjax.model.pruned import sparse_linears
from dynjax.model.remat import rematerialised

# The block families (`GPTConfig.family`): "gpt", the pre-norm GPT-2 block (LayerNorm, GELU MLP,
# biases); "llama", Llama's (RMSNorm, SwiGLU MLP and SwiGLU experts, no biases). Both lay their
# parameters out under the same names (attn/qkv, attn/out, mlp/up, mlp/down; Llama adds
# mlp/gate), so every scheme, parallelism and checkpoint path treats them alike.
FAMILIES = ("gpt", "llama")


# The fewest consecutive equal layers a scan runs by default. On CPU (benchmarks/scan_compile.py,
# docs/benchmarks.md "Scanned layers") a stage of 4 scanned layers compiled 1.51x (dense) and
# 1.14x (MoE) slower than unrolled and its step gained little or lost (0.94-1.12x); at 8 layers
# the step was 7-13% faster, and from 16 on the compile took half the unrolled time or less.
SCAN_MIN_LAYERS = 8


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    num_layers: int
    d_model: int
    num_heads: int
    mlp_dim: int
    max_len: int
    positions: str = "rope"  # "rope" | "learned"
    family: str = "gpt"  # `FAMILIES`
    num_kv_heads: int = 0  # grouped-query attention's key/value heads; 0: num_heads
    rope: Rope = Rope()  # RoPE's base and scaling (with positions="rope")
    norm_eps: float = 1e-6  # the norms' epsilon (LayerNorm or RMSNorm)
    normalize_topk: bool = True  # renormalise a token's top-k gates (`moe.route`)
    shared_expert_dim: int = 0  # width of each MoE block's shared dense expert; 0: none
    shared_expert_gate: bool = False  # the shared expert's output scaled by a sigmoid gate
    qkv_bias: bool = False  # the query/key/value projection has a bias even without others (Qwen2)
    qk_norm: str = "none"  # queries and keys RMS-normalised: "none" | "head" | "full" (QK_NORMS)
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 8
    top_k: int = 2
    expert_mlp_dim: int = 0  # 0: mlp_dim
    routing: str = "token_choice"  # `dynjax.model.moe.ROUTINGS`
    routed_bias: bool = False  # a `RoutedBias` per MoE block (auxiliary-loss-free balancing)
    # Plugins' extra submodules per layer: (layer, part name, settings), `hooks.BlockPart`.
    block_parts: tuple[BlockPart, ...] = ()
    # The hooks plugins' records run, and their parts' factories (`Schemes.hooks`; none by
    # default): data, so equal configs build and key equal programs.
    hooks: Hooks = NO_HOOKS
    # Run each run of at least ``scan_min_layers`` consecutive layers with identical static
    # options under one `jax.lax.scan` (`run_layers`): compile time about flat in depth, for a
    # copy of their weights per step; shorter runs are unrolled (`SCAN_MIN_LAYERS`).
    scan_layers: bool = True
    scan_min_layers: int = SCAN_MIN_LAYERS

    @property
    def scan_from(self) -> int:
        """`run_layers`' ``scan_from``: the fewest layers a scanned run holds, 0 for no scan."""
        return self.scan_min_layers if self.scan_layers else 0

    def __post_init__(self) -> None:
        # The MoE block's metrics, their reductions and its loss terms are its hook set's: a
        # model always runs it (on a dense model every stage reports zero auxiliary losses).
        if not any(s.name == MOE for s in self.hooks.sets):
            object.__setattr__(self, "hooks", Hooks((MOE_HOOKS, *self.hooks.sets)))

    @property
    def residual_std(self) -> float:
        """GPT-2's scaled init of residual projections keeps activations flat with depth."""
        return 0.02 / math.sqrt(2 * self.num_layers)


# The matrices GPT-2 initialises with `GPTConfig.residual_std` rather than 0.02: the projections
# back into the residual stream. Matched with `re.search` against "/"-joined parameter paths.
RESIDUAL_PROJECTIONS = r"(^|/)(attn/out/kernel|(mlp|shared)/down/kernel|moe/w_out)$"


def init_std(cfg: GPTConfig, path: str) -> float:
    """The standard deviation the matrix at ``path`` is initialised with (``Block`` below):
    the unit in which a scale-free magnitude ranking (pruning) measures its weights."""
    return cfg.residual_std if re.search(RESIDUAL_PROJECTIONS, path) else 0.02


def make_norm(cfg: GPTConfig, rngs: nnx.Rngs) -> nnx.Module:
    """The family's norm: LayerNorm (GPT) or RMSNorm (Llama), of epsilon ``cfg.norm_eps``."""
    norm = nnx.RMSNorm if cfg.family == "llama" else nnx.LayerNorm
    return norm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs)


class Block(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + ffn(norm(x)) with an MLP or MoE ffn; its
    norm, MLP and biases those of ``cfg.family`` (`FAMILIES`)."""

    def __init__(self, cfg: GPTConfig, index: int, *, rngs: nnx.Rngs):
        d, llama = cfg.d_model, cfg.family == "llama"
        self.norm1 = make_norm(cfg, rngs)
        self.attn = CausalSelfAttention(
            d,
            cfg.num_heads,
            rope=cfg.positions == "rope",
            out_std=cfg.residual_std,
            rngs=rngs,
            num_kv_heads=cfg.num_kv_heads,
            positional=cfg.rope,
            qkv_bias=cfg.qkv_bias,
            qk_norm=cfg.qk_norm,
            norm_eps=cfg.norm_eps,
            bias=not llama,
        )
        self.norm2 = make_norm(cfg, rngs)
        self.is_moe = index in cfg.moe_layers
        if self.is_moe:
            hidden = cfg.expert_mlp_dim or cfg.mlp_dim
            self.moe = MoE(
                d,
                hidden,
                cfg.num_experts,
                cfg.top_k,
                out_std=cfg.residual_std,
                rngs=rngs,
                routing=cfg.routing,
                routed_bias=cfg.routed_bias,
                gated=llama,
                normalize_topk=cfg.normalize_topk,
                shared_dim=cfg.shared_expert_dim,
                shared_gate=cfg.shared_expert_gate,
            )
        else:
            mlp = SwiGLU if llama else MLP
            self.mlp = mlp(d, cfg.mlp_dim, out_std=cfg.residual_std, rngs=rngs)
        self.hooks = cfg.hooks  # what the records of its options run
        for layer, name, settings in cfg.block_parts:
            if layer == index:
                if hasattr(self, name):
                    raise ValueError(f"block part {name!r} of layer {index} shadows an attribute")
                setattr(self, name, cfg.hooks.make_part(name, cfg, settings, rngs))

    def __call__(
        self,
        x,
        *,
        parallel=None,
        inputs: Mapping[str, jax.Array] | None = None,
        options: LayerOptions = (),
        context: LayerContext | None = None,
    ):
        """(output, MoE stats or None, the block hooks' metrics) of one layer. ``inputs``: the
        layer's rows of the step's per-layer inputs (`Plugin.step_inputs`, e.g. ragged MoE
        capacities) and batch inputs (`Plugin.batch_inputs`, e.g. cached routes)."""
        inputs = inputs or {}
        # Records read inside the block: block-sparse matmuls, hashed attention, the MoE's.
        sparse, hashed = sparse_linears(options), hashed_record(options)

        def residual(x, positions, whole=None):
            keys = None if whole is None else self.norm1(whole)
            y, metrics = self.attn(self.norm1(x), sparse, positions, hashed, keys, parallel)
            x = x + y
            if self.is_moe:
                record = dict(options).get(MOE)
                if record is None:
                    raise ValueError(
                        f"an MoE block runs with an {MOE!r} record (`MoELayer`) in its options: "
                        "the MoE plugin's layer options, or `dynjax.model.moe.static_options`"
                    )
                y, stats = self.moe(
                    self.norm2(x),
                    capacities=record.block_capacities(inputs),
                    parallel=parallel,
                    cached=inputs.get("routes"),
                    chunking=record.chunking,  # MPipeMoE's partitions, memory reuse
                )
                return x + y, stats, {**metrics, **moe_layer_metrics(stats, record)}
            return x + self.mlp(self.norm2(x), sparse), None, metrics

        wrapped = self.hooks.block_wrapper(options)
        if wrapped is None:
            x, stats, inner = residual(x, None)
        else:  # a scheme that picks the tokens the block computes (mixture of depths)
            name, wrapper, record = wrapped
            part = getattr(self, name, None)
            x, stats, inner = wrapper(residual, x, record, part, context or LayerContext())
        x, metrics = self.hooks.apply_block_hooks(x, options, inputs)
        return x, stats, {**inner, **metrics}


def layer_runs(keys: Sequence[Hashable]) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` of each maximal run of consecutive equal ``keys``, in order: the layers
    one ``jax.lax.scan`` can run (one key per layer: what its compiled body depends on)."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            runs.append((start, i))
            start = i
    return tuple(runs)


def scan_runs(
    blocks: Sequence[Block],
    options: Sequence[LayerOptions],
    inputs: Sequence[Mapping[str, jax.Array]],
    frozen: Sequence[bool],
    remat: Sequence[str],
    min_layers: int = 2,
) -> tuple[tuple[int, int], ...]:
    """The runs of ``blocks`` that `run_layers` scans (one `layer_runs` key per block, below;
    ``inputs``: each block's per-layer inputs), a run shorter than ``min_layers`` split into
    its single layers."""
    keys = [
        _static_key(*args) for args in zip(blocks, options, inputs, frozen, remat, strict=True)
    ]
    return tuple(
        one
        for start, stop in layer_runs(keys)
        for one in (
            ((start, stop),)
            if stop - start >= min_layers
            else tuple((i, i + 1) for i in range(start, stop))
        )
    )


def _static_key(
    block: Block,
    options: LayerOptions,
    inputs: Mapping[str, jax.Array],
    frozen: bool,
    remat: str,
) -> Hashable:
    """Everything a block's traced body depends on beside its array values: its graph, its
    parameters' shapes and dtypes, its plugin records (e.g. MoE capacities, or the ragged
    path's static buffer), the names, shapes and dtypes of its per-layer inputs, whether it
    is frozen (a frozen layer stacked with trainable ones would get a weight gradient and a
    backward it does not need) and its rematerialisation policy (one scan body has one)."""
    graphdef, state = nnx.split(block)
    shapes = tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(state))
    held = tuple(sorted((k, v.shape, str(v.dtype)) for k, v in inputs.items()))
    return graphdef, shapes, options, held, frozen, remat


def _run_block(block, x, inputs, opts, parallel, context, remat="none", *, in_loop=False):
    """One layer: its weight hooks, then the block, under its rematerialisation policy
    ``remat`` (`dynjax.model.remat`; ``in_loop``: the body of a scan). (output, MoE stats or
    None, metrics).

    The checkpointed function is pure: the block's state, input, per-layer inputs and the
    wrappers' carry go in, its outputs and the carry come out (a wrapper writes the carry of
    ``context``, which must not hold values traced inside the checkpoint)."""
    graphdef, state = nnx.split(block)

    def layer(state, x, inputs, carry):
        inner = dataclasses.replace(context, carry=dict(carry))
        block = nnx.merge(graphdef, state)
        block, weight_metrics = block.hooks.apply_weight_hooks(block, opts)
        x, stats, metrics = block(x, parallel=parallel, inputs=inputs, options=opts, context=inner)
        return x, stats, {**weight_metrics, **metrics}, inner.carry

    x, stats, metrics, carry = rematerialised(layer, remat, in_loop=in_loop)(
        state, x, inputs, dict(context.carry)
    )
    context.carry = carry
    return x, stats, metrics


def _layer_indices(n: int) -> tuple[jax.Array, ...]:
    """0..n-1 as int32 scalars computed by a loop (index j counts the steps k < j), so XLA
    cannot fold them into constants (it sees through an optimization barrier and rewrites
    counters that all step by one as one counter plus constant offsets).

    Why: the stacked run's gradients (and metrics) are cut back into per-layer arrays, and a
    cut at a constant offset i, fused into layer i's consumers (its optimizer update), makes
    every layer's kernels different, where unrolled layers share one compiled kernel per shape:
    on XLA CPU, codegen of those kernels then grows with depth faster than the scan saves.
    With the offset a runtime scalar, every layer's fused kernels are the same again."""

    def count(k, index):
        return tuple(i + (k < j).astype(jnp.int32) for j, i in enumerate(index))

    return jax.lax.fori_loop(0, n, count, (jnp.int32(0),) * n)


def _unstack(tree: Any, index: Sequence[jax.Array]) -> list[Any]:
    """Entry i of every leaf of ``tree`` [n, ...] for each i of ``index`` (`_layer_indices`)."""
    take = lambda i: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), tree)
    return [take(i) for i in index]


@jax.custom_vjp
def _stack(trees: list[Any]) -> Any:
    """The leaves of equal-structured ``trees`` stacked on a new leading axis; its gradient is
    cut back per tree by `_unstack`."""
    return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def _stack_fwd(trees):
    return _stack(trees), _layer_indices(len(trees))


def _stack_bwd(index, g):
    return (_unstack(g, index),)


_stack.defvjp(_stack_fwd, _stack_bwd)


def _scan_blocks(blocks, x, inputs, opts, parallel, context, remat):
    """`_run_block` over ``blocks`` (equal `_static_key`, so one policy ``remat``) as one
    ``jax.lax.scan``: their
    parameters and per-layer inputs stacked on a leading axis; the activations and the
    wrappers' carry flow through it. Returns per-layer stats and metrics, as unrolled.

    Stacking at trace time (rather than storing stacks) keeps the state keyed by layer, so
    migration, checkpoints and optimizer state do not change; it costs one copy of the run's
    weights per forward (and of their gradients backward), small beside the layers' matmuls.
    """
    graphdef = nnx.graphdef(blocks[0])
    states = _stack([nnx.state(b) for b in blocks])
    stacked = {k: jnp.stack([one[k] for one in inputs]) for k in inputs[0]}

    def body(carry, xs):
        x, wrapper_carry = carry
        state, held = xs
        inner = dataclasses.replace(context, carry=dict(wrapper_carry))
        x, stats, metrics = _run_block(
            nnx.merge(graphdef, state), x, held, opts, parallel, inner, remat, in_loop=True
        )
        return (x, inner.carry), (stats, metrics)

    (x, carry), (stats, metrics) = jax.lax.scan(
        body, (x, dict(context.carry)), (states, stacked)
    )
    context.carry = carry
    index = _layer_indices(len(blocks))
    return x, _unstack(stats, index), _unstack(metrics, index)


def run_layers(
    blocks: Sequence[Block],
    x: jax.Array,
    *,
    options: Sequence[LayerOptions] | None,
    parallel,
    inputs: Sequence[Mapping[str, jax.Array]] | None = None,
    context: LayerContext | None = None,
    scan_from: int = 0,
    frozen: Sequence[bool] | None = None,
    remat: Sequence[str] | None = None,
) -> tuple[jax.Array, tuple[MoEStats, ...], tuple[dict[str, jax.Array], ...]]:
    """The one layer loop of the model and of every pipeline stage.

    ``options`` holds one `LayerOptions` per block (None: none), ``inputs`` each block's rows
    of the per-layer inputs (None: none; e.g. ragged MoE capacities, cached routes);
    ``context`` what the block wrappers share (`LayerContext`; default: none of it). Returns
    the output, the MoE blocks' stats in order and each block's hook metrics.

    ``scan_from`` (0: no scan; else >= 2, `GPTConfig.scan_from`): each run of that many or more
    consecutive blocks with equal static keys (`scan_runs`; ``frozen`` flags the blocks that
    get no gradient) runs as one ``jax.lax.scan`` (shorter runs unrolled), so the
    program holds one body per run rather than one per layer (MaxText's ``scan_layers`` idea,
    kept per run so that layers whose options diverge still run as they are). The wrappers'
    declared carry starts filled (`Hooks.initial_carry`), as a scan's carry keeps its keys.

    ``remat``: each block's rematerialisation policy (`dynjax.model.remat.REMAT`; None: "none"
    for all), applied around the block (around the scan body for a scanned run: consecutive
    layers of different policies run as different runs).
    """
    context = context if context is not None else LayerContext()
    options = options if options is not None else ((),) * len(blocks)
    inputs = inputs if inputs is not None else ({},) * len(blocks)
    frozen = frozen if frozen is not None else (False,) * len(blocks)
    remat = remat if remat is not None else ("none",) * len(blocks)
    if scan_from:
        runs = scan_runs(blocks, options, inputs, frozen, remat, scan_from)
        hooks = blocks[0].hooks if blocks else NO_HOOKS  # one model's blocks share theirs
        fill = hooks.initial_carry(hooks.carrying_wrappers(options), x.shape[:2])
        context.carry = {**fill, **context.carry}
    else:
        runs = tuple((i, i + 1) for i in range(len(blocks)))
    stats, metrics = [], []
    for start, stop in runs:
        if stop - start == 1:
            x, s, m = _run_block(
                blocks[start], x, inputs[start], options[start], parallel, context, remat[start]
            )
            s, m = [s], [m]
        else:
            x, s, m = _scan_blocks(
                blocks[start:stop],
                x,
                inputs[start:stop],
                options[start],
                parallel,
                context,
                remat[start],
            )
        stats.extend(one for one in s if one is not None)
        metrics.extend(m)
    return x, tuple(stats), tuple(metrics)


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size, cfg.d_model, embedding_init=nnx.initializers.normal(0.02), rngs=rngs
        )
        if cfg.positions == "learned":
            self.pos = nnx.Param(
                nnx.initializers.normal(0.01)(rngs.params(), (cfg.max_len, cfg.d_model))
            )
        self.layers = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = make_norm(cfg, rngs)
        self.head = nnx.Linear(
            cfg.d_model,
            cfg.vocab_size,
            kernel_init=nnx.initializers.normal(0.02),
            use_bias=cfg.family != "llama",
            rngs=rngs,
        )

    def __call__(
        self,
        tokens: jax.Array,
        *,
        parallel=None,
        options: Sequence[LayerOptions] | None = None,
        inputs: Sequence[Mapping[str, jax.Array]] | None = None,
    ) -> tuple[jax.Array, tuple[MoEStats, ...]]:
        """tokens [B, S] -> (logits [B, S, V] float32, stats of each MoE layer in order)."""
        logits, stats, _ = self.forward(tokens, parallel=parallel, options=options, inputs=inputs)
        return logits, stats

    def embedded(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """The embeddings of ``tokens`` [B, S], with the learned positions' at ``positions``
        [B, S] (default 0..S-1; a decoding step's are further on)."""
        x = self.embed(tokens)
        if self.cfg.positions == "learned":
            pos = self.pos[: tokens.shape[1]] if positions is None else self.pos[...][positions]
            x = x + pos.astype(x.dtype)
        return x

    def forward(
        self,
        tokens: jax.Array,
        *,
        parallel=None,
        options: Sequence[LayerOptions] | None = None,
        inputs: Sequence[Mapping[str, jax.Array]] | None = None,
        targets: jax.Array | None = None,
        inference: bool = False,
        frozen: Sequence[int] = (),
        remat: Sequence[str] | None = None,
    ):
        """`__call__` with each layer's options: also returns each layer's hook metrics.
        ``inputs``: each layer's per-layer inputs (`run_layers`);
        ``targets`` [B, S]: the next tokens, for wrappers that take a loss inside the stack;
        ``inference``: run the wrappers as evaluation or sampling does (`LayerContext`);
        ``frozen``: the layers that get no gradient (kept out of trainable layers' scans);
        ``remat``: each layer's rematerialisation policy (`run_layers`)."""
        x, stats, metrics = run_layers(
            list(self.layers),
            self.embedded(tokens),
            options=options,
            parallel=parallel,
            inputs=inputs,
            context=LayerContext(readout=self.readout, targets=targets, inference=inference),
            scan_from=self.cfg.scan_from,
            frozen=[i in frozen for i in range(len(self.layers))],
            remat=remat,
        )
        return self.readout(x), stats, metrics

    def readout(self, x: jax.Array) -> jax.Array:
        """Hidden states [..., D] -> float32 logits: the final norm and the LM head."""
        return self.head(self.norm(x)).astype(jnp.float32)


def abstract_gpt(cfg: GPTConfig) -> GPT:
    """``GPT(cfg)`` with shape-and-dtype leaves, no values: its graph and parameter layout (a
    new module each call, from one build per config: a run's start asks for it several times)."""
    return nnx.merge(*_abstract_split(cfg))


@functools.cache
def _abstract_split(cfg: GPTConfig) -> tuple[Any, Any]:
    """(graphdef, abstract state) of ``GPT(cfg)``, each block traced on its own rather than the
    whole model under one ``nnx.eval_shape``: every random draw writes the key counter through
    flax's ``Variable.set_value``, which reads ``sharding`` off the traced counter, and jax
    answers that with an error message built by walking the whole trace so far, so one trace
    of the model costs O(layers²) (48 quickstart layers: 10.6 s a build, against 2.3 s here)."""
    shell = nnx.eval_shape(lambda: GPT(dataclasses.replace(cfg, num_layers=0), rngs=nnx.Rngs(0)))
    shell.cfg = cfg
    shell.layers = nnx.List(
        [nnx.eval_shape(lambda i=i: Block(cfg, i, rngs=nnx.Rngs(0))) for i in range(cfg.num_layers)]
    )
    return nnx.split(shell)


def abstract_params(cfg: GPTConfig) -> dict[str, Any]:
    """The shapes and dtypes of `fresh_params` of ``cfg``, as ``jax.ShapeDtypeStruct`` leaves."""
    return nnx.to_pure_dict(nnx.state(abstract_gpt(cfg)))


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """The graph of each parameter unit of a GPT, so a pipeline stage, or a forward run stage by
    stage (freezing's plasticity probe), can run just its own units."""

    cfg: GPTConfig
    embed: Any  # nnx.GraphDef of each unit
    layers: tuple[Any, ...]
    norm: Any
    head: Any

    @classmethod
    def of(cls, cfg: GPTConfig) -> ModelParts:
        model = abstract_gpt(cfg)
        return cls(
            cfg=cfg,
            embed=nnx.graphdef(model.embed),
            layers=tuple(nnx.graphdef(block) for block in model.layers),
            norm=nnx.graphdef(model.norm),
            head=nnx.graphdef(model.head),
        )

    @property
    def learned_positions(self) -> bool:
        return self.cfg.positions == "learned"


def fresh_params(cfg: GPTConfig, seed: int) -> dict[str, Any]:
    """A new model's parameters as a pure dict (the NNX state without the modules)."""
    return nnx.to_pure_dict(nnx.state(GPT(cfg, rngs=nnx.Rngs(seed))))


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross entropy."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
