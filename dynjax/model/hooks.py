"""Per-layer static options and the block hooks that read them (docs/plugins.md).

A dynamism plugin gives each layer a frozen record (its *layer options*, computed once per
Plan); a `Block` receives the records of all plugins as `LayerOptions` and runs the hook of the
`HookSet` named like each record on its output. A hook may change the block's output and
returns named metrics, which the steps fold generically by the reduction its set declares.
The run's sets travel as data (`Hooks`): each plugin class names the sets its scheme uses,
`dynjax.dynamism.Schemes.hooks` assembles them at the edge, and the model config and step
options carry them to where they run; importing a module registers nothing.
A *weight hook* runs before the block instead, on the block's parameters (e.g. pruning
masks the gradients of its pruned weights and reports their density). Schemes that change the
inside of a block (e.g. sparse matmuls) read their record there; their metrics' reductions
still go in a `HookSet` of that name.

Schemes that change *which tokens* a block computes (mixture of depths) need two more hooks: a
*block part*, a parameterised submodule a plugin adds to chosen layers (its parameters live under
the layer, so they migrate, checkpoint and restore with it), and a *block wrapper*, which runs the
block's residual body on tokens it chooses. A metric declared as a *loss* is added to the
training loss by both steps, so a part's auxiliary objective trains without them knowing it.

Schemes that score tokens in the middle of the stack (early exit) also get the forward's
`LayerContext`: the model's readout (final norm + LM head), the targets, and a per-token carry
that flows from layer to layer (which tokens remain). A wrapper declares what it needs of the
context (`HookSet` ``needs``, ``carry``), so a pipeline stage, which holds only
some layers, gets exactly that: the readout's parameters sent from the last stage, the
microbatch's targets, and the carry from the stage before it.

A forward that evaluates or samples rather than trains sets ``LayerContext.inference``
(`StageSpec.inference`: the single program's evaluation step, a one-stage spec, and a pipeline's
evaluation programs; it is static, so the inference forward is its own compiled program). A
wrapper whose training forward may look ahead in the sequence reads it to run as a causal sampler
would: mixture of depths then routes by its causal predictor instead of the sequence's top-k
(Raposo et al. §3.5; seed 000 §2.6), so the evaluation loss is the one sampling would see.

Schemes that keep state of their own in a layer and move it after each step from that step's
metrics, outside the optimizer (auxiliary-loss-free balancing's routed bias, DeepSeek-V3
§2.1.2), declare a *state rule*: both steps (the single program, and each pipeline stage's
update program on its own layers) run it after the optimizer update on every trainable layer
whose options hold a record of its name, with the layer's step metrics (`StateRule`). The
state is a variable of the layer, so it moves with the layer between stages and is
checkpointed, restored and resharded by path like the weights; the variables a rule owns are
named in its set, so the steps keep them in float32 (`full_precision`).
"""

from __future__ import annotations

import dataclasses
import functools
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
# record) -> the replaced entries. The step metrics of a layer: each metric "<name>/..." the
# layer reported for a record ``name`` it holds (a set's hooks run on exactly the layers that
# hold its record), folded over the step's microbatches.
StateRule = Callable[[dict[str, jax.Array], Mapping[str, jax.Array], Any], dict[str, jax.Array]]
# (the hook metrics of a stage's layers in order, the records of the set's name among them in
# order, possibly none) -> (a term of the loss to minimise, step metrics: scalars by name)
StageLoss = Callable[
    [Sequence[Mapping[str, jax.Array]], Sequence[Any]], tuple[jax.Array, dict[str, jax.Array]]
]
# (a step's folded metrics of the whole model, the array module: ``jnp`` inside a program,
# ``np`` on the host) -> metrics that follow from them
Derived = Callable[[Mapping[str, Any], Any], dict[str, Any]]
STAGE_REDUCTIONS = ("last", "first", "sum")  # a step metric over pipeline stages

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

CONTEXT_NEEDS = ("readout", "targets")  # what of a `LayerContext` a wrapper may need
# (carry key, dtype, fill): one per-token [B, S] array a wrapper leaves for the layers after it
CarryEntry = tuple[str, Any, Any]


