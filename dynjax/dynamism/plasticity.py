"""Egeria's plasticity measurement (seed 000 §4.2.3; Wang et al., arXiv:2201.06227): how far each
layer's output on a fixed probe batch moved from a reference snapshot.

Egeria keeps a reference copy of the model, refreshed periodically, and compares the training
model's layer activations with the reference's on the same inputs. On a *fixed* probe batch the
reference model's outputs do not change between refreshes, so `PlasticityProbe` keeps those
outputs instead of a model copy: the same numbers, for the host memory of one probe activation
per layer. The forward runs stage by stage on each stage's own devices (the parameters are never
gathered onto one device): the embedding where it lives, then every layer in order, the
activation moving to the next stage's devices as between pipeline stages.

In a pipeline over several processes each process runs its own stages' layers, the activation
passing between processes through the host (`RunLink.rounds`); each layer's change is
computed where its reference was taken and the per-layer values are exchanged, so every process
returns the same ``[L]`` array.

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
from dynjax.model.hooks import LayerOptions, layer_options
from dynjax.model.moe import MOE, MoELayer
from dynjax.parallel.peers import ALONE, Rounds


class PlasticityProbe:
    """One run's probe batch and the reference outputs of its layers."""

    def __init__(self, cfg: GPTConfig, tokens: np.ndarray) -> None:
        self.parts = ModelParts.of(cfg)
        # A group is one sequence: an expert gets at most one pair per token of it.
        ample = layer_options({MOE: MoELayer(capacities=(tokens.shape[1],) * cfg.num_experts)})
        self.options = tuple(ample if i in cfg.moe_layers else () for i in range(cfg.num_layers))
        self.tokens = np.asarray(tokens, np.int32)
        # This process's layers' outputs at the last `refresh`, by layer (`_on_host`): on the
        # host, a reference stays usable wherever its layer moves (another stage, another
        # process) before the next refresh.
        self.reference: dict[int, Any] | None = None

    def outputs(self, states: Sequence[dict[str, Any]], rounds: Rounds = ALONE) -> dict[int, Any]:
        """This process's layers' outputs on the probe batch ``[B, S, d]`` by layer index, from
        its per-stage ``{"params", ...}`` dicts in stage order (`Plugin.measure`'s ``states``).
        In a pipeline over processes (``rounds``: `RunLink.rounds`), the activation
        goes from each process's last stage to the next process's first through the host, in
        process order (the stages' order), one exchange per process boundary."""
        x, out = None, {}
        for turn in range(rounds.count):
            if turn == rounds.index:
                x = self._forward(states, x, out)
            if turn + 1 < rounds.count:
                mine = turn == rounds.index and x is not None
                handed = rounds.all(np.asarray(x) if mine else None)[turn]
                x = handed if turn + 1 == rounds.index else x
        return out

    def _forward(self, states: Sequence[dict[str, Any]], x: Any, out: dict[int, Any]) -> Any:
        """Run ``states``' layers on ``x`` (the embedding's stage starts from the probe tokens),
        each stage on its own devices; every layer's output goes into ``out``."""
        for state in states:
            params = state["params"]
            where = _replicated(params)
            if "embed" in params:
                x = _embed(self.parts.embed, params["embed"], params.get("pos"),
                           jax.device_put(self.tokens, where))
            x = jax.device_put(x, where)
            for i in sorted(params.get("layers", {})):
                x = _layer(self.parts.layers[i], self.options[i], params["layers"][i], x)
                out[i] = x
        return x

    def refresh(self, states: Sequence[dict[str, Any]], rounds: Rounds = ALONE) -> None:
        """Take the current model as the reference."""
        self.reference = {i: _on_host(h) for i, h in self.outputs(states, rounds).items()}

    def plasticity(self, states: Sequence[dict[str, Any]], rounds: Rounds = ALONE) -> np.ndarray:
        """``||h_l - h_ref_l|| / ||h_ref_l||`` per layer ``[L]`` (float64): how far each layer's
        output moved since `refresh`. Each is computed where the reference is: the output of
        a layer that moved to another process since goes there through the host."""
        if self.reference is None:
            raise ValueError("no reference yet: call refresh() first")
        now = self.outputs(states, rounds)
        away = {i: np.asarray(h) for i, h in now.items() if i not in self.reference}
        for part in rounds.all(away):
            now.update({i: h for i, h in part.items() if i in self.reference})
        mine = {i: _relative_change(h, _placed_like(self.reference[i], h)) for i, h in now.items()
                if i in self.reference}
        changes = {i: float(c) for i, c in jax.device_get(mine).items()}
        every = {i: c for part in rounds.all(changes) for i, c in part.items()}
        return np.asarray([every[i] for i in range(len(self.parts.layers))], np.float64)


def _on_host(h: jax.Array) -> Any:
    """``h`` as a host array; a global array of one program over several processes, which no
    host can fetch whole and whose devices a layer never leaves, stays where it is."""
    return np.asarray(h) if h.is_fully_addressable else h


def _placed_like(reference: Any, h: Any) -> Any:
    """A host ``reference`` on ``h``'s devices (a host ``h``: left on the host)."""
    if isinstance(h, jax.Array) and not isinstance(reference, jax.Array):
        return jax.device_put(reference, h.sharding)
    return reference


def _replicated(params: Any) -> jax.sharding.Sharding:
    """The sharding that replicates an activation over the devices holding ``params``."""
    sharding = jax.tree.leaves(params)[0].sharding
    return NamedSharding(sharding.mesh, P()) if isinstance(sharding, NamedSharding) else sharding


@functools.partial(jax.jit, static_argnums=0)
def _embed(graphdef: Any, params: Any, pos: jax.Array | None, tokens: jax.Array) -> jax.Array:
    x = nnx.merge(graphdef, params)(tokens)
    return x if pos is None else x + pos[: tokens.shape[1]].astype(x.dtype)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _layer(graphdef: Any, options: LayerOptions, params: Any, x: jax.Array):
    y, _, _ = nnx.merge(graphdef, params)(x, options=options)
    return y


@jax.jit
def _relative_change(h: jax.Array, reference: jax.Array) -> jax.Array:
    return jnp.linalg.norm((h - reference).ravel()) / jnp.linalg.norm(reference.ravel())
