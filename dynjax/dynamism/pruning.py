"""Gradual global magnitude pruning as a dynamism plugin (seed 000 §2.2, §3.2.1 eq. 3, Alg. 1;
seed 003 §B; docs/schemes/pruning.md).

Every ``pruning.every`` steps from ``pruning.start_step`` on, the matrices ``pruning.include``
selects are ranked by magnitude over the whole model and all but Zhu & Gupta's cubic target
are zeroed, so layers end up with different densities (the imbalance DynMo balances). The math
(schedule, scores, the exact distributed top-k) is `dynjax.dynamism.pruning_math`; here:

- masks are train state: `masked` wraps the optimizer (`PruneState`: keep masks beside the
  inner state, moved, checkpointed and resharded like the Adam moments) and keeps pruned
  weights exactly zero;
- events between steps (`PruningPlugin.before_step`): one global selection, then per stage the
  weights, masks and pruned Adam moments updated on the stage's devices; a ``prune`` event;
- the forward (a weight hook) uses ``w * (w != 0)`` with the pattern held constant, so pruned
  weights get no gradient and ``grad_norm`` counts kept weights only; it reports
  ``pruning/density`` per layer, the layer's cost (`metric_costs`, from the metrics, not the
  Plan, which would recompile at every event);
- ``pruning.scale="init"`` ranks ``|w|`` in units of each matrix's init std
  (`dynjax.model.gpt.init_std`) instead of raw magnitudes, which prune GPT-2's smaller residual
  projections first; ``granularity="block"`` ranks ``block_size`` blocks by Frobenius norm
  (`pruning_math.block_scores`), whole blocks a block-sparse matmul can skip.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import time
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from dynjax.dynamism import pruning_math as pm
from dynjax.dynamism.base import Plugin
from dynjax.errors import ConfigError, at_least
from dynjax.model import GPTConfig, abstract_params
from dynjax.model.facts import ModelFacts
from dynjax.model.gpt import init_std
from dynjax.model.hooks import HookSet
from dynjax.model.pruned import LINEARS, SparseLinears, column_counts
from dynjax.model.sparse_linear import Widths, group_blocks, group_widths
from dynjax.parallel.peers import ALONE, Rounds
from dynjax.recompile import History, Proposal

if TYPE_CHECKING:
    from dynjax.recompile import Plan, Policy
    from dynjax.runlog.plots import PlotEntry

NAME = "pruning"
DENSITY = "pruning/density"  # [L] per step: each layer's (FLOP-weighted) fraction of kept weights
# [L, len(LINEARS), C]: per dense linear, its block-columns' present blocks, descending (-1 pads
# to the widest linear's C; all -1: not pruned).
COLUMN_COUNTS = "pruning/column_counts"
GRANULARITIES = ("element", "block")
SCALES = ("init", "none")


# ---------------------------------------------------------------------------------------------
# Masks in the optimizer state


class PruneState(NamedTuple):
    """The state of `masked`: keep masks beside the wrapped optimizer's state."""

    masks: Any  # params-shaped: bool (True = kept) for prunable leaves, None for the others
    inner: Any  # the wrapped optimizer's state


def _name(path: tuple) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def mask_tree(params: Any, masks: Mapping[str, Any]) -> Any:
    """A params-shaped tree holding ``masks[name]`` at each named leaf and None elsewhere."""
    return jax.tree_util.tree_map_with_path(lambda p, _: masks.get(_name(p)), params)


def apply_masks(tree: Any, masks: Any) -> Any:
    """``tree`` (params-shaped) with the entries that ``masks`` (a `mask_tree`) prunes zeroed."""
    return jax.tree.map(
        lambda m, x: x if m is None else jnp.where(m, x, jnp.zeros_like(x)),
        masks,
        tree,
        is_leaf=lambda m: m is None,
    )


