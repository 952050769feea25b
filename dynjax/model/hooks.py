"""Per-layer static options and the block hooks that read them (DESIGN.md "Dynamism plugins").

A dynamism plugin gives each layer a frozen record (its *layer options*, computed once per
Plan); a `Block` receives the records of all plugins as `LayerOptions` and runs the hook
registered under each record's name on its output. A hook may change the block's output and
returns named metrics, which the steps fold generically by the reduction registered with
them. A *weight hook* runs before the block instead, on the block's parameters (e.g. pruning
masks the gradients of its pruned weights and reports their density). Schemes that change the
inside of a block (e.g. sparse matmuls) read their record there; their metrics still go
through `register_metrics`.

Schemes that change *which tokens* a block computes (mixture of depths) need two more hooks: a
*block part*, a parameterised submodule a plugin adds to chosen layers (its parameters live under
the layer, so they migrate, checkpoint and restore with it), and a *block wrapper*, which runs the
block's residual body on tokens it chooses. A metric registered as a *loss* is added to the
training loss by both steps, so a part's auxiliary objective trains without them knowing it.

Schemes that score tokens in the middle of the stack (early exit) also get the forward's
`LayerContext`: the model's readout (final norm + LM head), the targets, and a per-token carry
that flows from layer to layer (which tokens remain). A wrapper declares what it needs of the
context (`register_block_wrapper` ``needs``, ``carry``), so a pipeline stage, which holds only
some layers, gets exactly that: the readout's parameters sent from the last stage, the
microbatch's targets, and the carry from the stage before it.

A forward that evaluates or samples rather than trains sets ``LayerContext.inference``
(`StepOptions.inference` on the single-program path, `StageSpec.inference` on a pipeline's
evaluation programs; both are static, so the inference forward is its own compiled program). A
wrapper whose training forward may look ahead in the sequence reads it to run as a causal sampler
would: mixture of depths then routes by its causal predictor instead of the sequence's top-k
(Raposo et al. §3.5; seed 000 §2.6), so the evaluation loss is the one sampling would see.

Schemes that keep state of their own in a layer and move it after each step from that step's
metrics, outside the optimizer (auxiliary-loss-free balancing's routed bias, DeepSeek-V3
§2.1.2), register a *state rule*: both steps (the single program, and each pipeline stage's
update program on its own layers) run it after the optimizer update on every trainable layer
whose options hold a record of its name, with the layer's step metrics (`StateRule`). The
state is a variable of the layer, so it moves with the layer between stages and is
checkpointed, restored and resharded by path like the weights; the variables a rule owns are
named when it registers, so the steps keep them in float32 (`full_precision`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# (plugin name, its per-layer record), sorted by name; hashable, so specs that hold it key
# the compile cache.
LayerOptions = tuple[tuple[str, Any], ...]
BlockHook = Callable[[jax.Array, Any], tuple[jax.Array, dict[str, jax.Array]]]
REDUCTIONS = ("mean", "sum", "rows")  # over microbatches: average, add, or rows in batch order

# (the block's weights by "/"-joined path inside it, record) -> (replaced weights, metrics)
WeightHook = Callable[[dict[str, jax.Array], Any], tuple[dict[str, jax.Array], dict]]
# (the layer's state by "/"-joined path after the optimizer update, the layer's step metrics,
# record) -> the replaced entries. The step metrics of a layer: each metric "<rule name>/..."
# the layer reported (its hooks of the rule's name run on exactly the layers that hold the
# record), folded over the step's microbatches, and on an MoE layer `MOE_LOADS`.
StateRule = Callable[[dict[str, jax.Array], Mapping[str, jax.Array], Any], dict[str, jax.Array]]
# [E] int32 of an MoE layer: the step's (token, choice) pairs routed to each expert, before
# dropping (the row of the step metric of the same name)
MOE_LOADS = "moe/tokens_per_expert"

# The block's residual body on any token subset: (x [B, S, D], the tokens' original positions
# [B, S] or None for all, and optionally the whole sequence [B, T, D] whose keys and values
# they attend to, default x) -> (its output, MoE stats or None, metrics of what ran inside).
Residual = Callable[..., tuple[jax.Array, Any, dict[str, jax.Array]]]


@dataclasses.dataclass
class LayerContext:
    """What one forward gives the layers beyond their input: ``readout`` maps hidden states
    [..., D] to float32 logits (the model's final norm and LM head; a pipeline stage gets them
    where its wrappers declare the need), ``targets`` [B, S] the next tokens (None without a
    loss), ``carry``, per-token arrays a wrapper leaves for the layers after it (keyed by its
    name), and ``inference``: the forward evaluates or samples, so every token's output may
    depend only on it and earlier tokens (see the module docstring)."""

    readout: Callable[[jax.Array], jax.Array] | None = None
    targets: jax.Array | None = None
    carry: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
    inference: bool = False


# (the residual body, x, the layer's record, the layer's part of the same name or None, the
# forward's context) -> (the block's output, MoE stats or None, metrics)
BlockWrapper = Callable[
    [Residual, jax.Array, Any, nnx.Module | None, LayerContext],
    tuple[jax.Array, Any, dict[str, jax.Array]],
]
# (the model config, the part's hashable settings, rngs) -> the part's module
PartFactory = Callable[[Any, Any, nnx.Rngs], nnx.Module]
# (layer index, part name, hashable settings): one entry of `GPTConfig.block_parts`
BlockPart = tuple[int, str, Any]

_HOOKS: dict[str, BlockHook] = {}
_WEIGHT_HOOKS: dict[str, WeightHook] = {}
_WRAPPERS: dict[str, BlockWrapper] = {}
_PARTS: dict[str, PartFactory] = {}
_STATE_RULES: dict[str, StateRule] = {}
_RULE_STATE: set[str] = set()  # attribute names of the variables state rules own
_REDUCTIONS: dict[str, str] = {}
_LOSSES: set[str] = set()
CONTEXT_NEEDS = ("readout", "targets")  # what of a `LayerContext` a wrapper may need
_NEEDS: dict[str, frozenset[str]] = {}  # wrapper -> the parts of the context it reads
_CARRY: dict[str, dict[str, tuple[Any, Any]]] = {}  # wrapper -> {carry key: (dtype, fill)}


def layer_options(records: Mapping[str, Any]) -> LayerOptions:
    """``{plugin: record}`` -> `LayerOptions` (records of None are left out)."""
    return tuple(sorted((k, v) for k, v in records.items() if v is not None))


def register_block_hook(
    name: str, hook: BlockHook, metrics: Mapping[str, str] | None = None
) -> None:
    """Run ``hook(block_output, record)`` on every layer whose options hold a record ``name``;
    it returns ``(output, metrics)``, metrics named ``"<name>/<metric>"``. ``metrics`` gives
    each metric's reduction over microbatches (`REDUCTIONS`)."""
    _HOOKS[name] = hook
    register_metrics(metrics or {})


