"""Egeria's plasticity measurement (seed 000 §4.2.3; Wang et al., arXiv:2201.06227): how far each
layer's output on a fixed probe batch moved from a reference snapshot.

Egeria keeps a reference copy of the model, refreshed periodically, and compares the training
model's layer activations with the reference's on the same inputs. On a *fixed* probe batch the
reference model's outputs do not change between refreshes, so `PlasticityProbe` keeps those
outputs instead of a model copy: the same numbers, for the memory of one probe activation per
layer. The forward runs stage by stage on each stage's own devices (the parameters are never
gathered onto one device): the embedding where it lives, then every layer in order, the
activation moving to the next stage's devices as between pipeline stages.

The probe forward is the model's own (`Block`), in float32, with MoE capacities large enough
that no (token, choice) pair is dropped: it measures the layer functions, not the step's drops.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dynjax.model import GPTConfig, ModelParts


class PlasticityProbe:
    """One run's probe batch and the reference outputs of its layers."""

    def __init__(self, cfg: GPTConfig, tokens: np.ndarray) -> None:
        self.parts = ModelParts.of(cfg)
        # A group is one sequence: an expert gets at most one pair per token of it.
        ample = (tokens.shape[1],) * cfg.num_experts
        self.capacities = tuple(
            ample if i in cfg.moe_layers else None for i in range(cfg.num_layers)
        )
        self.tokens = np.asarray(tokens, np.int32)
        self.reference: list[jax.Array] | None = None

    def outputs(self, states: Sequence[dict[str, Any]]) -> list[jax.Array]:
        """Each layer's output on the probe batch ``[B, S, d]``, in layer order, from the
        per-stage ``{"params", ...}`` dicts in stage order (`Plugin.measure`'s ``states``)."""
        x, out = None, {}
        for state in states:
            params = state["params"]
            where = _replicated(params)
            if "embed" in params:
                x = _embed(self.parts.embed, params["embed"], params.get("pos"),
                           jax.device_put(self.tokens, where))
            x = jax.device_put(x, where)
            for i in sorted(params.get("layers", {})):
                x = _layer(self.parts.layers[i], self.capacities[i], params["layers"][i], x)
                out[i] = x
        return [out[i] for i in range(len(self.parts.layers))]

    def refresh(self, states: Sequence[dict[str, Any]]) -> None:
        """Take the current model as the reference."""
        self.reference = self.outputs(states)

    def plasticity(self, states: Sequence[dict[str, Any]]) -> np.ndarray:
        """``||h_l - h_ref_l|| / ||h_ref_l||`` per layer ``[L]`` (float64): how far each layer's
        output moved since `refresh`."""
        if self.reference is None:
            raise ValueError("no reference yet: call refresh() first")
        now = self.outputs(states)
        changes = [_relative_change(h, ref) for h, ref in zip(now, self.reference, strict=True)]
        return np.asarray(jax.device_get(changes), np.float64)


def _replicated(params: Any) -> jax.sharding.Sharding:
    """The sharding that replicates an activation over the devices holding ``params``."""
    sharding = jax.tree.leaves(params)[0].sharding
    return NamedSharding(sharding.mesh, P()) if isinstance(sharding, NamedSharding) else sharding


@functools.partial(jax.jit, static_argnums=0)
def _embed(graphdef: Any, params: Any, pos: jax.Array | None, tokens: jax.Array) -> jax.Array:
    x = nnx.merge(graphdef, params)(tokens)
    return x if pos is None else x + pos[: tokens.shape[1]].astype(x.dtype)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _layer(graphdef: Any, capacities: tuple[int, ...] | None, params: Any, x: jax.Array):
    y, _, _ = nnx.merge(graphdef, params)(x, capacities=capacities)
    return y


@jax.jit
def _relative_change(h: jax.Array, reference: jax.Array) -> jax.Array:
    return jnp.linalg.norm((h - reference).ravel()) / jnp.linalg.norm(reference.ravel())
