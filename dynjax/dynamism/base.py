"""The plugin interface every dynamism scheme implements (docs/plugins.md).

docs/plugins.md: a scheme (MoE capacities and caching, pruning, freezing, sparse
attention, early exit, mixture of depths; seed 000 §2) is one `Plugin` class in one module of
`dynjax.dynamism`. A run is given its schemes explicitly (`dynjax.dynamism.Schemes`) and builds
one instance of each enabled scheme at the edge, from the scheme's settings (its config section
read once into the frozen record `Plugin.Settings` and checked there), the run's `ModelFacts`
and a `RunLink`; the generic machinery calls the instances and never names a scheme, so adding
one edits no other file. Plugins import neither `dynjax.config` nor `dynjax.experiment`: what
they need of the run comes in through the constructor.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import ml_collections
import numpy as np
import optax

from dynjax.errors import ConfigError
from dynjax.model.facts import ModelFacts
from dynjax.model.hooks import BlockPart, HookSet, LayerOptions, layer_options
from dynjax.parallel.peers import ALONE, Rounds
from dynjax.recompile import PlanContext

if TYPE_CHECKING:
    from dynjax.checkpoint.rows import PartialRows
    from dynjax.checkpoint.settings import CheckpointSettings
    from dynjax.dynamism.moe.speeds import Speeds
    from dynjax.parallel.step_inputs import InputSignature
    from dynjax.recompile import Plan, Policy

# What a scheme may claim of a layer (`Plugin.claims`): two enabled schemes that claim the same
# thing of the same layer cannot run together (`Schemes.build` refuses them).
CLAIMS = {
    "block_wrapper": "the one wrapper that runs a block's residual body",
    "token_set": "which tokens the block computes (changed, or needed whole)",
    "attention": "the attention's token layout",
}


def plan_context(facts: ModelFacts) -> PlanContext:
    """The Plan's view of ``facts`` (what decides whether a Plan is possible)."""
    m = facts.model
    return PlanContext(
        batch_size=facts.batch_size,
        num_layers=m.num_layers,
        pipeline_stages=facts.pipeline_stages,
        batch_shards=facts.batch_shards,
    )


@dataclasses.dataclass(frozen=True)
class RunLink:
    """What a plugin reaches of its run besides its settings and facts, given at the edge.

    ``rounds(name)``: the numbered exchange by which the processes of a pipeline over several
    combine what each computed from its own stages (`Rounds`; this process alone otherwise);
    ``first_inputs()``: the inputs [B, S] of the run's first training batch (fixed by the data
    order's seed), e.g. for a probe batch; ``speeds``: this machine's speeds, timed at the edge
    for a scheme that asks (`Plugin.speed_probe`), None otherwise."""

    rounds: Callable[[str], Rounds] = lambda name: ALONE
    first_inputs: Callable[[], np.ndarray] | None = None
    speeds: Speeds | None = None


LOCAL = RunLink()  # this process alone, no data, no speeds: validation and tests


@dataclasses.dataclass(frozen=True)
class Switch:
    """The settings of a scheme whose section holds only its switch (`Plugin.config`'s)."""

    enabled: bool


S = TypeVar("S")


def read_settings(kind: type[S], section: ml_collections.ConfigDict, prefix: str) -> S:
    """``section`` (the config's ``prefix``) as the frozen record ``kind``: one field per key
    (no defaults: a section's are its `Plugin.config`'s), a nested record for each nested
    section, an int widened where the field is a float (the config accepts one there). A field
    typed ``Literal[...]`` is checked here, whether the scheme is on or off: a misspelt choice
    in a section that is off would otherwise go unnoticed until it is turned on. Other values
    are the scheme's `Plugin.validate`'s to check, on the record. Raises TypeError when the
    record's fields and the section's keys differ (a scheme whose `Settings` and `config`
    disagree)."""
    hints = typing.get_type_hints(kind)
    names = [f.name for f in dataclasses.fields(kind)]
    if set(names) != set(section.keys()):
        raise TypeError(
            f"{kind.__name__} has the fields {sorted(names)} but its config section the keys "
            f"{sorted(section.keys())}: give the record one field per key"
        )
    values = {}
    for name in names:
        value, hint = section[name], hints[name]
        if dataclasses.is_dataclass(hint):
            value = read_settings(hint, value, f"{prefix}.{name}")
        elif typing.get_origin(hint) is typing.Literal and value not in typing.get_args(hint):
            raise ConfigError(
                f"{prefix}.{name}={value!r} is not one of {typing.get_args(hint)}"
            )
        elif hint is float and type(value) is int:
            value = float(value)
        values[name] = value
    return kind(**values)


