"""Dynamism schemes as plugins (docs/plugins.md, docs/plugins.md): one module
per scheme, collected explicitly in `BUILTIN`; a run gets `BUILTIN` or `BUILTIN.with_(...)`."""

from dynjax.dynamism.base import (
    CLAIMS,
    Plugin,
    RunLink,
    layer_costs,
    plan_context,
    plan_layer_options,
)
from dynjax.dynamism.early_exit import EarlyExit
from dynjax.dynamism.freezing import FreezingPlugin
from dynjax.dynamism.mod import MixtureOfDepths
from dynjax.dynamism.moe import MoEPlugin
from dynjax.dynamism.pruning import PruningPlugin
from dynjax.dynamism.schemes import Schemes
from dynjax.dynamism.sparse_attention import SparseAttention

# The built-in schemes, in the order their sections appear and their optimizers wrap.
BUILTIN = Schemes(
    EarlyExit, FreezingPlugin, MixtureOfDepths, MoEPlugin, PruningPlugin, SparseAttention
)

__all__ = [
    "BUILTIN",
    "CLAIMS",
    "Plugin",
    "RunLink",
    "Schemes",
    "layer_costs",
    "plan_context",
    "plan_layer_options",
]
