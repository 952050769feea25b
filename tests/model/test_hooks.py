"""Hook sets are data: equal sets make equal, hashable `Hooks` that run only what they hold."""

import jax.numpy as jnp
import pytest

from dynjax.dynamism import BUILTIN
from dynjax.model import early_exit, mod
from dynjax.model.hooks import NO_HOOKS, Hooks, HookSet


def test_the_schemes_hooks_are_equal_hashable_data():
    a, b = BUILTIN.hooks(), BUILTIN.hooks()
    assert a == b and hash(a) == hash(b)  # equal Plans keep equal compile keys
    assert a != NO_HOOKS and mod.HOOKS in a.sets and early_exit.HOOKS in a.sets
    assert a.reduction(early_exit.NEEDED_HIST) == "sum" and NO_HOOKS.reduction("x/y") == "mean"
    assert a.full_precision("routed_bias") and not NO_HOOKS.full_precision("routed_bias")


def test_hooks_run_only_what_they_hold():
    options = (("mod", None), ("toy", 2.0))
    toy = HookSet("toy", block=lambda x, s: (x * s, {"toy/sum": jnp.sum(x)}))
    x, metrics = Hooks((toy,)).apply_block_hooks(jnp.ones(3), options)
    assert x.tolist() == [2.0] * 3 and float(metrics["toy/sum"]) == 3.0
    x, metrics = NO_HOOKS.apply_block_hooks(jnp.ones(3), options)
    assert x.tolist() == [1.0] * 3 and metrics == {}
    assert BUILTIN.hooks().context_needs([(("early_exit", None),)]) == {"readout", "targets"}
    assert BUILTIN.hooks().carrying_wrappers([(("mod", None),), (("early_exit", None),)]) == (
        "early_exit",
    )


def test_bad_hook_sets_are_refused():
    with pytest.raises(ValueError, match="two hook sets are named"):
        Hooks((HookSet("a"), HookSet("a")))
    with pytest.raises(ValueError, match="unknown reductions"):
        HookSet("a", reductions=(("a/x", "median"),))
    with pytest.raises(ValueError, match="unknown context needs"):
        HookSet("a", needs=frozenset({"logits"}))
