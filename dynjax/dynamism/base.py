"""The plugin interface every dynamism scheme implements, and the registry that collects them.

DESIGN.md "Dynamism plugins": a scheme (MoE capacities and caching, pruning, freezing, sparse
attention, early exit, mixture of depths; seed 000 §2) is one `Plugin` in one module of
`dynjax.dynamism`. The generic machinery reads the registry at the edge (`dynjax.config` for the
config sections and their checks, `dynjax.experiment` and `dynjax.train` for Plan parts,
policies and costs) and never names a scheme, so adding one edits no other file.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ml_collections
import optax

from dynjax.model.hooks import BlockPart, LayerOptions, layer_options

if TYPE_CHECKING:  # the edge modules call plugins; plugins never import them at run time
    from dynjax.experiment import Experiment
    from dynjax.recompile import Plan, PlanContext, Policy


class Plugin:
    """One dynamism scheme. Subclasses set `name` and override what their scheme needs.

    - `config`: the section `cfg.<name>` with its one default per key, `enabled` included;
    - `validate`: raise `dynjax.config.ConfigError` naming the key and the fix; called for every
      config, enabled or not (a scheme's keys may contradict others even when it is off);
    - `initial_plan`: a fresh run's Plan with the scheme's part set (`Plan.with_part`);
    - `layer_options`: the per-layer records its block hooks and state rules read
      (`dynjax.model.hooks`);
    - `block_parts`: extra submodules it adds to chosen layers (`hooks.register_block_part`);
    - `resumed_plan`: what a resumed run with a changed config keeps of the saved part;
    - `policies`: the Controller policies the config asks for (pure `propose(history, plan)`);
    - `layer_costs`: each layer's relative cost under a Plan (a dense layer = 1.0; seed 000 §2
      gives the load model of each case), multiplied over plugins for the balancer's traces;
    - `metric_costs`: cost factors read from a step's host metrics instead, for what changes
      without a Plan change (a pruned layer's density: a Plan change would recompile);
    - `wrap_optimizer`: the run's optimizer with the scheme's per-parameter state around it
      (e.g. pruning masks). State kept there is train state like any other: it moves with its
      layer between pipeline stages, is checkpointed, restored and resharded by path;
    - `before_step`: change the training state between two steps (e.g. a pruning event) and
      report what it did as events; a pipeline profiles the step after one (seed 000 §3.1);
    - `measure`: measure the state between two steps (e.g. layer outputs on a probe batch) as
      host metrics of the step about to run: its policies read them like the step's own;
    - `logged_metrics`: host metrics of its own that metrics.jsonl gets at logged steps.
    """

    name: str = ""
    # Keys (or "prefix." for all under it) that decide what the saved state is: a resumed run
    # must keep them (`dynjax.resume`).
    fixed_on_resume: tuple[str, ...] = ()
    # Host metrics written to metrics.jsonl at every logged step (scalars, or per-layer lists).
    logged_metrics: tuple[str, ...] = ()

    def config(self) -> ml_collections.ConfigDict:
        section = ml_collections.ConfigDict()
        section.enabled = False
        return section

    def enabled(self, cfg: ml_collections.ConfigDict) -> bool:
        """Whether ``cfg`` turns the scheme on (a config made before the plugin was registered
        has no section for it: off)."""
        return self.name in cfg and bool(cfg[self.name].enabled)

    def validate(self, cfg: ml_collections.ConfigDict) -> None:
        """Check this scheme's keys; raise `dynjax.config.ConfigError`."""

    def initial_plan(self, plan: Plan, cfg: ml_collections.ConfigDict, ctx: PlanContext) -> Plan:
        return plan

    def resumed_plan(self, saved: Plan, implied: Plan, changed: Collection[str]) -> Plan:
        """A checkpoint's Plan under a changed config (``changed``: the dotted keys): the
        scheme's part comes from ``implied`` (the new config's fresh Plan) when a key of its
        section changed, else stays as the policies left it."""
        if not any(key.startswith(f"{self.name}.") for key in changed):
            return saved
        parts = dict(saved.parts)
        parts.pop(self.name, None)
        return saved.replace(parts=parts).with_part(self.name, **implied.part(self.name))

    def layer_options(self, plan: Plan, exp: Experiment) -> Sequence[Any] | None:
        """Each layer's static record for the scheme's block hook (None for a layer it leaves
        alone), or None for none at all. Records must be hashable: they key the compile cache,
        so a change recompiles only the pipeline stages whose layers' records changed. A layer
        that needs records under other names too (e.g. for a state rule,
        `hooks.register_state_rule`) gets a dict ``{name: record}`` instead of one record."""
        return None

    def block_parts(self, cfg: ml_collections.ConfigDict) -> Sequence[BlockPart]:
        """(layer, part name, hashable settings) of each submodule the enabled scheme adds to
        a layer (`dynjax.model.hooks.register_block_part`): parameters of the model, so keys
        that change them belong in `fixed_on_resume`."""
        return ()

    def policies(self, cfg: ml_collections.ConfigDict, exp: Experiment) -> list[Policy]:
        return []

    def layer_costs(self, plan: Plan, exp: Experiment) -> Sequence[float] | None:
        return None

    def metric_costs(
        self, metrics: Mapping[str, Any], exp: Experiment
    ) -> Sequence[float] | None:
        """Each layer's cost factor from the host metrics of one step (None: none), multiplied
        with every plugin's `layer_costs`. For state the Plan does not hold."""
        return None

    def wrap_optimizer(
        self, cfg: ml_collections.ConfigDict, optimizer: optax.GradientTransformation
    ) -> optax.GradientTransformation:
        """The run's optimizer, for an enabled scheme (`Experiment.from_config`, in registry
        order). Its state must key per-parameter leaves by the parameter's path (e.g. a
        params-shaped subtree): shardings, checkpoint items and migration follow paths, and a
        pipeline stage initialises it on its own units only."""
        return optimizer

    def before_step(
        self, step: int, states: Sequence[dict[str, Any]], plan: Plan, exp: Experiment
    ) -> list[dict[str, Any]]:
        """Called by the training loop before it dispatches ``step``, for an enabled scheme.

        ``states``: the runtime's per-stage ``{"params", "opt_state"}`` dicts in stage order
        (one for the single-program step), keyed as in the full state; replace their entries
        to change the state (read them here: the arrays of the step before are donated).
        Returns events for events.jsonl (``{"event": name, "step": step, ...}``)."""
        return []

    def measure(
        self, step: int, states: Sequence[dict[str, Any]], plan: Plan, exp: Experiment
    ) -> dict[str, Any]:
        """Called after every `before_step`, for an enabled scheme, with the same ``states``
        (read only). Returns host metrics (NumPy arrays by name) that join ``step``'s own when
        they reach the host: the Controller's history (so its policies) and, for names in
        `logged_metrics`, metrics.jsonl. For what the training step cannot compute, such as a
        forward on a fixed probe batch (Egeria, seed 000 §4.2.3)."""
        return {}


_REGISTRY: dict[str, Plugin] = {}


def register(plugin: Plugin) -> Plugin:
    """Add ``plugin`` (a scheme defined anywhere, e.g. in a user's package or a test); its
    config section exists in every `default_config()` made afterwards."""
    if not plugin.name or not plugin.name.isidentifier():
        raise ValueError(f"a plugin needs an identifier as its name, got {plugin.name!r}")
    if plugin.name in _REGISTRY and type(_REGISTRY[plugin.name]) is not type(plugin):
        raise ValueError(f"another plugin is already registered as {plugin.name!r}")
    _REGISTRY[plugin.name] = plugin
    return plugin


def registered() -> tuple[Plugin, ...]:
    """Every registered plugin, in registration order."""
    return tuple(_REGISTRY.values())


def enabled_plugins(cfg: ml_collections.ConfigDict) -> tuple[Plugin, ...]:
    return tuple(p for p in registered() if p.enabled(cfg))


def layer_costs(
    plugins: Sequence[Plugin],
    plan: Plan,
    exp: Experiment,
    metrics: Mapping[str, Any] | None = None,
) -> list[float]:
    """Each layer's modelled cost under ``plan`` (and, given a step's host ``metrics``, the
    state that step ran with): the product of the plugins' factors (a layer no plugin changes
    costs 1.0), seed 000 §2."""
    costs = [1.0] * exp.ctx.num_layers
    for plugin in plugins:
        factors = [plugin.layer_costs(plan, exp)]
        if metrics is not None:
            factors.append(plugin.metric_costs(metrics, exp))
        for f in factors:
            if f is not None:
                costs = [c * float(x) for c, x in zip(costs, f, strict=True)]
    return costs


def plan_layer_options(
    plugins: Sequence[Plugin], plan: Plan, exp: Experiment
) -> tuple[LayerOptions, ...]:
    """Every layer's `LayerOptions` under ``plan``: each plugin's record for it; () when no
    plugin gives any."""
    per_plugin = {p.name: p.layer_options(plan, exp) for p in plugins}
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

    return tuple(layer_options(records(i)) for i in range(exp.ctx.num_layers))