def masked(
    inner: optax.GradientTransformation, include: str = pm.DEFAULT_INCLUDE
) -> optax.GradientTransformation:
    """``inner`` with keep masks for the leaves ``include`` selects (all kept at ``init``).

    ``update`` zeroes the gradients of pruned entries, runs ``inner``, and zeroes their updates:
    a pruned weight gets no step from momentum or weight decay, so it stays exactly zero.

    Example:
      >>> params = {"mlp": {"up": {"kernel": jnp.ones((2, 2))}, "bias": jnp.ones(2)}}
      >>> opt = masked(optax.adamw(0.1, weight_decay=0.5), include=r"kernel$")
      >>> state = opt.init(params)
      >>> keep = jnp.array([[True, False], [True, True]])
      >>> state = state._replace(masks=mask_tree(params, {"mlp/up/kernel": keep}))
      >>> params = apply_masks(params, state.masks)
      >>> grads = jax.tree.map(jnp.ones_like, params)
      >>> updates, state = opt.update(grads, state, params)
      >>> optax.apply_updates(params, updates)["mlp"]["up"]["kernel"][0, 1].item()
      0.0
    """

    def init(params):
        keep = {
            name: jnp.ones(w.shape, bool) for name, w in pm.prunable_leaves(params, include).items()
        }
        return PruneState(masks=mask_tree(params, keep), inner=inner.init(params))

    def update(grads, state, params=None):
        grads = apply_masks(grads, state.masks)
        updates, inner_state = inner.update(grads, state.inner, params)
        return apply_masks(updates, state.masks), PruneState(state.masks, inner_state)

    return optax.GradientTransformation(init, update)


def prune_states(opt_state: Any) -> list[PruneState]:
    """The `PruneState`s inside an optimizer state (one for a run's, wherever it is wrapped)."""
    is_state = lambda x: isinstance(x, PruneState)
    return [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]


def named_masks(opt_state: Any) -> dict[str, jax.Array]:
    """The keep masks of an optimizer state by parameter path (``layers/3/mlp/up/kernel``)."""
    [state] = prune_states(opt_state)
    return {_name(p): m for p, m in jax.tree_util.tree_flatten_with_path(state.masks)[0]}


def _with_masks(params: Any, opt_state: Any, keep: Mapping[str, jax.Array]):
    """(params * masks, opt_state with the masks replaced and Adam's moments of pruned entries
    zeroed, kept count of each mask): the state after a pruning event, for one stage."""
    masks = mask_tree(params, keep)
    is_node = lambda x: isinstance(x, PruneState | optax.ScaleByAdamState)

    def rewrite(node):
        if isinstance(node, PruneState):
            return PruneState(masks, jax.tree.map(rewrite, node.inner, is_leaf=is_node))
        if isinstance(node, optax.ScaleByAdamState):
            return node._replace(mu=apply_masks(node.mu, masks), nu=apply_masks(node.nu, masks))
        return node

    counts = {name: jnp.sum(m, dtype=jnp.int32) for name, m in keep.items()}
    return apply_masks(params, masks), jax.tree.map(rewrite, opt_state, is_leaf=is_node), counts


def prune_stage(state: dict[str, Any], keep: Mapping[str, jax.Array]) -> dict[str, int]:
    """Apply new keep masks (by parameter path) to one stage's ``{"params", "opt_state"}`` in
    place, on the stage's devices (its arrays are donated); returns each mask's kept count."""
    params, opt_state = state["params"], state["opt_state"]
    leaves = {_name(p): a for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}
    keep = {n: jax.device_put(m, leaves[n].sharding) for n, m in keep.items()}
    shardings = jax.tree.map(lambda a: a.sharding, (params, opt_state))
    fn = jax.jit(_with_masks, donate_argnums=(0, 1), out_shardings=(*shardings, None))
    state["params"], state["opt_state"], counts = fn(params, opt_state, keep)
    return {n: int(c) for n, c in jax.device_get(counts).items()}


# ---------------------------------------------------------------------------------------------
# The forward: gradients of pruned weights are zero where they are made; density as a metric


