"""MPipeMoE's adaptive pipeline granularity (seed 002 §III-C, Alg. 1) and the cost model of its
memory reuse strategies (§III-E, Table II, eq. 7-10), as pure host code.

An MoE layer split into n partitions (`dynjax.model.moe.Chunking`) overlaps partition i+1's
dispatch all-to-all with partition i's experts; too few partitions overlap little, too many leave
the device under-used, and the best n grows with the token count B (§III-C's monotonicity
hypothesis). `GranularityTable` is Alg. 1's bookkeeping: disjoint B-ranges, one per n, and a
cache of the n chosen for each B. `AdaptiveGranularity` is the policy that times a few steps of
each candidate n at a new B, records the fastest in the table and proposes it through the
Controller, and for a B inside a known range proposes that range's n without trials.

`reuse_costs` is eq. 10 for each strategy of Table II; `choose_reuse` picks the cheapest for
measured compute, communication and copy speeds (``moe.memory_reuse="auto"``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dynjax.dynamism.moe.speeds import Speeds
from dynjax.recompile import History, Plan, Proposal

STRATEGIES = ("S1", "S2", "S3", "S4")
# Table II: how a strategy restores (T_DI, T_M) in the backward.
RESTORE = {
    "S1": ("offload", "offload"),
    "S2": ("comm", "offload"),
    "S3": ("offload", "recompute"),
    "S4": ("comm", "recompute"),
}
# Host metrics the MoE plugin measures before each step about the step before it (so the
# history holds them): its wall seconds (NaN when the Plan changed after it: the swap's stall
# is in it), its MoE partitions n and its dispatch rows B per expert-parallel shard.
STEP_SECONDS = "moe/last_step_seconds"
STEP_CHUNKS = "moe/last_step_chunks"
STEP_ROWS = "moe/last_step_rows"


def workload(strategy: str, hidden_ratio: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(Q_fw, Q_bw) of Table II: [GEMMs, all-to-alls, copies in units of T_DI] per partition.

    ``none`` runs 2 GEMMs and 2 all-to-alls forward, 4 GEMMs and 2 all-to-alls backward; an
    offloaded tensor is copied out forward and back in backward (T_M is ``hidden_ratio`` = H/M
    times T_DI: with H = 4M this is Table II's 5, 4, 1), a re-communicated T_DI adds an all-to-all
    and a recomputed T_M a GEMM to the backward.

    >>> workload("S2", 4.0)
    ((2, 2, 4.0), (4, 3, 4.0))
    """
    if strategy == "none":
        return (2, 2, 0), (4, 2, 0)
    di, m = RESTORE[strategy]
    copies = (di == "offload") + hidden_ratio * (m == "offload")
    return (2, 2, copies), (4 + (m == "recompute"), 2 + (di == "comm"), copies)


def reuse_costs(
    speeds: Speeds, rows: int, d_model: int, hidden: int, itemsize: int = 4
) -> dict[str, float]:
    """Seconds per partition of each strategy by eq. 10 (forward + backward): the slowest of
    the three streams, each stream's operations (eq. 7-9: a GEMM is 2 * b * H * M FLOPs, an
    all-to-all and a copy of T_DI b * M elements) over its speed, slowed by Table II's μ (the
    all-to-all) and η (the copies) where streams run together. ``rows``: b, a partition's
    dispatched rows."""
    v_comp = 2.0 * rows * hidden * d_model
    v_comm = v_mem = float(rows * d_model * itemsize)
    out = {}
    for s in ("none", *STRATEGIES):
        mu = speeds.mu_comp if s in ("none", "S4") else speeds.mu_all
        eta = speeds.eta_all
        total = 0.0
        for q1, q2, q3 in workload(s, hidden / d_model):
            copy = 0.0
            if q3:
                copy = q3 * v_mem / (eta * speeds.mem) if speeds.mem > 0 else math.inf
            total += max(q1 * v_comp / speeds.comp, q2 * v_comm / (mu * speeds.comm), copy)
        out[s] = total
    return out