def register_weight_hook(
    name: str, hook: WeightHook, metrics: Mapping[str, str] | None = None
) -> None:
    """Run ``hook(weights, record)`` before every block whose options hold a record ``name``:
    ``weights`` maps the block's parameter paths (``"attn/qkv/kernel"``, ``"moe/w_in"``) to
    arrays; it returns ``(replacements, metrics)``, the block then runs with the replaced
    weights (what it does to them is part of the differentiated forward)."""
    _WEIGHT_HOOKS[name] = hook
    register_metrics(metrics or {})


def register_block_wrapper(
    name: str,
    wrapper: BlockWrapper,
    metrics: Mapping[str, str] | None = None,
    *,
    needs: Sequence[str] = (),
    carry: Mapping[str, tuple[Any, Any]] | None = None,
) -> None:
    """Run every block whose options hold a record ``name`` through
    ``wrapper(residual, x, record, part, context)`` instead of its residual body on all tokens;
    ``part`` is the block's part registered under the same name (None without one), ``context``
    the forward's `LayerContext`. One wrapper per block: a layer whose options name two is
    refused when it runs.

    ``needs`` names the parts of the context it reads (`CONTEXT_NEEDS`); ``carry`` declares
    each per-token [B, S] array it leaves in ``context.carry`` as ``{key: (dtype, fill)}``, the
    fill being its value before any layer wrote it. A pipeline passes exactly these between
    stages (the carry is not differentiated)."""
    bad = set(needs) - set(CONTEXT_NEEDS)
    if bad:
        raise ValueError(f"unknown context needs {sorted(bad)}: use some of {CONTEXT_NEEDS}")
    _WRAPPERS[name] = wrapper
    _NEEDS[name] = frozenset(needs)
    _CARRY[name] = dict(carry or {})
    register_metrics(metrics or {})


def register_block_part(name: str, factory: PartFactory) -> None:
    """Let `GPTConfig.block_parts` entries named ``name`` build ``factory(cfg, settings, rngs)``
    as the attribute ``name`` of their layer's block."""
    _PARTS[name] = factory


def register_state_rule(name: str, rule: StateRule, state: Sequence[str]) -> None:
    """Run ``rule(state, metrics, record)`` after each step's optimizer update on every
    trainable layer whose options hold a record ``name`` (module docstring, `StateRule`).
    ``state`` names the attributes of the variables it moves (e.g. ``"routed_bias"``): the steps
    keep them in float32 whatever the compute dtype, since a rule's small steps would be lost
    in bfloat16. Keeping them out of the optimizer is the plugin's (`Plugin.wrap_optimizer`)."""
    _STATE_RULES[name] = rule
    _RULE_STATE.update(state)


def state_rules(options: LayerOptions) -> list[tuple[str, StateRule, Any]]:
    """(name, rule, record) of each state rule ``options`` name, in name order."""
    return [(name, _STATE_RULES[name], record) for name, record in options if name in _STATE_RULES]


def full_precision(attribute: Any) -> bool:
    """Whether a variable named ``attribute`` is a state rule's: kept in float32."""
    return attribute in _RULE_STATE


