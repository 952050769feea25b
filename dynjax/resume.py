"""What may change when a run resumes from its workdir, and what may not.

A checkpoint stores the config that wrote it. Resuming with another config must never train
something other than what the user asked for without a word: keys that decide what the saved
state *is* (model shape, vocabulary, data and its order) are refused before any work, naming
each key; keys that only decide how the step runs (dtype, microbatches, pipeline layout and
schedule, a scheme's Plan part such as capacities, policies, hyper-parameters, train.steps)
are applied, and every resume is
recorded with its config diff (`resume_event`), so the workdir tells what ran when.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from dynjax import config as config_lib
from dynjax.dynamism import BUILTIN, Schemes
from dynjax.errors import ConfigError
from dynjax.recompile import Plan

# A key equal to or under one of these decides what the checkpoint holds or which data the
# step t sees (the batch at step t is a pure function of seed, data and batch size); each
# dynamism plugin adds its own (`Plugin.fixed_on_resume`).
FIXED_ON_RESUME = ("seed", "data.", "model.", "train.batch_size")
# Keys under those that decide only how the step runs, not what it computes: how the same
# batches are read (not which), what a block keeps for its backward.
RUNNING_ONLY = ("data.prefetch", "data.token_cache", "model.remat")

# The config keys each core Plan field comes from. A resumed run keeps the saved value (what
# the policies made of it) unless one of its keys changed; then the new config's value applies.
# Each plugin decides for its own part (`Plugin.resumed_plan`).
PLAN_SOURCES = {
    "microbatches": ("train.microbatches", "mesh."),
    "dtype": ("train.dtype",),
    "schedule": ("pipeline.schedule",),
    "virtual_stages": ("pipeline.virtual_stages",),
    "stage_layers": ("pipeline.stage_layers", "pipeline.virtual_stages", "mesh.stage"),
    "remat": ("model.remat",),
}


def _matches(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in prefixes)


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{name}."))
        else:  # as saved in JSON: a tuple comes back as a list
            out[f"{prefix}{name}"] = list(value) if isinstance(value, tuple) else value
    return out


def config_changes(
    saved: dict[str, Any], cfg: ml_collections.ConfigDict, schemes: Schemes = BUILTIN
) -> dict[str, tuple[Any, Any]]:
    """``key -> (saved value, new value)`` for every key that differs. A key the saving run did
    not have yet counts with its default (what that run did); keys since removed are ignored."""
    before = _flat(config_lib.default_config(schemes).to_dict()) | _flat(saved)
    after = _flat(cfg.to_dict())
    return {k: (before[k], v) for k, v in sorted(after.items()) if before.get(k, v) != v}


def check_resumable(
    changes: dict[str, tuple[Any, Any]], workdir: object, schemes: Schemes = BUILTIN
) -> None:
    """Raise ConfigError naming every changed key the saved state cannot follow."""
    keys = FIXED_ON_RESUME + schemes.fixed_on_resume()
    fixed = {k: v for k, v in changes.items() if _matches(k, keys) and k not in RUNNING_ONLY}
    if fixed:
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in fixed.items())
        raise ConfigError(
            f"{workdir} was trained with another model or data, and its checkpoints cannot "
            f"continue with this config ({listed}). Resume with the saved values, or pass a new "
            "--workdir to start a new run"
        )


def resumed_plan(
    saved: Plan, implied: Plan, changes: dict[str, tuple[Any, Any]], schemes: Schemes = BUILTIN
) -> Plan:
    """The saved Plan with each field whose config keys changed taken from ``implied``, the
    Plan the new config gives a fresh run."""
    fields = {
        field: getattr(implied, field)
        for field, keys in PLAN_SOURCES.items()
        if any(_matches(k, keys) for k in changes)
    }
    return schemes.resumed_plan(saved.replace(**fields), implied, changes)


def resume_event(
    step: int, changes: dict[str, tuple[Any, Any]], saved: Plan, plan: Plan
) -> dict[str, Any]:
    """The ``resume`` event: where the run continues, its config diff and the Plan diff."""
    return {
        "event": "resume",
        "step": step,
        "config_diff": {k: [a, b] for k, (a, b) in changes.items()},
        "plan_diff": saved.diff(plan),
    }