class Plugin:
    """One dynamism scheme. Subclasses set `name` and override what their scheme needs.

    Class-level (read before a run exists, for every scheme of `Schemes`, enabled or not):
    - `config`: the section `cfg.<name>` with its one default per key, `enabled` included;
    - `Settings`: the frozen record of the section, one field per key (a nested record per
      nested section), read from it once at the edge (`read`, `Schemes.settings`): everything
      below reads the record's attributes, never the section;
    - `validate`: raise `dynjax.errors.ConfigError` naming the key and the fix, given the
      settings and the run's `ModelFacts` (a scheme's keys may contradict the model even off);
    - `hook_sets`: the model hooks its scheme uses (`dynjax.model.hooks.HookSet`), named like
      the records it gives; class level, since its block parts are parameters of the model;
    - `block_parts`: extra submodules it adds to chosen layers (`HookSet.part`);
    - `resumed_plan`: what a resumed run with a changed config keeps of the saved part.

    Per run (an instance of an enabled scheme: its checked `settings`, its facts and `RunLink`;
    state of the run lives on the instance):
    - `claims`: what it takes of which layers (`CLAIMS`), checked against the other schemes;
    - `initial_plan`: a fresh run's Plan with the scheme's part set (`Plan.with_part`);
    - `plan_problems`: what is wrong with a Plan's part for this run (checked with the Plan);
    - `step_inputs`: per-layer arrays the steps of a Plan read as inputs (no recompile), and
      `input_fills`, their values when a layer is profiled alone;
    - `batch_input_signatures`, `batch_inputs`: per-layer arrays each training batch carries
      (e.g. cached routes), declared per Plan and supplied per batch;
    - `compiled_part`: what of its Plan part the compiled programs depend on (the compile key);
    - `layer_options`: the per-layer records its block hooks and state rules read;
    - `policies`: the Controller policies its settings ask for (pure `propose(history, plan)`);
    - `layer_costs`: each layer's relative cost under a Plan (a dense layer = 1.0; seed 000 §2
      gives the load model of each case), multiplied over plugins for the balancer's traces;
    - `metric_costs`: cost factors read from a step's host metrics instead, for what changes
      without a Plan change (a pruned layer's density: a Plan change would recompile);
    - `wrap_optimizer`: the run's optimizer with the scheme's per-parameter state around it;
    - `before_step`: change the training state between two steps and report it as events;
    - `measure`: measure the state between two steps as host metrics of the next step;
    - `observe`: read (and complete) each step's host metrics before the Controller does;
    - `record_fields`: fields of its own in a logged step's metrics.jsonl record;
    - `logged_metrics`, `logged_scalars`: host metrics of its own that metrics.jsonl gets at
      logged steps;
    - `checkpoint_rows`: its row-stacked leaves and the policy of partial saves of them;
    - `report_plots` (class level): its plots in the run report (`dynjax.report`).
    """

    name: ClassVar[str] = ""
    # The key of the section that turns the scheme on (named when two schemes clash).
    switch: ClassVar[str] = "enabled"
    # Keys (or "prefix." for all under it) that decide what the saved state is: a resumed run
    # must keep them (`dynjax.resume`).
    fixed_on_resume: ClassVar[tuple[str, ...]] = ()
    # Host metrics written to metrics.jsonl at every logged step (scalars, or per-layer lists).
    logged_metrics: ClassVar[tuple[str, ...]] = ()
    # Scalar host metrics written as numbers (NaN included) at every logged step where present.
    logged_scalars: ClassVar[tuple[str, ...]] = ()
    # The model hooks the scheme's records run (`Schemes.hooks` collects every scheme's).
    hook_sets: ClassVar[tuple[HookSet, ...]] = ()
    # The frozen record of the section (`read_settings`): one field per key of `config`.
    Settings: ClassVar[type] = Switch

    def __init__(self, settings: Any, facts: ModelFacts, link: RunLink = LOCAL) -> None:
        self.settings, self.facts, self.link = settings, facts, link

    @functools.cached_property
    def ctx(self) -> PlanContext:
        return plan_context(self.facts)

    # -- class level: the config section, before any run ----------------------------------------

    @classmethod
    def config(cls) -> ml_collections.ConfigDict:
        section = ml_collections.ConfigDict()
        section.enabled = False
        return section

    @classmethod
    def read(cls, section: ml_collections.ConfigDict) -> Any:
        """The section as this scheme's `Settings` record (unchecked: `validate` checks it)."""
        return read_settings(cls.Settings, section, cls.name)

    @classmethod
    def enabled(cls, settings: Any) -> bool:
        return bool(getattr(settings, cls.switch))

    @classmethod
    def validate(cls, settings: Any, facts: ModelFacts) -> None:
        """Check this scheme's settings; raise `dynjax.errors.ConfigError` naming the key
        (``<name>.<key>``) and the fix. ``facts.model`` has no block parts yet (they come from
        valid settings)."""

    @classmethod
    def block_parts(cls, settings: Any, facts: ModelFacts) -> Sequence[BlockPart]:
        """(layer, part name, hashable settings) of each submodule the enabled scheme adds to
        a layer (a part of its `hook_sets`, `HookSet.part`): parameters of the model, so keys
        that change them belong in `fixed_on_resume`."""
        return ()

    @classmethod
    def speed_probe(cls, settings: Any, facts: ModelFacts) -> tuple[int, int, int] | None:
        """(rows, d_model, hidden) of the GEMM whose speeds (`dynjax.dynamism.moe.speeds`) the
        enabled scheme's `initial_plan` reads from `RunLink.speeds`; None: it reads none."""
        return None

    @classmethod
    def report_plots(cls) -> Sequence[tuple[str, str, Callable, Callable, str]]:
        """The scheme's own plots in the run report, as `dynjax.runlog.plots.PlotEntry` tuples
        (name, title, draw(run, figure), the reason to skip a run (None: draw), caption),
        drawn from a workdir's files. Only the report (an edge) calls it: a scheme keeps its
        report module out of its package's imports."""
        return ()

    @classmethod
    def resumed_plan(cls, saved: Plan, implied: Plan, changed: Collection[str]) -> Plan:
        """A checkpoint's Plan under a changed config (``changed``: the dotted keys): the
        scheme's part comes from ``implied`` (the new config's fresh Plan) when a key of its
        section changed, else stays as the policies left it."""
        if not any(key.startswith(f"{cls.name}.") for key in changed):
            return saved
        parts = dict(saved.parts)
        parts.pop(cls.name, None)
        return saved.replace(parts=parts).with_part(cls.name, **implied.part(cls.name))

    # -- per run -------------------------------------------------------------------------------

    def claims(self) -> Mapping[str, Collection[int]]:
        """``{claim: layers}`` (`CLAIMS`): what the scheme takes of which layers."""
        return {}

    def initial_plan(self, plan: Plan) -> Plan:
        return plan

    def step_inputs(self, plan: Plan) -> dict[str, dict[int, np.ndarray]]:
        """Arrays every step of ``plan`` reads as inputs rather than compiles in, by name, one
        row per layer that reads it (``{layer: row}``): a change of their values runs the same
        programs (e.g. MoE's ragged capacities). Each stage gets the rows of its own layers."""
        return {}

    def input_fills(self) -> Mapping[str, float]:
        """The value of each of its step inputs (by name) when the profiler times a layer
        alone, e.g. the largest work the layer's compiled buffers allow; default 0."""
        return {}

    def batch_input_signatures(self, plan: Plan) -> Sequence[InputSignature]:
        """The per-layer arrays every training batch under ``plan`` carries
        (`dynjax.parallel.step_inputs.InputSignature`: the layers reading it, the shape of one
        layer's row after the batch axis, its dtype): a change of these recompiles. The values
        come from `batch_inputs`; evaluation batches carry none."""
        return ()

    def batch_inputs(
        self, step: int, sample_ids: np.ndarray, plan: Plan
    ) -> dict[str, dict[int, np.ndarray]]:
        """The values of `batch_input_signatures` for the batch of ``step`` (its samples
        ``sample_ids``): by name, ``{layer: [B, ...]}``."""
        return {}

    def compiled_part(self, plan: Plan) -> Mapping[str, Any] | None:
        """Its Plan part as the compiled programs depend on it (None: all of it), the compile
        cache's key: fields the programs read at runtime (e.g. step inputs) left out, what
        they compile in of them instead kept, so Plans that differ only there share one
        executable."""
        return None

    def observe(
        self, step: int, metrics: dict[str, Any], sample_ids: np.ndarray, plan: Plan
    ) -> None:
        """Called with ``step``'s host metrics when they reach the host (Δ steps late, before
        the Controller's policies read them), its samples and the Plan it ran with: may update
        state of its own from them (e.g. a routing cache) and add metrics, or remove its own
        that nothing else reads."""

    def record_fields(self, metrics: Mapping[str, Any], plan: Plan) -> dict[str, Any]:
        """Fields of its own (JSON data) in the metrics.jsonl record of a logged step, from
        its host metrics (after `observe`) and the Plan it ran with."""
        return {}

    def plan_problems(self, plan: Plan) -> list[str]:
        """Every problem of ``plan``'s part for this run, each with its fix; the Plan's
        validation lists them with its own (`PlanContext.checks`)."""
        return []

    def layer_options(self, plan: Plan) -> Sequence[Any] | None:
        """Each layer's static record for the scheme's block hook (None for a layer it leaves
        alone), or None for none at all. Records must be hashable: they key the compile cache,
        so a change recompiles only the pipeline stages whose layers' records changed. A layer
        that needs records under other names too (e.g. for a state rule,
        `HookSet.state_rule`) gets a dict ``{name: record}`` instead of one record."""
        return None

    def policies(self) -> list[Policy]:
        return []

    def layer_costs(self, plan: Plan) -> Sequence[float] | None:
        return None

    def metric_costs(self, metrics: Mapping[str, Any]) -> Sequence[float] | None:
        """Each layer's cost factor from the host metrics of one step (None: none), multiplied
        with every plugin's `layer_costs`. For state the Plan does not hold."""
        return None

    def wrap_optimizer(
        self, optimizer: optax.GradientTransformation
    ) -> optax.GradientTransformation:
        """The run's optimizer (wrapped in `Schemes` order). Its state must key per-parameter
        leaves by the parameter's path (e.g. a params-shaped subtree): shardings, checkpoint
        items and migration follow paths, and a pipeline stage initialises it on its own units
        only. State kept there is train state: it moves with its layer between stages, is
        checkpointed, restored and resharded by path."""
        return optimizer

    def before_step(
        self, step: int, states: Sequence[dict[str, Any]], plan: Plan
    ) -> list[dict[str, Any]]:
        """Called by the training loop before it dispatches ``step``.

        ``states``: the runtime's per-stage ``{"params", "opt_state"}`` dicts in stage order
        (one for the single-program step), keyed as in the full state; replace their entries
        to change the state (read them here: the arrays of the step before are donated).
        Returns events for events.jsonl (``{"event": name, "step": step, ...}``)."""
        return []

    def measure(
        self, step: int, states: Sequence[dict[str, Any]], plan: Plan
    ) -> dict[str, Any]:
        """Called after every `before_step` with the same ``states`` (read only). Returns host
        metrics (NumPy arrays by name) that join ``step``'s own when they reach the host: the
        Controller's history (so its policies) and, for names in `logged_metrics`,
        metrics.jsonl. For what the training step cannot compute, such as a forward on a fixed
        probe batch (Egeria, seed 000 §4.2.3)."""
        return {}

    def checkpoint_rows(
        self, checkpoint: CheckpointSettings, history: int
    ) -> PartialRows | None:
        """Leaves of the training state whose leading axis holds independent rows, which a
        checkpoint may save a subset of and restores row by row, with their optimizer moments
        (seed 004 §3; `dynjax.checkpoint.rows`), and the policy choosing each save's rows;
        None: the scheme has none. ``checkpoint``: the run's ``checkpoint`` section's record
        (K, the selection, two-level settings), ``history``: the checkpoints kept."""
        return None