def apply_state_rules(
    layer: Mapping[str, Any], metrics: Mapping[str, jax.Array], options: LayerOptions
) -> dict[str, Any]:
    """One layer's state (a pure dict, as the steps hold it) after every state rule its
    options name, given the layer's step metrics (`StateRule`)."""
    rules = state_rules(options)
    if not rules:
        return dict(layer)
    paths, treedef = jax.tree_util.tree_flatten_with_path(layer)
    names = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in paths]
    state = dict(zip(names, (leaf for _, leaf in paths), strict=True))
    for name, rule, record in rules:
        own = {k: v for k, v in metrics.items() if k.startswith(f"{name}/") or k == MOE_LOADS}
        replaced = rule(dict(state), own, record)
        unknown = set(replaced) - set(state)
        if unknown:
            raise ValueError(f"state rule {name!r} returned {sorted(unknown)}: not in the layer")
        state.update(replaced)
    return jax.tree_util.tree_unflatten(treedef, [state[n] for n in names])


def make_block_part(name: str, cfg: Any, settings: Any, rngs: nnx.Rngs) -> nnx.Module:
    if name not in _PARTS:
        raise ValueError(f"no block part registered as {name!r}: import the plugin defining it")
    return _PARTS[name](cfg, settings, rngs)


def block_wrapper(options: LayerOptions) -> tuple[str, BlockWrapper, Any] | None:
    """(name, wrapper, record) of the one block wrapper ``options`` name, or None."""
    found = [(name, _WRAPPERS[name], record) for name, record in options if name in _WRAPPERS]
    if len(found) > 1:
        names = [f[0] for f in found]
        raise ValueError(f"a block takes one block wrapper, its options name {names}")
    return found[0] if found else None


def context_needs(options: Sequence[LayerOptions]) -> frozenset[str]:
    """What of the `LayerContext` the wrappers of layers with ``options`` read."""
    return frozenset(n for opts in options for name, _ in opts for n in _NEEDS.get(name, ()))


def carrying_wrappers(options: Sequence[LayerOptions]) -> tuple[str, ...]:
    """The wrappers named by ``options`` that declare a carry, sorted."""
    return tuple(sorted({name for opts in options for name, _ in opts if _CARRY.get(name)}))


def carry_dtypes(wrappers: Sequence[str]) -> dict[str, Any]:
    """``{carry key: dtype}`` of the carry ``wrappers`` declare."""
    return {k: dtype for w in wrappers for k, (dtype, _) in _CARRY[w].items()}


def initial_carry(wrappers: Sequence[str], shape: tuple[int, int]) -> dict[str, jax.Array]:
    """The carry of ``wrappers`` before any layer: each key [B, S] filled with its fill."""
    return {
        k: jnp.full(shape, fill, dtype) for w in wrappers for k, (dtype, fill) in _CARRY[w].items()
    }


def register_metrics(metrics: Mapping[str, str], losses: tuple[str, ...] = ()) -> None:
    """Declare how per-layer metrics fold over microbatches (default: "mean"); ``losses`` name
    scalar metrics that are also terms of the training loss (summed over the layers)."""
    bad = {k: v for k, v in metrics.items() if v not in REDUCTIONS}
    if bad:
        raise ValueError(f"unknown reductions {bad}: use one of {REDUCTIONS}")
    _REDUCTIONS.update(metrics)
    _LOSSES.update(losses)


def hook_loss(layer_metrics: Sequence[Mapping[str, jax.Array]]) -> jax.Array:
    """The loss terms the layers' metrics hold (`register_metrics` ``losses``), summed."""
    return sum(
        (m[name] for m in layer_metrics for name in sorted(_LOSSES) if name in m),
        jnp.float32(0),
    )


def reduction(metric: str) -> str:
    return _REDUCTIONS.get(metric, "mean")


def apply_block_hooks(x: jax.Array, options: LayerOptions) -> tuple[jax.Array, dict]:
    """The block output after every hook its options name, and the hooks' metrics."""
    metrics: dict[str, jax.Array] = {}
    for name, record in options:
        hook = _HOOKS.get(name)
        if hook is None:
            continue
        x, out = hook(x, record)
        metrics.update(out)
    return x, metrics


def apply_weight_hooks(block: nnx.Module, options: LayerOptions) -> tuple[nnx.Module, dict]:
    """A copy of ``block`` whose weights went through every weight hook its options name
    (``block`` itself when none does), and the hooks' metrics."""
    hooked = [(_WEIGHT_HOOKS[name], record) for name, record in options if name in _WEIGHT_HOOKS]
    if not hooked:
        return block, {}
    graphdef, state = nnx.split(block)
    paths, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
    names = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in paths]
    weights = dict(zip(names, (leaf for _, leaf in paths), strict=True))
    metrics: dict[str, jax.Array] = {}
    for hook, record in hooked:
        replaced, out = hook(dict(weights), record)
        weights.update(replaced)
        metrics.update(out)
    pure = jax.tree_util.tree_unflatten(treedef, [weights[n] for n in names])
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state), metrics