@dataclasses.dataclass(frozen=True)
class HookSet:
    """What the model runs for layers whose options hold a record ``name``: the code a scheme
    adds to the forward and how its metrics reduce. Frozen and hashable (it names functions,
    which hash by identity), so the model config and the specs that carry it key the compile
    cache; a module that defines hooks exposes its `HookSet` as a value and registers nothing.

    - ``block``: ``hook(block_output, record) -> (output, metrics)`` after the block; with
      ``reads`` (names of per-layer step or batch inputs, `Plugin.step_inputs`,
      `Plugin.batch_inputs`), ``hook(block_output, record, inputs)`` with the layer's rows of
      those it is given;
    - ``weight``: ``hook(weights, record) -> (replacements, metrics)`` before it: ``weights``
      maps the block's parameter paths (``"attn/qkv/kernel"``, ``"moe/w_in"``) to arrays, the
      block then runs with the replaced weights (part of the differentiated forward);
    - ``wrapper``: ``wrapper(residual, x, record, part, context)`` runs the block's residual
      body instead of it running on all tokens (one wrapper per block: a layer whose options
      name two is refused when it runs); ``part`` is the block's part of the same name (None
      without one), ``context`` the forward's `LayerContext`, of which the wrapper reads
      ``needs`` (`CONTEXT_NEEDS`) and leaves ``carry`` (``(key, dtype, fill)``, the fill being
      its value before any layer wrote it); a pipeline passes exactly these between stages;
    - ``part``: ``factory(cfg, settings, rngs)``, the module `GPTConfig.block_parts` entries
      of this name build as the attribute ``name`` of their layer's block;
    - ``state_rule``: ``rule(state, metrics, record)`` after each step's optimizer update on
      every trainable layer holding the record (module docstring, `StateRule`); ``rule_state``
      names the attributes of the variables it moves (e.g. ``"routed_bias"``): the steps keep
      them in float32 whatever the compute dtype, since a rule's small steps would be lost in
      bfloat16 (keeping them out of the optimizer is the plugin's, `Plugin.wrap_optimizer`);
    - ``reductions``: ``(metric, reduction)`` of each metric (`REDUCTIONS`; undeclared ones
      reduce by "mean"); ``losses``: scalar metrics that are also terms of the training loss
      (summed over the layers);
    - ``stage_loss``: ``loss(layer_metrics, records) -> (term, step metrics)`` on every stage
      (the single program's one included), given its layers' hook metrics and the records of
      this name among them (none on a stage without any): a term added to the stage's loss
      before the declared ``losses`` (e.g. MoE's weighted auxiliary losses) and scalar step
      metrics, declared in ``step_metrics`` as ``(name, over microbatches, over stages)``
      (`STAGE_REDUCTIONS`); the training loop logs them to metrics.jsonl;
    - ``derived``: ``derived(metrics, xp)``, metrics that follow from a whole step's folded
      metrics (e.g. MoE's dropped fraction), computed after the fold by both runtimes;
    - ``update_record``: what of a record the update program depends on (default: all of
      it); the rest (e.g. MoE's capacities) changes only the forward and backward programs.
    """

    name: str
    block: BlockHook | None = None
    weight: WeightHook | None = None
    wrapper: BlockWrapper | None = None
    part: PartFactory | None = None
    state_rule: StateRule | None = None
    rule_state: tuple[str, ...] = ()
    needs: frozenset[str] = frozenset()
    carry: tuple[CarryEntry, ...] = ()
    reductions: tuple[tuple[str, str], ...] = ()
    losses: tuple[str, ...] = ()
    stage_loss: StageLoss | None = None
    step_metrics: tuple[tuple[str, str, str], ...] = ()
    derived: Derived | None = None
    update_record: Callable[[Any], Any] | None = None
    reads: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        bad = set(self.needs) - set(CONTEXT_NEEDS)
        if bad:
            raise ValueError(f"unknown context needs {sorted(bad)}: use some of {CONTEXT_NEEDS}")
        wrong = {k: v for k, v in self.reductions if v not in REDUCTIONS}
        wrong |= {k: (m, s) for k, m, s in self.step_metrics if m not in REDUCTIONS[:2]}
        wrong |= {k: (m, s) for k, m, s in self.step_metrics if s not in STAGE_REDUCTIONS}
        if wrong:
            raise ValueError(
                f"unknown reductions {wrong}: use one of {REDUCTIONS} (step metrics: of "
                f"{REDUCTIONS[:2]} over microbatches, of {STAGE_REDUCTIONS} over stages)"
            )


