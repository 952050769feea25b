"""Dynamism schemes as plugins (DESIGN.md "Dynamism plugins"): one module per scheme.

Importing this package registers the built-in schemes; `register` adds others.
"""

from dynjax.dynamism import (  # noqa: F401 - each registers its scheme
    early_exit,
    freezing,
    mod,
    moe,
    pruning,
    sparse_attention,
)
from dynjax.dynamism.base import (
    Plugin,
    enabled_plugins,
    layer_costs,
    plan_layer_options,
    register,
    registered,
)

__all__ = [
    "Plugin",
    "enabled_plugins",
    "layer_costs",
    "plan_layer_options",
    "register",
    "registered",
]