def choose_reuse(speeds: Speeds, rows: int, d_model: int, hidden: int, itemsize: int = 4) -> str:
    """The memory reuse strategy with the lowest eq. 10 cost (§III-E); ties go to the earlier
    of `STRATEGIES`. Without host copies (``speeds.mem`` 0) only S4 is possible."""
    costs = reuse_costs(speeds, rows, d_model, hidden, itemsize)
    return min(STRATEGIES, key=lambda s: (costs[s], STRATEGIES.index(s)))


def saved_bytes(rows: int, d_model: int, hidden: int, chunks: int, itemsize: int = 4) -> float:
    """Eq. 5: the activation memory memory reuse saves for n = ``chunks`` partitions of ``rows``
    dispatched rows, B * (2M (n-2)/n + H (n-1)/n) elements; the temporary buffers save as much
    again (ΔM_buf = ΔM_act), so eq. 6's numerator is twice this."""
    n = chunks
    return rows * (2 * d_model * (n - 2) / n + hidden * (n - 1) / n) * itemsize


@dataclasses.dataclass
class GranularityTable:
    """Alg. 1's state: ``ranges`` maps n to its B-range [lo, hi] (disjoint, one per n, under the
    hypothesis that the best n grows with B), ``cache`` each B seen to its n."""

    ranges: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    cache: dict[int, int] = dataclasses.field(default_factory=dict)

    def lookup(self, rows: int) -> int | None:
        """Lines 3-6: the cached n of B, else the n whose range holds B, else None (search)."""
        if rows in self.cache:
            return self.cache[rows]
        for n, (lo, hi) in self.ranges.items():
            if lo <= rows <= hi:
                self.cache[rows] = n
                return n
        return None

    def record(self, rows: int, n: int) -> bool:
        """Lines 9-17 after a search found n best at B: a new range [B, B], or n's range grown
        to cover B. A growth that would swallow another n's range contradicts the monotonicity
        hypothesis: the ranges stay disjoint, B is only cached, and False says so."""
        self.cache[rows] = n
        lo, hi = self.ranges.get(n, (rows, rows))
        lo, hi = min(lo, rows), max(hi, rows)
        if any(m != n and lo <= b <= hi for m, r in self.ranges.items() for b in r):
            return False
        self.ranges[n] = (lo, hi)
        return True


def chunks_of(plan: Plan) -> tuple[int, ...]:
    """The MoE layers' partitions in ``plan`` (the MoE plugin's part; () before it has one)."""
    return tuple(plan.part("moe").get("chunks", ()))