@dataclasses.dataclass(frozen=True)
class Hooks:
    """A run's hook sets, assembled at the edge (`dynjax.dynamism.Schemes.hooks`) and carried
    down as data (`GPTConfig.hooks`, which the stage functions read): every lookup below reads
    them, no module table. Equal sets give equal, equally hashed `Hooks`, so equal Plans keep equal
    compile-cache keys."""

    sets: tuple[HookSet, ...] = ()

    def __post_init__(self) -> None:
        names = [s.name for s in self.sets]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"two hook sets are named {twice}")

    @functools.cached_property
    def _by_name(self) -> dict[str, HookSet]:
        return {s.name: s for s in self.sets}

    def _set(self, name: str) -> HookSet:
        """The hook set ``name`` (an empty one for a record no hook reads)."""
        return self._by_name.get(name) or HookSet(name)

    def _named(self, options: LayerOptions, kind: str) -> list[tuple[str, Any, Any]]:
        """(name, its hook of ``kind``, record) of each record of ``options`` that has one."""
        found = [(name, getattr(self._set(name), kind), record) for name, record in options]
        return [f for f in found if f[1] is not None]

    def reduction(self, metric: str) -> str:
        """How ``metric`` folds over microbatches (default "mean")."""
        return self._reductions.get(metric, "mean")

    @functools.cached_property
    def _reductions(self) -> dict[str, str]:
        return {k: v for s in self.sets for k, v in s.reductions}

    @functools.cached_property
    def step_metrics(self) -> dict[str, tuple[str, str]]:
        """``{name: (over microbatches, over stages)}`` of the sets' step metrics."""
        return {k: (m, s) for hs in self.sets for k, m, s in hs.step_metrics}

    def stage_loss(
        self,
        layer_metrics: Sequence[Mapping[str, jax.Array]],
        options: Sequence[LayerOptions],
    ) -> tuple[jax.Array | None, dict[str, jax.Array]]:
        """Every set's `HookSet.stage_loss` on one stage (``options``: its layers'), summed in
        set order (None: no set has one), and their step metrics."""
        total, metrics = None, {}
        for hs in self.sets:
            if hs.stage_loss is None:
                continue
            records = [dict(o)[hs.name] for o in options if hs.name in dict(o)]
            term, out = hs.stage_loss(layer_metrics, records)
            total = term if total is None else total + term
            metrics.update(out)
        return total, metrics

    def has_stage_loss(self, options: Sequence[LayerOptions]) -> bool:
        """Whether a set with a stage loss has records among ``options`` (without any, its
        stage loss sees the same empty records on every part of a stage)."""
        return any(
            hs.stage_loss is not None and any(hs.name in dict(o) for o in options)
            for hs in self.sets
        )

    def derived(self, metrics: Mapping[str, Any], xp: Any) -> dict[str, Any]:
        """What every set's `HookSet.derived` makes of a step's folded ``metrics``."""
        out: dict[str, Any] = {}
        for hs in self.sets:
            if hs.derived is not None:
                out.update(hs.derived(metrics, xp))
        return out

    def update_options(self, options: Sequence[LayerOptions]) -> tuple[LayerOptions, ...]:
        """``options`` as the update program reads them (`HookSet.update_record`)."""
        def keep(name: str, record: Any) -> Any:
            cut = self._set(name).update_record
            return record if cut is None else cut(record)

        return tuple(tuple((n, keep(n, r)) for n, r in o) for o in options)

    def loss(self, layer_metrics: Sequence[Mapping[str, jax.Array]]) -> jax.Array:
        """The loss terms the layers' metrics hold (`HookSet.losses`), summed."""
        losses = sorted({name for s in self.sets for name in s.losses})
        return sum(
            (m[name] for m in layer_metrics for name in losses if name in m), jnp.float32(0)
        )

    def make_part(self, name: str, cfg: Any, settings: Any, rngs: nnx.Rngs) -> nnx.Module:
        factory = self._set(name).part
        if factory is None:
            raise ValueError(f"no hook set has a block part {name!r}: give the run its scheme")
        return factory(cfg, settings, rngs)

    def block_wrapper(self, options: LayerOptions) -> tuple[str, BlockWrapper, Any] | None:
        """(name, wrapper, record) of the one block wrapper ``options`` name, or None."""
        found = self._named(options, "wrapper")
        if len(found) > 1:
            names = [f[0] for f in found]
            raise ValueError(f"a block takes one block wrapper, its options name {names}")
        return found[0] if found else None

    def context_needs(self, options: Sequence[LayerOptions]) -> frozenset[str]:
        """What of the `LayerContext` the wrappers of layers with ``options`` read."""
        return frozenset(
            n for opts in options for name, _ in opts for n in self._set(name).needs
        )

    def carrying_wrappers(self, options: Sequence[LayerOptions]) -> tuple[str, ...]:
        """The wrappers named by ``options`` that declare a carry, sorted."""
        names = {name for opts in options for name, _ in opts}
        return tuple(sorted(n for n in names if self._set(n).carry))

    def carry_dtypes(self, wrappers: Sequence[str]) -> dict[str, Any]:
        """``{carry key: dtype}`` of the carry ``wrappers`` declare."""
        return {k: dtype for w in wrappers for k, dtype, _ in self._by_name[w].carry}

    def initial_carry(
        self, wrappers: Sequence[str], shape: tuple[int, int]
    ) -> dict[str, jax.Array]:
        """The carry of ``wrappers`` before any layer: each key [B, S] filled with its fill."""
        return {
            k: jnp.full(shape, fill, dtype)
            for w in wrappers
            for k, dtype, fill in self._by_name[w].carry
        }

    def state_rules(self, options: LayerOptions) -> list[tuple[str, StateRule, Any]]:
        """(name, rule, record) of each state rule ``options`` name, in name order."""
        return self._named(options, "state_rule")

    def full_precision(self, attribute: Any) -> bool:
        """Whether a variable named ``attribute`` is a state rule's: kept in float32."""
        return attribute in self._rule_state

    @functools.cached_property
    def _rule_state(self) -> frozenset[str]:
        return frozenset(a for s in self.sets for a in s.rule_state)

    def apply_state_rules(
        self, layer: Mapping[str, Any], metrics: Mapping[str, jax.Array], options: LayerOptions
    ) -> dict[str, Any]:
        """One layer's state (a pure dict, as the steps hold it) after every state rule its
        options name, given the layer's step metrics (`StateRule`)."""
        rules = self.state_rules(options)
        if not rules:
            return dict(layer)
        paths, treedef = jax.tree_util.tree_flatten_with_path(layer)
        names = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in paths]
        state = dict(zip(names, (leaf for _, leaf in paths), strict=True))
        for name, rule, record in rules:
            replaced = rule(dict(state), metrics, record)
            unknown = set(replaced) - set(state)
            if unknown:
                raise ValueError(
                    f"state rule {name!r} returned {sorted(unknown)}: not in the layer"
                )
            state.update(replaced)
        return jax.tree_util.tree_unflatten(treedef, [state[n] for n in names])

    def apply_block_hooks(
        self, x: jax.Array, options: LayerOptions, inputs: Mapping[str, jax.Array] | None = None
    ) -> tuple[jax.Array, dict]:
        """The block output after every hook its options name (a hook whose set ``reads``
        per-layer inputs gets the layer's rows of them among ``inputs``), and the hooks'
        metrics."""
        metrics: dict[str, jax.Array] = {}
        for name, hook, record in self._named(options, "block"):
            reads = self._set(name).reads
            if reads:
                held = {k: v for k, v in (inputs or {}).items() if k in reads}
                x, out = hook(x, record, held)
            else:
                x, out = hook(x, record)
            metrics.update(out)
        return x, metrics

    def apply_weight_hooks(
        self, block: nnx.Module, options: LayerOptions
    ) -> tuple[nnx.Module, dict]:
        """A copy of ``block`` whose weights went through every weight hook its options name
        (``block`` itself when none does), and the hooks' metrics."""
        hooked = self._named(options, "weight")
        if not hooked:
            return block, {}
        graphdef, state = nnx.split(block)
        paths, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
        names = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in paths]
        weights = dict(zip(names, (leaf for _, leaf in paths), strict=True))
        metrics: dict[str, jax.Array] = {}
        for _, hook, record in hooked:
            replaced, out = hook(dict(weights), record)
            weights.update(replaced)
            metrics.update(out)
        pure = jax.tree_util.tree_unflatten(treedef, [weights[n] for n in names])
        nnx.replace_by_pure_dict(state, pure)
        return nnx.merge(graphdef, state), metrics


NO_HOOKS = Hooks()  # a model whose layers' records run nothing (the default of every holder)


def layer_options(records: Mapping[str, Any]) -> LayerOptions:
    """``{plugin: record}`` -> `LayerOptions` (records of None are left out)."""
    return tuple(sorted((k, v) for k, v in records.items() if v is not None))
