"""RECOMPILE (seed 001 §3): Plans, their background compilation, and the policies that change them.

The training step is a pure function of a static `Plan`; a `Controller` runs policies on metrics
the `Monitor` reads Δ steps late, and swaps in a new Plan once the `Compiler` has built it.
"""

from dynjax.recompile.compiler import (
    Compiler,
    CompileResult,
    default_cache_dir,
    enable_persistent_cache,
)
from dynjax.recompile.controller import Controller, Swap
from dynjax.recompile.events import EventLog
from dynjax.recompile.monitor import Monitor
from dynjax.recompile.plan import Plan, PlanContext, PlanError
from dynjax.recompile.policy import History, Policy, Proposal
from dynjax.recompile.rebalance import Rebalance, moved_layers
from dynjax.recompile.repack import Repack
from dynjax.recompile.rounds import Budget

__all__ = [
    "Budget",
    "CompileResult",
    "Compiler",
    "Controller",
    "EventLog",
    "History",
    "Monitor",
    "Plan",
    "PlanContext",
    "PlanError",
    "Policy",
    "Proposal",
    "Rebalance",
    "Repack",
    "Swap",
    "default_cache_dir",
    "enable_persistent_cache",
    "moved_layers",
]