class AdaptiveGranularity:
    """Alg. 1 as a Controller policy: picks the MoE layers' partitions n for the dispatch rows B
    the newest step ran with (`STEP_ROWS`; B moves when capacities change).

    At a B no range holds, it tries each of ``candidates`` in turn (a Plan change each), times
    ``trials`` steps of each after ``warmup`` steps (`STEP_SECONDS`, medians), records the
    fastest in its `GranularityTable` and proposes it; at a B inside a recorded range it proposes
    that range's n at once. Records: ``moe_granularity`` for each decision (the timed seconds of
    every n, the n chosen, its predicted seconds, the memory reuse strategy and eq. 5's predicted
    saving) and ``moe_granularity_check`` once the chosen n has run ``trials`` steps at a B (the
    measured seconds against the prediction). The table is the policy's record of its own
    decisions (`Policy`); the timings are read from the history each round.
    """

    name = "granularity"

    def __init__(
        self,
        candidates: Sequence[int],
        *,
        trials: int = 3,
        warmup: int = 1,
        d_model: int = 0,
        hidden: int = 0,
    ) -> None:
        if not candidates or min(candidates) < 1 or trials < 1 or warmup < 0:
            raise ValueError(
                f"need candidates >= 1, trials >= 1, warmup >= 0; got {candidates}, {trials}, "
                f"{warmup}"
            )
        self.candidates = tuple(sorted(set(candidates)))
        self.trials, self.warmup = trials, warmup
        self.d_model, self.hidden = d_model, hidden
        self.table = GranularityTable()
        self.predicted: dict[int, float] = {}  # B -> the chosen n's timed (or scaled) seconds
        self.checked: set[tuple[int, int]] = set()

    def samples(self, history: History, rows: int) -> dict[int, list[float]]:
        """Step seconds at B = ``rows`` per n, without each run's first ``warmup`` steps."""
        out: dict[int, list[float]] = {}
        run, key = 0, None
        for _, m in history.window(len(history), STEP_SECONDS):
            this = (int(m[STEP_ROWS]), int(m[STEP_CHUNKS]))
            run = run + 1 if this == key else 1
            key = this
            seconds = float(m[STEP_SECONDS])
            if this[0] == rows and run > self.warmup and np.isfinite(seconds):
                out.setdefault(this[1], []).append(seconds)
        return out

    def propose(self, history: History, plan: Plan) -> Proposal | None:
        entries = history.window(1, STEP_SECONDS)
        current = chunks_of(plan)
        if not entries or not current:
            return None
        rows = int(entries[-1][1][STEP_ROWS])
        samples = self.samples(history, rows)
        best = self.table.lookup(rows)
        if best is None:
            untried = [n for n in self.candidates if len(samples.get(n, ())) < self.trials]
            if untried:
                if current[0] in untried:
                    return None  # still timing the current n
                return Proposal(
                    _with_chunks(plan, untried[0]),
                    f"granularity search at B={rows}: time n={untried[0]}",
                )
            return self._decide(rows, samples, plan)
        return self._follow(rows, best, samples, plan)

    def _decide(self, rows: int, samples: dict[int, list[float]], plan: Plan) -> Proposal:
        timed = {n: float(np.median(samples[n][: self.trials])) for n in self.candidates}
        best = min(timed, key=lambda n: (timed[n], n))
        monotonic = self.table.record(rows, best)
        self.predicted[rows] = timed[best]
        record = {
            "event": "moe_granularity",
            "rows": rows,
            "chunks": best,
            "timed_seconds": {str(n): t for n, t in timed.items()},
            "predicted_seconds": timed[best],
            "ranges": {str(n): list(r) for n, r in sorted(self.table.ranges.items())},
            "monotonic": monotonic,
            **self._memory(rows, best, plan),
        }
        return Proposal(_with_chunks(plan, best), f"B={rows}: n={best}", (record,))

    def _follow(
        self, rows: int, best: int, samples: dict[int, list[float]], plan: Plan
    ) -> Proposal | None:
        """A B the table knows: propose its n; once that n ran ``trials`` steps at B, report
        the measured seconds against the prediction."""
        if rows not in self.predicted:  # inside a range: scale the nearest timed B's seconds
            near = min(self.predicted, key=lambda b: abs(b - rows), default=None)
            self.predicted[rows] = math.nan if near is None else self.predicted[near] * rows / near
        if chunks_of(plan)[0] != best:
            record = {
                "event": "moe_granularity",
                "rows": rows,
                "chunks": best,
                "predicted_seconds": self.predicted[rows],
                "from_range": True,
                **self._memory(rows, best, plan),
            }
            return Proposal(_with_chunks(plan, best), f"B={rows} in n={best}'s range", (record,))
        measured = samples.get(best, [])
        if len(measured) < self.trials or (rows, best) in self.checked:
            return None
        self.checked.add((rows, best))
        record = {
            "event": "moe_granularity_check",
            "rows": rows,
            "chunks": best,
            "predicted_seconds": self.predicted[rows],
            "measured_seconds": float(np.median(measured[-self.trials :])),
        }
        return Proposal(plan, "", (record,))

    def _memory(self, rows: int, chunks: int, plan: Plan) -> dict[str, Any]:
        reuse = plan.part("moe").get("memory_reuse", "none")
        saving = 0.0
        if reuse != "none" and chunks > 1 and self.d_model:
            saving = 2 * saved_bytes(rows, self.d_model, self.hidden, chunks)  # eq. 6's numerator
        return {"memory_reuse": reuse, "predicted_saved_bytes_per_layer": saving}


def _with_chunks(plan: Plan, n: int) -> Plan:
    return plan.with_part("moe", chunks=(n,) * len(chunks_of(plan)))
