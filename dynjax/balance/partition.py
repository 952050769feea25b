"""Exact min-max partition of consecutive layers into pipeline stages.

DynMo's centralised balancer (seed 000 §3.3, "Partition: by Time / by Param"; seed 003 §B.3) builds
on DeepSpeed's bisection with linear probing. Here the bisection is made exact: the bottleneck is
searched over the stage costs that can actually occur, so the returned layout minimises the
maximum stage cost, under per-stage memory caps and with network-aware stage costs (seed 003 §D.2).

How (``L`` layers, ``S`` stages; ``P``/``M`` prefix sums of cost/memory):

* Stage ``k`` holding layers ``[b, e)`` costs ``(P[e] - P[b]) + hop[k]`` (``hop`` = time to send
  activations on; 0 for the last stage) and fits when that is ``<= T`` and
  ``M[e] - M[b] <= cap[k]``. Both sides are evaluated as exactly these float expressions everywhere,
  so the answer is exact for the costs as floats (and for integer-valued costs, exact outright).
* A probe at bottleneck ``T`` computes which boundaries are reachable with exactly ``k`` non-empty
  stages. When every single layer fits every stage, those sets are intervals ``[k, hi_k]`` and a
  greedy probe with ``bisect`` on the prefix sums costs ``O(S log L)``; otherwise a vectorised
  ``O(S L)`` probe tracks the sets as masks.
* A failed probe also returns the smallest ``T`` at which any reachable set could grow, a lower
  bound that jumps exactly to the next achievable stage cost; a successful one returns the
  bottleneck its witness achieves. Bisection between the two terminates on the optimum itself.
* Among all layouts achieving the optimum, a dynamic programme over each boundary's feasible
  window picks the one closest to ``current`` (sum of boundary shifts), so rebalancing moves as few
  layers as possible. A greedy layout's distance bounds every boundary's shift, which keeps the
  windows narrow even when one heavy layer leaves the other boundaries free.
"""

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dynjax.balance._checks import (
    as_counts,
    as_nonneg,
    check_stage_count,
    even_bounds,
    hop_costs,
    memory_and_capacity,
)
from dynjax.balance.errors import InfeasibleError

_INF_DIST = 2**62  # "unreachable" in the tie-break programme
_SMALL_LEVEL = 64  # levels up to this wide are relaxed in plain Python


def partition(
    costs: Sequence[float] | np.ndarray,
    num_stages: int,
    *,
    memory: Sequence[float] | np.ndarray | None = None,
    capacity: float | Sequence[float] | None = None,
    current: Sequence[int] | None = None,
    comm: float | Sequence[float] = 0.0,
) -> tuple[int, ...]:
    """Layers per stage that minimise the maximum stage cost exactly.

    Args:
      costs: per-layer cost, ``[L]``: measured times (by time) or parameter counts (by param).
      num_stages: ``S``; every stage gets at least one consecutive layer.
      memory: per-layer memory ``[L]``; with ``capacity`` (scalar or ``[S]``) each stage's summed
        memory must stay within its capacity.
      current: the layout now in use (layers per stage, ``[S]``). Among optimal layouts the one with
        the smallest total boundary shift ``sum_k |b_k - current_k|`` wins -- the number of layers
        that change stage when no layer skips a stage. Default: closest to the even split.
      comm: per-hop activation transfer time (scalar or ``[S-1]``) added to every stage but the
        last (network-aware cost, seed 003 §D.2).

    Raises:
      InfeasibleError: no layout satisfies the constraints; the message says why.

    >>> partition([1, 1, 1, 1, 4], 2)
    (4, 1)
    >>> partition([1, 1, 1, 1], 2, current=(3, 1))  # (2, 2) is optimal, (3, 1) is not
    (2, 2)
    >>> partition([1, 1, 2, 2], 2, memory=[1, 1, 1, 1], capacity=[3, 1])
    (3, 1)
    """
    c = as_nonneg(costs, "costs")
    num_layers = c.size
    check_stage_count(num_layers, num_stages)
    mem_cap = memory_and_capacity(memory, capacity, num_layers, num_stages)
    if current is None:
        reference = even_bounds(num_layers, num_stages)
    else:
        cur = as_counts(current, num_layers, "current")
        if cur.size != num_stages:
            raise ValueError(f"current has {cur.size} stages, expected {num_stages}")
        reference = np.concatenate(([0], np.cumsum(cur)))
    problem = _Problem.build(c, num_stages, mem_cap, hop_costs(comm, num_stages))
    unconstrained = problem.probe(np.inf)
    if not unconstrained.ok:
        raise InfeasibleError(problem.why_infeasible())
    best = problem.min_bottleneck(problem.achieved(unconstrained.witness(problem)))
    return problem.closest(best, reference)