def layer_costs(
    plugins: Sequence[Plugin], plan: Plan, metrics: Mapping[str, Any] | None = None
) -> list[float]:
    """Each layer's modelled cost under ``plan`` (and, given a step's host ``metrics``, the
    state that step ran with): the product of the plugins' factors (a layer no plugin changes
    costs 1.0), seed 000 §2."""
    costs = [1.0] * _num_layers(plugins)
    for plugin in plugins:
        factors = [plugin.layer_costs(plan)]
        if metrics is not None:
            factors.append(plugin.metric_costs(metrics))
        for f in factors:
            if f is not None:
                costs = [c * float(x) for c, x in zip(costs, f, strict=True)]
    return costs


def _num_layers(plugins: Sequence[Plugin]) -> int:
    return plugins[0].facts.num_layers if plugins else 0


def plan_layer_options(plugins: Sequence[Plugin], plan: Plan) -> tuple[LayerOptions, ...]:
    """Every layer's `LayerOptions` under ``plan``: each plugin's record for it; () when no
    plugin gives any."""
    per_plugin = {p.name: p.layer_options(plan) for p in plugins}
    per_plugin = {name: recs for name, recs in per_plugin.items() if recs is not None}
    if not per_plugin:
        return ()

    def records(i: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, recs in per_plugin.items():
            named = recs[i] if isinstance(recs[i], dict) else {name: recs[i]}
            clash = set(named) & set(out)
            if clash:
                raise ValueError(f"layer {i} has two records named {sorted(clash)}")
            out.update(named)
        return out

    return tuple(layer_options(records(i)) for i in range(_num_layers(plugins)))
