"""Decentralised diffusion balancing for a pipeline (seed 003 §B.3 Alg. 2; seed 000 §3.3, Lemma 2;
docs/parallelism.md "Diffusion" has the derivation).

Alg. 2 lets an overloaded rank send a layer to a less loaded one whenever that lowers the
variance of the loads and the receiver's memory fits. In a pipeline a stage's layers stay
consecutive, so a stage hands a *boundary* unit (its first or last layer, with any zero-cost
layers in front of it) to a *neighbour*. Moving cost ``x`` from load ``a`` to load ``b`` lowers
the variance exactly when ``0 < x < a - b``, so no move sequence cycles. A hand-over may be
*relayed* down the line (a receiver no more loaded than the donor passes its far boundary unit
on), which escapes staircases such as ``(4, 5, 6)``. One round visits every stage once,
alternating direction; the result is a local optimum (:func:`dynjax.balance.partition` finds
the global one).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dynjax.balance._checks import (
    as_counts,
    as_nonneg,
    hop_costs,
    memory_and_capacity,
)


@dataclass(frozen=True)
class DiffusionResult:
    """What :func:`diffusion_with_info` reached and how."""

    counts: tuple[int, ...]  # [S] layers per stage
    iterations: int  # rounds that moved at least one layer
    converged: bool  # a full round found no move that lowers the variance
    # accepted moves in order; each is the (src stage, dst stage, layer) hand-overs that together
    # lower the variance (one for a plain hand-over, more when relayed)
    moves: tuple[tuple[tuple[int, int, int], ...], ...]


def diffusion(
    costs: Sequence[float] | np.ndarray,
    counts: Sequence[int],
    *,
    memory: Sequence[float] | np.ndarray | None = None,
    capacity: float | Sequence[float] | None = None,
    comm: float | Sequence[float] = 0.0,
    max_iters: int = 10,
) -> tuple[int, ...]:
    """Layers per stage after diffusion from ``counts``; see :func:`diffusion_with_info`.

    >>> diffusion([2, 1, 1, 1, 1], (4, 1))
    (2, 3)
    """
    return diffusion_with_info(
        costs, counts, memory=memory, capacity=capacity, comm=comm, max_iters=max_iters
    ).counts


def diffusion_with_info(
    costs: Sequence[float] | np.ndarray,
    counts: Sequence[int],
    *,
    memory: Sequence[float] | np.ndarray | None = None,
    capacity: float | Sequence[float] | None = None,
    comm: float | Sequence[float] = 0.0,
    max_iters: int = 10,
) -> DiffusionResult:
    """Run up to ``max_iters`` diffusion rounds from the layout ``counts``.

    Args:
      costs: per-layer cost ``[L]`` (time or parameter count).
      counts: current layers per stage ``[S]``.
      memory, capacity: per-layer memory and per-stage capacity (scalar or ``[S]``); a stage only
        accepts layers that keep it within capacity.
      comm: per-hop transfer time (scalar or ``[S-1]``) counted in each sender's load, so a slow
        link pushes work away from the stage behind it (seed 003 §D.2).
      max_iters: most rounds to run (seed 003 §D.1 uses 5 and sees convergence after about 2).
    """
    c = as_nonneg(costs, "costs")
    n = as_counts(counts, c.size)
    num_stages = n.size
    if max_iters < 0:
        raise ValueError(f"max_iters must be >= 0, got {max_iters}")
    mem_cap = memory_and_capacity(memory, capacity, c.size, num_stages)
    mem = np.zeros(c.size) if mem_cap is None else mem_cap[0]
    caps = [np.inf] * num_stages if mem_cap is None else mem_cap[1].tolist()
    state = _State(
        prefix=np.concatenate(([0.0], np.cumsum(c))).tolist(),
        mem_prefix=np.concatenate(([0.0], np.cumsum(mem))).tolist(),
        hops=hop_costs(comm, num_stages).tolist(),
        caps=caps,
        bounds=np.concatenate(([0], np.cumsum(n))).tolist(),
        moves=[],
    )
    iterations, converged = 0, False
    for round_ in range(max_iters):
        order = range(num_stages) if round_ % 2 == 0 else range(num_stages - 1, -1, -1)
        moved = [state.relieve(s) for s in order]
        if not any(moved):
            converged = True
            break
        iterations += 1
    else:
        converged = not any(state.relieve(s, dry_run=True) for s in range(num_stages))
    return DiffusionResult(
        counts=tuple(int(x) for x in np.diff(state.bounds)),
        iterations=iterations,
        converged=converged,
        moves=tuple(state.moves),
    )


@dataclass
class _State:
    prefix: list[float]  # [L+1] cumulative cost
    mem_prefix: list[float]  # [L+1] cumulative memory
    hops: list[float]  # [S] transfer cost counted in each stage's load
    caps: list[float]  # [S]
    bounds: list[int]  # [S+1] stage s holds layers bounds[s] .. bounds[s+1]-1
    moves: list[tuple[tuple[int, int, int], ...]]

    def load(self, s: int) -> float:
        return (self.prefix[self.bounds[s + 1]] - self.prefix[self.bounds[s]]) + self.hops[s]

    def room(self, s: int) -> float:
        used = self.mem_prefix[self.bounds[s + 1]] - self.mem_prefix[self.bounds[s]]
        return self.caps[s] - used

    def relieve(self, s: int, *, dry_run: bool = False) -> bool:
        """Stage ``s`` hands units towards its most-exceeded neighbour first; True if any moved."""
        steps = [st for st in (-1, 1) if 0 <= s + st < len(self.hops)]
        steps.sort(key=lambda st: self.load(s + st))
        for step in steps:
            moved = False
            while (path := self._path(s, step)) is not None:
                if dry_run:
                    return True
                self.moves.append(tuple(t for stage, size in path
                                        for t in self._hand(stage, step, size)))
                moved = True
            if moved:
                return True
        return False

    def _path(self, s: int, step: int) -> list[tuple[int, int]] | None:
        """Hand-overs ``(stage, layers)`` of the shortest relay from ``s`` towards ``s + step`` that
        lowers the variance and fits memory, or ``None``."""
        unit = self._facing(s, step)
        if unit is None:
            return None
        size, x, m = unit
        donor = self.load(s)
        change = (donor - x) ** 2 - donor**2  # of the sum of squared loads, so far
        tolerance = 1e-12 * donor**2  # float noise must not pass for an improvement
        path = [(s, size)]
        d = s + step
        while 0 <= d < len(self.hops):
            load, room = self.load(d), self.room(d)
            if m <= room and change + (load + x) ** 2 - load**2 < -tolerance:
                return path  # d absorbs the unit
            nxt = self._facing(d, step) if load <= donor else None
            if nxt is None or m - nxt[2] > room:
                return None
            change += (load + x - nxt[1]) ** 2 - load**2  # d relays: takes x, passes nxt on
            size, x, m = nxt
            path.append((d, size))
            d += step
        return None

    def _facing(self, s: int, step: int) -> tuple[int, float, float] | None:
        """(layers, cost, memory) of the unit ``s`` can hand towards ``s + step``: the boundary
        layers up to and including the first with positive cost, keeping >= 1 layer on ``s``."""
        lo, hi = self.bounds[s], self.bounds[s + 1]
        p, mp = self.prefix, self.mem_prefix
        for size in range(1, hi - lo):
            a, b = (hi - size, hi) if step == 1 else (lo, lo + size)
            if p[b] - p[a] > 0.0:
                return size, p[b] - p[a], mp[b] - mp[a]
        return None

    def _hand(self, s: int, step: int, size: int) -> list[tuple[int, int, int]]:
        if step == 1:
            self.bounds[s + 1] -= size
            layers = range(self.bounds[s + 1] + size - 1, self.bounds[s + 1] - 1, -1)
        else:
            self.bounds[s] += size
            layers = range(self.bounds[s] - size, self.bounds[s])
        return [(s, s + step, i) for i in layers]
