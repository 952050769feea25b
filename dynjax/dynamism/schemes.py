"""`Schemes`: the explicit, ordered set of dynamism schemes a run may use.

Nothing registers itself on import: the edge (`dynjax.config`, `dynjax.experiment`,
`dynjax.train`) is handed a `Schemes` (the built-in one, `dynjax.dynamism.BUILTIN`, or that
plus a user's, `Schemes.with_`) and passes it down. It collects the config sections, reads each
once into its scheme's settings record and checks it, checks that the enabled schemes' claims do
not clash, and builds the per-run instances from the records.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping
from typing import Any

import ml_collections

from dynjax.dynamism.base import CLAIMS, LOCAL, Plugin, RunLink
from dynjax.dynamism.moe.speeds import Speeds, measure_speeds
from dynjax.errors import ConfigError
from dynjax.model.facts import ModelFacts
from dynjax.model.hooks import BlockPart, Hooks
from dynjax.recompile import Plan


class Schemes:
    """Plugin classes in order: the order sections appear, optimizers wrap and hooks run."""

    def __init__(self, *plugins: type[Plugin]) -> None:
        names = [p.name for p in plugins]
        bad = [n for n in names if not n.isidentifier()]
        if bad:
            raise ValueError(f"a plugin needs an identifier as its name, got {bad}")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"two plugins are named {twice}")
        self.plugins = tuple(plugins)

    def with_(self, *plugins: type[Plugin]) -> Schemes:
        """These schemes and ``plugins`` after them (e.g. a user's or a test's)."""
        return Schemes(*self.plugins, *plugins)

    def sections(self) -> dict[str, ml_collections.ConfigDict]:
        """Each scheme's config section with its defaults, by name."""
        return {p.name: p.config() for p in self.plugins}

    def settings(self, cfg: ml_collections.ConfigDict, facts: ModelFacts) -> dict[str, Any]:
        """Each scheme's section read into its `Plugin.Settings` record and checked (enabled or
        not), then the enabled ones' claims: the records the run's plugins are built from, by
        scheme name. The one place a section is read."""
        settings = {p.name: p.read(cfg[p.name]) for p in self.plugins}
        for p in self.plugins:
            p.validate(settings[p.name], facts)
        self.build(settings, facts)
        return settings

    def hooks(self) -> Hooks:
        """The model hooks of every scheme (enabled or not: a hook runs only on layers whose
        records name it), in scheme order: the run's, carried down as data (`GPTConfig.hooks`)."""
        return Hooks(tuple(s for p in self.plugins for s in p.hook_sets))

    def block_parts(
        self, settings: Mapping[str, Any], facts: ModelFacts
    ) -> tuple[BlockPart, ...]:
        """The submodules the enabled schemes add to the model (`GPTConfig.block_parts`), from
        their settings (`settings`)."""
        return tuple(
            part
            for p in self.plugins
            if p.enabled(settings[p.name])
            for part in p.block_parts(settings[p.name], facts)
        )

    def build(
        self, settings: Mapping[str, Any], facts: ModelFacts, link: RunLink = LOCAL
    ) -> tuple[Plugin, ...]:
        """One instance per enabled scheme, for one run, from its settings record (`settings`:
        frozen, so what it was checked with stays what it runs with); refuses schemes whose
        claims clash."""
        built = tuple(
            p(settings[p.name], facts, link) for p in self.plugins if p.enabled(settings[p.name])
        )
        for a, b in itertools.combinations(built, 2):
            _check_claims(a, b)
        return built

    def speed_probe(
        self, settings: Mapping[str, Any], facts: ModelFacts
    ) -> tuple[int, int, int] | None:
        """What the first enabled scheme that needs this machine's speeds asks to time."""
        for p in self.plugins:
            s = settings[p.name]
            probe = p.speed_probe(s, facts) if p.enabled(s) else None
            if probe is not None:
                return probe
        return None

    def speeds(self, settings: Mapping[str, Any], facts: ModelFacts) -> Speeds | None:
        """This machine's speeds timed for the probe a scheme asks for (`speed_probe`), or
        None when none asks: timed here, at the edge, since no plugin hook times the device."""
        probe = self.speed_probe(settings, facts)
        return None if probe is None else measure_speeds(*probe)

    def fixed_on_resume(self) -> tuple[str, ...]:
        return tuple(key for p in self.plugins for key in p.fixed_on_resume)

    def resumed_plan(self, saved: Plan, implied: Plan, changed: Collection[str]) -> Plan:
        """``saved`` with every scheme's `Plugin.resumed_plan` applied in order."""
        for p in self.plugins:
            saved = p.resumed_plan(saved, implied, changed)
        return saved


def _check_claims(a: Plugin, b: Plugin) -> None:
    theirs = b.claims()
    for claim, layers in a.claims().items():
        both = sorted(set(layers) & set(theirs.get(claim, ())))
        if both:
            raise ConfigError(
                f"{_switch(a)} with {_switch(b)}: both claim {CLAIMS[claim]} ({claim!r}) of "
                f"layers {both}; turn one of them off, or give them different layers"
            )


def _switch(p: Plugin) -> str:
    return f"{p.name}.{p.switch}={getattr(p.settings, p.switch)!r}"