@dataclasses.dataclass(frozen=True)
class PrunedLayer(SparseLinears):
    """A layer's record (its `LayerOptions` entry): its prunable matrices, by path inside the
    block, and each one's multiply-adds per token (the weights of its density). As a
    `SparseLinears` it also names the linears that multiply block-sparsely (block granularity,
    once the Plan says so) and the block size (0: element granularity)."""

    paths: tuple[str, ...] = ()
    flops: tuple[float, ...] = ()
    columns: int = 0  # the length of each linear's `COLUMN_COUNTS` row: the most block-columns


def zero_pattern(weights: dict[str, jax.Array], record: PrunedLayer):
    """The weight hook: each prunable matrix as ``w * stop_gradient(w != 0)`` (the same values;
    pruned entries get a zero gradient), and the layer's FLOP-weighted density. With blocks,
    also each of `LINEARS`' block-column counts, descending (`COLUMN_COUNTS`)."""
    replaced, density = {}, jnp.float32(0.0)
    for path, flops in zip(record.paths, record.flops, strict=True):
        w = weights[path]
        live = jax.lax.stop_gradient(w != 0)
        replaced[path] = w * live.astype(w.dtype)
        density += flops / sum(record.flops) * jnp.mean(live, dtype=jnp.float32)
    metrics = {DENSITY: density if record.paths else jnp.float32(1.0)}
    if record.block_size:
        metrics[COLUMN_COUNTS] = jnp.stack([
            column_counts(weights[f"{lin}/kernel"], record.block_size, record.columns)
            if f"{lin}/kernel" in record.paths else jnp.full(record.columns, -1, jnp.int32)
            for lin in LINEARS
        ])
    return replaced, metrics


HOOKS = HookSet(
    NAME, weight=zero_pattern, reductions=((DENSITY, "mean"), (COLUMN_COUNTS, "mean"))
)


def layer_records(
    abstract_params: Any,
    include: str,
    top_k: int,
    num_experts: int,
    block_size: int = 0,
    sparse: Sequence[tuple[int, str, Widths | int]] = (),
    loop: bool = True,
):
    """One `PrunedLayer` per layer of a full parameter tree (shapes suffice); ``sparse``: the
    (layer, linear, widths) that multiply block-sparsely (the Plan part; a single K, as Plans
    saved before column groups hold, is one group of every column); ``loop``: `SparseLinears`'
    (False: the block-sparse matmuls as one batched step a group, for ``cost_analysis``)."""
    records = []
    prunable = pm.prunable_leaves(abstract_params, include)
    columns = linear_block_shapes(abstract_params, block_size or 1)
    most = max((c for layer in columns for _, c in layer), default=0) if block_size else 0
    for i in range(len(abstract_params["layers"])):
        prefix = f"layers/{i}/"
        mine = [(n[len(prefix) :], w) for n, w in prunable.items() if n.startswith(prefix)]
        flops = tuple(
            math.prod(w.shape) * (top_k / num_experts if _is_expert(n, w) else 1.0)
            for n, w in mine
        )
        widths = tuple(
            (lin, _widths(w, columns[i][LINEARS.index(lin)][1]))
            for layer, lin, w in sparse if layer == i
        )
        records.append(
            PrunedLayer(
                block_size=block_size,
                widths=widths,
                loop=loop,
                paths=tuple(n for n, _ in mine),
                flops=flops,
                columns=most,
            )
        )
    return tuple(records)


def _widths(widths: Widths | int, n_cols: int) -> Widths:
    """A Plan entry's widths as ``((K, n), ...)``: an int K is one group of all ``n_cols``."""
    if isinstance(widths, int | np.integer):
        return ((int(widths), n_cols),)
    return tuple((int(k), int(n)) for k, n in widths)


def _is_expert(path: str, w: Any) -> bool:
    """A stacked expert matrix ``[E, in, out]``: a token uses top_k of its E slices."""
    return "moe/" in path and len(w.shape) == 3