@dataclass(frozen=True)
class _Probe:
    """Outcome of probing one bottleneck ``T``.

    ``reach[k]`` describes the boundaries reachable with exactly ``k`` stages: an ``int`` ``hi_k``
    (the set is ``[k, hi_k]``) on the interval path, a boolean mask ``[L+1]`` on the general path.
    ``next_t`` is the smallest bottleneck at which any reachable set grows.
    """

    ok: bool
    next_t: float
    reach: list[int] | list[np.ndarray]

    def witness(self, problem: "_Problem") -> np.ndarray:
        """Boundaries ``[S+1]`` of a layout fitting at the probed ``T`` (latest predecessors)."""
        num_layers, num_stages = problem.num_layers, problem.num_stages
        bounds = np.empty(num_stages + 1, dtype=np.int64)
        bounds[num_stages] = num_layers
        for k in range(num_stages - 1, 0, -1):
            r = self.reach[k]
            if isinstance(r, int):
                bounds[k] = min(r, bounds[k + 1] - 1)
            else:
                bounds[k] = np.flatnonzero(r[: bounds[k + 1]])[-1]
        bounds[0] = 0
        return bounds


@dataclass(frozen=True)
class _Problem:
    prefix: np.ndarray  # [L+1] cumulative cost
    prefix_list: list[float]  # same, for bisect
    mem_prefix: np.ndarray | None  # [L+1] cumulative memory
    mem_list: list[float] | None
    caps: np.ndarray  # [S] memory capacity per stage (inf when unconstrained)
    hops: np.ndarray  # [S] transfer cost added to each stage; 0 for the last
    num_layers: int
    num_stages: int
    max_layer_cost: float  # largest single-layer cost, as a prefix difference
    max_layer_mem: float

    @classmethod
    def build(
        cls,
        costs: np.ndarray,
        num_stages: int,
        mem_cap: tuple[np.ndarray, np.ndarray] | None,
        hops: np.ndarray,
    ) -> "_Problem":
        prefix = np.concatenate(([0.0], np.cumsum(costs)))
        if mem_cap is None:
            mem_prefix, caps, max_mem = None, np.full(num_stages, np.inf), 0.0
        else:
            mem_prefix = np.concatenate(([0.0], np.cumsum(mem_cap[0])))
            caps, max_mem = mem_cap[1], float(np.diff(mem_prefix).max())
        return cls(
            prefix=prefix,
            prefix_list=prefix.tolist(),
            mem_prefix=mem_prefix,
            mem_list=None if mem_prefix is None else mem_prefix.tolist(),
            caps=caps,
            hops=hops,
            num_layers=costs.size,
            num_stages=num_stages,
            max_layer_cost=float(np.diff(prefix).max()),
            max_layer_mem=max_mem,
        )

    # -- probing ---------------------------------------------------------------------------------

    def singles_fit(self, t: float) -> bool:
        """Every layer alone fits every stage at ``t``; then the reachable sets are intervals."""
        return self.max_layer_cost + float(self.hops.max()) <= t and (
            self.max_layer_mem <= float(self.caps.min())
        )

    def probe(self, t: float) -> _Probe:
        return self._probe_intervals(t) if self.singles_fit(t) else self._probe_masks(t)

    def _probe_intervals(self, t: float) -> _Probe:
        p, m, num_layers = self.prefix_list, self.mem_list, self.num_layers
        hops, caps = self.hops.tolist(), self.caps.tolist()
        hi, reach, next_t = 0, [0], np.inf
        for k in range(self.num_stages):
            b = min(hi, num_layers - 1)
            e = _last_end(p, b, t, hops[k], num_layers)
            if m is not None:
                e = min(e, _last_end(m, b, caps[k], 0.0, num_layers))
            if e < num_layers and (m is None or m[e + 1] - m[b] <= caps[k]):
                stretched = (p[e + 1] - p[b]) + hops[k]
                if stretched > t:  # this stage is cost-bound: a larger T would let it grow
                    next_t = min(next_t, stretched)
            hi = e
            reach.append(hi)
        return _Probe(ok=hi == num_layers, next_t=next_t, reach=reach)

    def _probe_masks(self, t: float) -> _Probe:
        p, m, num_layers = self.prefix, self.mem_prefix, self.num_layers
        idx = np.arange(num_layers + 1)
        reach = np.zeros(num_layers + 1, dtype=bool)
        reach[0] = True
        masks, next_t = [reach], np.inf
        for k in range(self.num_stages):
            before = np.maximum.accumulate(np.where(reach, idx, -1))
            pred = np.concatenate(([-1], before[:-1]))  # latest reachable boundary < e
            has_pred = pred >= 0
            pc = np.where(has_pred, pred, 0)
            stage_cost = (p - p[pc]) + self.hops[k]
            cost_ok = stage_cost <= t
            fits_mem = has_pred if m is None else has_pred & ((m - m[pc]) <= self.caps[k])
            blocked = fits_mem & ~cost_ok
            if blocked.any():
                next_t = min(next_t, float(stage_cost[blocked].min()))
            reach = fits_mem & cost_ok
            masks.append(reach)
        return _Probe(ok=bool(reach[num_layers]), next_t=next_t, reach=masks)

    def achieved(self, bounds: np.ndarray) -> float:
        """Bottleneck of a layout, with the same float expression the probes use."""
        return float(np.max((self.prefix[bounds[1:]] - self.prefix[bounds[:-1]]) + self.hops))

    def min_bottleneck(self, hi: float) -> float:
        """Exact optimum, given a feasible bottleneck ``hi`` achieved by some layout."""
        hop_total = float(self.hops.sum())
        average = (self.prefix_list[-1] + hop_total) / self.num_stages
        # A stage holds its layers' cost, so T* >= the largest layer; T* >= the mean stage cost,
        # loosened by 1e-9 to stay below the optimum despite rounding of the prefix sums.
        lo = max(self.max_layer_cost, average * (1.0 - 1e-9))
        guess = max(lo, average) + self.max_layer_cost + float(self.hops.max())
        if guess < hi:  # the classic greedy bound; skips bisection steps when memory does not bind
            probe = self.probe(guess)
            if probe.ok:
                hi = min(hi, self.achieved(probe.witness(self)))
        while lo < hi:
            mid = lo + (hi - lo) / 2
            if not lo <= mid < hi:
                mid = lo
            probe = self.probe(mid)
            if probe.ok:
                hi = min(mid, self.achieved(probe.witness(self)))
            else:
                lo = max(probe.next_t, float(np.nextafter(mid, np.inf)))
        return hi

    # -- choosing among optimal layouts --------------------------------------------------------

    def _windows(self, t: float) -> list[tuple[int, np.ndarray]]:
        """For k = 1..S-1: (first position, validity mask) of boundary ``b_k`` at ``t``."""
        num_layers, num_stages = self.num_layers, self.num_stages
        fwd = self.probe(t)
        out = []
        if isinstance(fwd.reach[1], int):  # interval path: backward sets are [lo_k, L - S + k]
            starts = [0] * num_stages
            end = num_layers
            for k in range(num_stages - 1, 0, -1):  # earliest start of stage k ending at lo_{k+1}
                b = _first_start(self.prefix_list, end, t, float(self.hops[k]))
                if self.mem_list is not None:
                    b = max(b, _first_start(self.mem_list, end, float(self.caps[k]), 0.0))
                starts[k] = end = b
            for k in range(1, num_stages):
                first = max(k, starts[k])
                last = min(fwd.reach[k], num_layers - num_stages + k)
                out.append((first, np.ones(last - first + 1, dtype=bool)))
            return out
        back = self._reach_back(t)
        for k in range(1, num_stages):
            valid = fwd.reach[k] & back[k]
            where = np.flatnonzero(valid)
            out.append((int(where[0]), valid[where[0] : where[-1] + 1]))
        return out

    def _reach_back(self, t: float) -> list[np.ndarray]:
        """``back[k]``: boundaries from which the last ``S - k`` stages can cover the rest."""
        p, m, num_layers = self.prefix, self.mem_prefix, self.num_layers
        idx = np.arange(num_layers + 1)
        back = [np.zeros(0, dtype=bool)] * (self.num_stages + 1)
        reach = idx == num_layers
        back[self.num_stages] = reach
        for k in range(self.num_stages - 1, -1, -1):
            after = np.minimum.accumulate(np.where(reach, idx, num_layers + 1)[::-1])[::-1]
            succ = np.concatenate((after[1:], [num_layers + 1]))  # earliest reachable end > b
            has = succ <= num_layers
            sc = np.where(has, succ, num_layers)
            ok = has & (((p[sc] - p) + self.hops[k]) <= t)
            if m is not None:
                ok &= (m[sc] - m) <= self.caps[k]
            reach = ok
            back[k] = ok
        return back

    def closest(self, t: float, reference: np.ndarray) -> tuple[int, ...]:
        """Among layouts with bottleneck ``<= t``, one with least ``sum |b_k - reference_k|``."""
        num_layers, num_stages = self.num_layers, self.num_stages
        if num_stages == 1:
            return (num_layers,)
        levels = self._windows(t)
        # Any layout's distance d0 bounds the optimum's, so every optimal b_k lies within d0 of
        # reference_k: cut the windows to that band before the programme (wide windows arise when
        # one heavy layer fixes the bottleneck; the greedy layout then sits close to the reference).
        d0 = self._greedy_distance(t, levels, reference)
        levels = [_band(first, valid, int(reference[k]), d0)
                  for k, (first, valid) in enumerate(levels, start=1)]
        levels.append((num_layers, np.ones(1, dtype=bool)))
        windows = self._predecessor_windows(t, levels)
        prev_d = np.zeros(1, dtype=np.int64)
        tables = [(0, prev_d, None, None)]
        for k, ((first, valid), (lo, hi)) in enumerate(zip(levels, windows, strict=True), start=1):
            dist = np.abs(np.arange(first, first + valid.size) - reference[k])
            prev_d = _relax(prev_d, lo, hi, valid, dist)
            tables.append((first, prev_d, lo, hi))
        assert prev_d[0] < _INF_DIST, "tie-break lost the optimal layout"
        bounds = [num_layers]
        i = 0
        for k in range(num_stages, 0, -1):
            _, _, lo, hi = tables[k]
            first_prev, d_prev, _, _ = tables[k - 1]
            j = lo[i] + int(np.argmin(d_prev[lo[i] : hi[i]]))
            bounds.append(first_prev + j)
            i = j
        return tuple(int(n) for n in np.diff(bounds[::-1]))

    def _greedy_distance(
        self, t: float, levels: list[tuple[int, np.ndarray]], reference: np.ndarray
    ) -> int:
        """Distance to ``reference`` of the layout that puts each boundary as close as it can."""
        b, total = 0, 0
        for k, (first, valid) in enumerate(levels, start=1):
            top = _last_end(self.prefix_list, b, t, float(self.hops[k - 1]), self.num_layers)
            if self.mem_list is not None:
                top = min(top, _last_end(self.mem_list, b, float(self.caps[k - 1]), 0.0,
                                         self.num_layers))
            start = max(b + 1, first)
            reachable = np.flatnonzero(valid[start - first : top - first + 1]) + start
            b = int(reachable[np.argmin(np.abs(reachable - reference[k]))])
            total += abs(b - int(reference[k]))
        return total

    def _predecessor_windows(
        self, t: float, levels: list[tuple[int, np.ndarray]]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per level k >= 1 and end ``e`` in it: the index range ``[lo, hi)`` into level ``k-1``
        of the starts ``b`` with stage ``k-1 = [b, e)`` fitting. All levels in one batch."""
        firsts = np.array([0] + [first for first, _ in levels])
        sizes = np.array([1] + [valid.size for _, valid in levels])
        stage = np.repeat(np.arange(len(levels)), sizes[1:])  # stage k-1 ends at level k
        ends = np.concatenate([np.arange(f, f + n) for f, n in zip(firsts[1:], sizes[1:],
                                                                    strict=True)])
        start = _first_fit(self.prefix, self.prefix[ends], t, self.hops[stage])
        if self.mem_prefix is not None:
            start = np.maximum(start, _first_fit(self.mem_prefix, self.mem_prefix[ends],
                                                 self.caps[stage], 0.0))
        prev_first, prev_size = firsts[stage], sizes[stage]
        lo = np.clip(start - prev_first, 0, prev_size)
        hi = np.clip(ends - prev_first, 0, prev_size)  # b <= e - 1
        cuts = np.cumsum(sizes[1:])[:-1]
        return list(zip(np.split(lo, cuts), np.split(hi, cuts), strict=True))

    # -- explaining failure ----------------------------------------------------------------------

    def why_infeasible(self) -> str:
        assert self.mem_prefix is not None  # without memory caps every S <= L is feasible
        mem = np.diff(self.mem_prefix)
        worst = int(np.argmax(mem))
        if mem[worst] > self.caps.max():
            return (f"layer {worst} needs memory {mem[worst]:g} but the largest stage capacity is "
                    f"{self.caps.max():g}")
        total, room = float(self.mem_prefix[-1]), float(self.caps.sum())
        if total > room:
            return f"total memory {total:g} exceeds the summed stage capacities {room:g}"
        return (f"no split of {self.num_layers} consecutive layers into {self.num_stages} stages "
                f"fits the per-stage capacities (min {self.caps.min():g}, max {self.caps.max():g}; "
                f"total memory {total:g}): layers cannot be reordered")


def _last_end(prefix: list[float], b: int, limit: float, add: float, num_layers: int) -> int:
    """Largest ``e`` in ``[b, L]`` with ``(prefix[e] - prefix[b]) + add <= limit`` (``b``: none)."""
    e = min(max(bisect_right(prefix, prefix[b] + (limit - add)) - 1, b), num_layers)
    while e < num_layers and (prefix[e + 1] - prefix[b]) + add <= limit:
        e += 1  # bisect used a rounded target: settle on the exact predicate
    while e > b and (prefix[e] - prefix[b]) + add > limit:
        e -= 1
    return e


def _first_start(prefix: list[float], e: int, limit: float, add: float) -> int:
    """Smallest ``b`` in ``[0, e]`` with ``(prefix[e] - prefix[b]) + add <= limit`` (e: none)."""
    b = min(bisect_left(prefix, prefix[e] - (limit - add)), e)
    while b > 0 and (prefix[e] - prefix[b - 1]) + add <= limit:
        b -= 1
    while b < e and (prefix[e] - prefix[b]) + add > limit:
        b += 1
    return b


def _band(first: int, valid: np.ndarray, centre: int, radius: int) -> tuple[int, np.ndarray]:
    """Cut positions ``[first, first + len(valid))`` to ``[centre - radius, centre + radius]``."""
    lo = max(first, centre - radius)
    hi = min(first + valid.size, centre + radius + 1)
    return lo, valid[lo - first : hi - first]


def _relax(
    prev: np.ndarray, lo: np.ndarray, hi: np.ndarray, valid: np.ndarray, dist: np.ndarray
) -> np.ndarray:
    """One step of the tie-break programme: ``dist[i] + min(prev[lo[i]:hi[i]])`` where valid.

    Levels are usually a handful of positions wide, where plain Python beats NumPy's per-call
    overhead; wide levels use a sparse table.
    """
    if prev.size <= _SMALL_LEVEL and lo.size <= _SMALL_LEVEL:
        p, out = prev.tolist(), []
        for a, b, ok, extra in zip(lo.tolist(), hi.tolist(), valid.tolist(), dist.tolist(),
                                   strict=True):
            best = min(p[a:b]) if ok and a < b else _INF_DIST
            out.append(best + extra if best < _INF_DIST else _INF_DIST)
        return np.array(out, dtype=np.int64)
    best = _window_min(prev, lo, hi)
    return np.where(valid & (best < _INF_DIST), best + dist, _INF_DIST)


def _window_min(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``min(values[lo_i:hi_i])`` per window (``_INF_DIST`` when empty) from a sparse table.

    ``O(w log w)`` for ``w`` values however wide the windows are: windows get wide when one heavy
    layer fixes the bottleneck and leaves the other boundaries free.
    """
    length = hi - lo
    out = np.full(lo.size, _INF_DIST)
    nonempty = length > 0
    if not nonempty.any():
        return out
    table = [values]  # table[j][i] = min(values[i : i + 2**j])
    while 2 ** len(table) <= length.max():
        prev, span = table[-1], 2 ** (len(table) - 1)
        table.append(np.minimum(prev[:-span], prev[span:]))
    dense = np.full((len(table), values.size), _INF_DIST)
    for j, level in enumerate(table):
        dense[j, : level.size] = level
    lo, hi, length = lo[nonempty], hi[nonempty], length[nonempty]
    j = np.frexp(length)[1] - 1  # floor(log2(length)), exact for integers
    out[nonempty] = np.minimum(dense[j, lo], dense[j, hi - (1 << j)])
    return out


def _first_fit(
    starts: np.ndarray, ends: np.ndarray, limit: float | np.ndarray, add: float | np.ndarray
) -> np.ndarray:
    """Per end value: first index ``i`` with ``(end - starts[i]) + add <= limit`` (elementwise)."""
    i = np.searchsorted(starts, ends - (limit - add), side="left")
    n = starts.size
    while True:  # settle rounding of the searched target on the exact predicate (0-1 steps)
        left = np.maximum(i - 1, 0)
        back = (i > 0) & (((ends - starts[left]) + add) <= limit)
        here = np.minimum(i, n - 1)
        fwd = (i < n) & ~(((ends - starts[here]) + add) <= limit)
        if not (back.any() or fwd.any()):
            return i
        i = i - back + fwd