def layer_densities(
    counts: Mapping[str, int], shapes: Mapping[str, tuple[int, ...]], records: Sequence[PrunedLayer]
) -> list[float]:
    """Each layer's FLOP-weighted density from kept counts by full path (``layers/i/...``)."""
    out = []
    for i, rec in enumerate(records):
        if not rec.paths:
            out.append(1.0)
            continue
        names = [f"layers/{i}/{p}" for p in rec.paths]
        kept = [counts[n] / math.prod(shapes[n]) for n in names]
        out.append(float(sum(f * k for f, k in zip(rec.flops, kept, strict=True)) / sum(rec.flops)))
    return out


# ---------------------------------------------------------------------------------------------
# The plugin


@dataclasses.dataclass(frozen=True)
class PruningSettings:
    """The `pruning` section (its keys' defaults and meanings: `PruningPlugin.config`)."""

    enabled: bool
    initial_sparsity: float
    final_sparsity: float
    start_step: int
    every: int
    steps: int
    granularity: Literal[GRANULARITIES]
    block_size: int
    include: str
    scale: Literal[SCALES]
    sparse_below: float
    column_groups: int


class PruningPlugin(Plugin):
    name = NAME
    hook_sets = (HOOKS,)
    # The masks are optimizer state: their presence and which leaves have one decide its layout.
    fixed_on_resume = ("pruning.enabled", "pruning.include")
    logged_metrics = (DENSITY,)
    Settings = PruningSettings
    settings: PruningSettings

    @classmethod
    def config(cls) -> ml_collections.ConfigDict:
        c = ml_collections.ConfigDict()
        c.enabled = False
        c.initial_sparsity = 0.0  # S_i: the target at the first event (t0)
        c.final_sparsity = 0.8  # S_f: from t0 + steps * every on
        c.start_step = 50  # t0
        c.every = 25  # Δt: steps between events
        c.steps = 4  # n: events after the first (n + 1 in all)
        c.granularity = "element"  # "element" | "block" (block_size x block_size blocks)
        c.block_size = 32
        c.include = pm.DEFAULT_INCLUDE  # regex on "/"-joined parameter paths
        # "none": rank raw |w| (Alg. 1), which prunes GPT-2's smaller residual projections first;
        # "init": |w| / the std its matrix was initialised with (module docstring).
        c.scale = "none"
        # Block granularity: a dense block's linear (attn/qkv, attn/out, mlp/up, mlp/down and
        # the llama family's mlp/gate) multiplies block-sparsely once the blocks it would compute
        # (its block-columns cut into column_groups widths) are at most this fraction of its
        # dense blocks; 0 = always dense.
        c.sparse_below = 0.0
        # The most groups of block-columns a block-sparse linear cuts its columns into, each
        # group with its own width (docs/schemes/pruning.md): more pad less, but compile one
        # more loop each.
        c.column_groups = 4
        return c

    @classmethod
    def validate(cls, p: PruningSettings, facts: ModelFacts) -> None:
        if not p.enabled:
            return
        at_least({"pruning.start_step": p.start_step}, 0)
        at_least(
            {"pruning.every": p.every, "pruning.steps": p.steps,
             "pruning.column_groups": p.column_groups}, 1
        )
        if not 0.0 <= p.initial_sparsity <= p.final_sparsity < 1.0:
            raise ConfigError(
                f"pruning needs 0 <= pruning.initial_sparsity <= pruning.final_sparsity < 1, got "
                f"initial_sparsity={p.initial_sparsity}, final_sparsity={p.final_sparsity}"
            )
        try:
            re.compile(p.include)
        except re.error as err:
            raise ConfigError(f"pruning.include={p.include!r} is not a regex: {err}") from None
        shapes = prunable_shapes(p.include, facts.model)
        if not shapes:
            raise ConfigError(f"pruning.include={p.include!r} matches no parameter of the model")
        if p.granularity == "block":
            _check_blocks(p.block_size, shapes)
        if not 0.0 <= p.sparse_below <= 1.0:
            raise ConfigError(f"pruning.sparse_below={p.sparse_below} must be in [0, 1]")
        if p.sparse_below and p.granularity != "block":
            raise ConfigError(
                f"pruning.sparse_below={p.sparse_below} needs pruning.granularity='block': a "
                "block-sparse matmul skips whole blocks only"
            )

    @classmethod
    def resumed_plan(cls, saved: Plan, implied: Plan, changed: Collection[str]) -> Plan:
        """The masks live in the state; the Plan part (which linears multiply block-sparsely)
        stays, unless a pruning key changed: then every linear is dense again until the
        policy sees the state's blocks."""
        if not any(key.startswith("pruning.") for key in changed):
            return saved
        return saved.replace(parts={k: v for k, v in saved.parts if k != NAME})

    @classmethod
    def report_plots(cls) -> Sequence[PlotEntry]:
        """What pruning logged (each layer's density, the target sparsity) over time."""
        from dynjax.runlog import plots  # the report's, never a run's import

        return (
            plots.scheme_metrics_plot(
                cls.name,
                "pruning",
                "Pruning",
                "Each `pruning/...` metric over time (per-layer lists: one line per layer).",
            ),
        )

    def wrap_optimizer(
        self, optimizer: optax.GradientTransformation
    ) -> optax.GradientTransformation:
        return masked(optimizer, self.settings.include)

    @functools.cached_property
    def abstract_params(self) -> dict[str, Any]:
        """Shapes and dtypes of the model's parameters."""
        return abstract_params(self.facts.model)

    def layer_options(self, plan: Plan) -> Sequence[Any] | None:
        return self.records(plan)

    def records(self, plan: Plan | None = None) -> tuple[PrunedLayer, ...]:
        p = self.settings
        part = {} if plan is None else plan.part(NAME)
        return layer_records(
            self.abstract_params,
            p.include,
            self.facts.model.top_k,
            self.facts.model.num_experts,
            block_size=p.block_size if p.granularity == "block" else 0,
            sparse=part.get("sparse", ()),
            loop=part.get("loop", True),  # False only in Plans made to count FLOPs
        )

    def policies(self) -> list[Policy]:
        p = self.settings
        if p.granularity != "block" or not p.sparse_below:
            return []
        shapes = linear_block_shapes(self.abstract_params, p.block_size)
        return [
            SparsePath(shapes=shapes, sparse_below=p.sparse_below, max_groups=p.column_groups)
        ]

    def metric_costs(self, metrics: Mapping[str, Any]) -> Sequence[float] | None:
        """Seed 000 §2.2: a layer's load is its retained fraction of the dense cost."""
        density = metrics.get(DENSITY)
        return None if density is None else [float(d) for d in np.asarray(density)]

    def before_step(
        self, step: int, states: Sequence[dict[str, Any]], plan: Plan
    ) -> list[dict[str, Any]]:
        p = self.settings
        schedule = dict(start=p.start_step, every=p.every, steps=p.steps)
        if not pm.is_pruning_step(step, **schedule):
            return []
        began = time.perf_counter()
        target = pm.sparsity_at(
            step, initial=p.initial_sparsity, final=p.final_sparsity, **schedule
        )
        prunable = pm.prunable_leaves(self.abstract_params, p.include)
        shapes = {n: tuple(w.shape) for n, w in prunable.items()}
        keep, total, counts = prune(
            states,
            target,
            include=p.include,
            granularity=p.granularity,
            block_size=p.block_size,
            scales=ranking_scales(p.scale, self.facts.model, shapes),
            rounds=self.link.rounds(NAME),
        )
        return [
            {
                "event": "prune",
                "step": step,
                "sparsity": target,
                "granularity": p.granularity,
                "kept": keep,  # elements, or blocks
                "total": total,
                "layer_density": layer_densities(counts, shapes, self.records()),
                "seconds": time.perf_counter() - began,
            }
        ]


def linear_block_shapes(
    abstract_params: Any, block_size: int
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """``[L][len(LINEARS)]`` (block-rows, block-columns) of each layer's dense linears
    (``(0, 0)`` where a layer has none, e.g. ``mlp/*`` of an MoE layer)."""
    out = []
    layers = abstract_params["layers"]
    for layer in (layers[i] for i in sorted(layers)):
        row = []
        for lin in LINEARS:
            node = layer
            for key in (*lin.split("/"), "kernel"):
                node = node.get(key, {}) if isinstance(node, dict) else {}
            shape = getattr(node, "shape", (0, 0))
            row.append((shape[0] // block_size, shape[1] // block_size))
        out.append(tuple(row))
    return tuple(out)


class SparsePath:
    """Switch a linear to the block-sparse matmul once few of its blocks remain, and re-cut its
    column groups as pruning goes on (a Plan change each, compiled in the background).

    From each linear's block-column counts (``pruning/column_counts``): the fewest-blocks cut
    into at most ``max_groups`` widths (`group_widths`); block-sparse once those blocks are at
    most ``sparse_below`` of the dense ones. A sparse linear keeps its widths until a new cut
    computes at most ``REGROUP`` of their blocks (each Plan change recompiles its stage) or they
    no longer cover its columns. Seed 000 §4.2.2: a sparse kernel pays off only at high
    sparsity. Pruning only removes blocks, so widths counted at some step bound every later
    step's. Pure: the same newest metrics give the same Plan.
    """

    name = "pruning"
    REGROUP = 0.8

    def __init__(
        self, *, shapes: Sequence[Sequence[tuple[int, int]]], sparse_below: float,
        max_groups: int,
    ) -> None:
        self.shapes, self.sparse_below, self.max_groups = shapes, sparse_below, max_groups
        # The counts change at pruning events only; the policy runs every round.
        self._last: tuple[bytes, tuple, tuple] | None = None  # (counts, current, widths)

    def widths(
        self, counts: np.ndarray, current: Sequence[tuple[int, str, Any]] = ()
    ) -> tuple[tuple[int, str, Widths], ...]:
        """The (layer, linear, widths) that should multiply block-sparsely, given the
        ``[L, len(LINEARS), C]`` counts and the Plan's present entries."""
        key = (np.asarray(counts, np.float64).tobytes(), tuple(map(tuple, current)))
        if self._last is not None and self._last[:2] == key:
            return self._last[2]
        have = {
            (layer, lin): _widths(w, self.shapes[layer][LINEARS.index(lin)][1])
            for layer, lin, w in current
        }
        out = []
        for layer, (rows, shapes) in enumerate(zip(counts, self.shapes, strict=True)):
            for lin, row, (n_rows, n_cols) in zip(LINEARS, rows, shapes, strict=True):
                col = np.rint(np.asarray(row, np.float64)).astype(np.int64)[:n_cols]
                if not n_rows or col.size < n_cols or (col < 0).any():
                    continue  # no such linear, or not pruned
                want = group_widths(col, self.max_groups)
                old = have.get((layer, lin))
                if old is not None and _covers(old, col) and (
                    group_blocks(want) > self.REGROUP * group_blocks(old)
                ):
                    out.append((layer, lin, old))
                elif group_blocks(want) <= self.sparse_below * n_rows * n_cols:
                    out.append((layer, lin, want))
        self._last = (*key, tuple(out))
        return tuple(out)

    def propose(self, history: History, plan: Plan) -> Proposal | None:
        latest = history.values(COLUMN_COUNTS, 1)
        if not latest:
            return None
        have = tuple(tuple(w) for w in plan.part(NAME).get("sparse", ()))
        want = self.widths(np.asarray(latest[0]), have)
        if want == tuple((i, lin, _widths(w, self.shapes[i][LINEARS.index(lin)][1]))
                         for i, lin, w in have):
            return None
        record = {"event": "sparse_path", "sparse": [[i, lin, [list(g) for g in w]]
                                                     for i, lin, w in want]}
        blocks = sum(group_blocks(w) for _, _, w in want)
        return Proposal(
            plan.with_part(NAME, sparse=want),
            f"{len(want)} linears block-sparse (was {len(have)}), {blocks} blocks a block-row",
            records=(record,),
        )


def _covers(widths: Widths, counts: np.ndarray) -> bool:
    """Whether ``widths`` bound the descending ``counts`` position by position."""
    bound = np.repeat([k for k, _ in widths], [n for _, n in widths])
    return bound.size == counts.size and bool((np.sort(counts)[::-1] <= bound).all())


def ranking_scales(
    scale: str, model: GPTConfig, names: Collection[str]
) -> dict[str, float] | None:
    """What `prune` divides the scores of each prunable matrix in ``names`` (paths) of ``model``
    by under ``scale`` (`pruning.scale`): its init std for ``"init"``, None (raw magnitudes)
    for ``"none"``."""
    if scale == "none":
        return None
    return {n: init_std(model, n) for n in names}


def prune(
    states: Sequence[dict[str, Any]],
    sparsity: float,
    *,
    include: str = pm.DEFAULT_INCLUDE,
    granularity: str = "element",
    block_size: int = 32,
    scales: Mapping[str, float] | None = None,
    rounds: Rounds = ALONE,
) -> tuple[int, int, dict[str, int]]:
    """Prune the stages' states (in stage order, replaced in place) to ``sparsity`` of their
    prunable elements or blocks, ranked globally by magnitude (seed 000 Alg. 1), each matrix's
    magnitudes divided by its entry of ``scales`` (by path; None: raw magnitudes); returns
    (kept, total) in elements or blocks, and the kept elements of each matrix by path.

    ``rounds``: the other processes of a pipeline over several, which hold the other stages
    and make the same call (`pruning_math.global_masks`); totals and counts cover all."""
    weights = [pm.prunable_leaves(st["params"], include) for st in states]
    current = [named_masks(st["opt_state"]) for st in states]
    if granularity == "element":
        score = pm.element_scores
    else:
        score = lambda w, m: pm.block_scores(w, block_size, block_mask(m, block_size))
    unit = (lambda n: 1.0) if scales is None else scales.__getitem__
    scores = [
        {n: score(w, cur[n]) / unit(n) for n, w in ws.items()}
        for ws, cur in zip(weights, current, strict=True)
    ]
    local = sum(math.prod(s.shape) for stage in scores for s in stage.values())
    total = sum(rounds.all(local))
    keep = pm.keep_count(total, sparsity)
    masks = pm.global_masks(scores, keep, rounds)
    if granularity == "block":
        masks = [{n: pm.expand_blocks(m, block_size) for n, m in s.items()} for s in masks]
    counts: dict[str, int] = {}
    for st, m in zip(states, masks, strict=True):
        counts.update(prune_stage(st, m))
    return keep, total, {n: c for part in rounds.all(counts) for n, c in part.items()}


@functools.partial(jax.jit, static_argnames="block_size")
def block_mask(mask: jax.Array, block_size: int) -> jax.Array:
    """``[..., in, out]`` element mask -> ``[..., in/bs, out/bs]``: a block is kept while any of
    its entries is."""
    *lead, k, n = mask.shape
    tiles = mask.reshape(*lead, k // block_size, block_size, n // block_size, block_size)
    return jnp.any(tiles, axis=(-3, -1))


def prunable_shapes(include: str, model: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The shapes of the parameters ``include`` (`pruning.include`) selects of ``model``."""
    params = abstract_params(model)
    return {n: tuple(w.shape) for n, w in pm.prunable_leaves(params, include).items()}


def _check_blocks(block_size: int, shapes: Mapping[str, tuple[int, ...]]) -> None:
    if block_size < 1:
        raise ConfigError(f"pruning.block_size={block_size} must be >= 1")
    for name, shape in shapes.items():
        if len(shape) < 2 or shape[-1] % block_size or shape[-2] % block_size:
            raise ConfigError(
                f"pruning.granularity='block' with pruning.block_size={block_size}: {name} has "
                f"shape {shape}, whose last two dims are not multiples of it (the matrices are "
                "[d_model, 3*d_model], [d_model, d_model], [d_model, mlp_dim], [mlp_dim, "
                "d_model] and per expert [d_model, expert_mlp_dim]); pick a block_size that "
                "divides model.d_model, model.mlp_dim and moe.expert_mlp_dim"
            )

