"""MoE's checkpoint rows: partial expert checkpoints (MoC-System, seed 004 §3, §5.3).

What MoE declares to the generic checkpoint machinery (`dynjax.checkpoint.rows`) through
`MoEPlugin.checkpoint_rows`: its stacked expert weights are row-stacked leaves
(`EXPERT_STACKS`: one stack per MoE layer, one row per expert, by `dynjax.parallel`'s rule
`is_expert_param`), and `ExpertRows` gives the policy choosing each save's experts: the token
ledger, the proportion of lost tokens (PLT, eq. 7) and dynamic K (`ExpertLedger`).

A partial save writes every non-expert leaf and K of the E experts of each MoE layer (the
storage is `Checkpointer.save(..., rows=...)`). An expert not in the newest save restores
from the newest save that has it, so the updates it received since are lost; MoC-System counts
them in tokens: PLT = sum over faults and MoE layers of the tokens routed to an expert between
the copy it restored from and the restored step, over the tokens processed by all experts of
all MoE layers (eq. 7; the paper's denominator is ``L * I * k``: with the routed pairs that
``moe/tokens_per_expert`` counts, before capacity drops, the sum over experts of a layer is
exactly ``I * k``, so the measured denominator is the paper's).

Host-side and pure (STYLE habit 1): no JAX, no I/O. `ExpertLedger` takes the routed pairs per
(MoE layer, expert) of every step (`count`), proposes each save's experts (`select`), is told
which save succeeded (`saved`), and at a recovery turns the storage's ``expert_sources`` into
lost steps and tokens (`recover`). It travels in the checkpoint's metadata (`to_meta` /
`from_meta`), so it describes the trajectory of the state it is saved with: a fault that
restores a step again, before any newer save, counts that step's losses once, as the model
suffered them once.

Selection (seed 004 §3.2, Fig. 5):

- ``sequential``: the experts of a layer are visited in a rank-interleaved order (rank 0's
  first expert, rank 1's first, ..., rank 0's second, ...; ``mesh.expert`` ranks hold
  contiguous blocks of E/R experts) and each save takes a layer's next K; layer i starts i*K
  positions further. The K*L positions one save takes over all layers are then consecutive in
  that order, so every expert-parallel rank writes floor or ceil(K*L/R) experts (equal bytes up
  to one expert), and each expert is saved once every ceil(E/K) saves. In Fig. 5 (E=R=3, K=1,
  MoE layers 1, 3, 5, 7) the first save writes experts 1-0, 3-1, 5-2, 7-0, as here.
- ``load_aware``: per layer, the K experts with the most tokens routed since their newest copy
  (ties: the stalest first). The paper finds it as accurate as sequential at a higher control
  cost, and it does not balance the ranks.

The first save of a run writes every expert: a partial restore needs a copy of each.

Dynamic K (§5.3): after each recovery, if the accumulated PLT exceeds ``plt_limit`` (3.75%, the
level below which Fig. 7's validation loss matched the fault-free run), K doubles for the later
saves, up to E.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from dynjax.checkpoint.rows import RowStacks
from dynjax.checkpoint.settings import CheckpointSettings
from dynjax.parallel import is_expert_param

log = logging.getLogger(__name__)
SELECTIONS = ("sequential", "load_aware")
TOKENS = "moe/tokens_per_expert"  # [MoE layers, E] routed pairs of a step, before drops
PLT = "checkpoint/plt"  # eq. 7 so far: lost over processed routed tokens (metrics.jsonl)
_NONE = -1  # no copy of this expert in a history row


def expert_layer(key: str) -> int | None:
    """Model layer of a stacked expert leaf's key (the index after ``layers``), else None."""
    names = key.split("/")
    if not (len(names) >= 2 and is_expert_param(tuple(jax.tree_util.DictKey(n) for n in names))):
        return None
    return int(names[names.index("layers") + 1])


EXPERT_STACKS = RowStacks(expert_layer)  # MoE's row-stacked leaves: a stack per MoE layer


@dataclasses.dataclass(frozen=True)
class Recovery:
    """What one fault cost, per MoE layer (model index) and expert, and the PLT after it."""

    step: int  # the restored step
    sources: dict[int, list[int]]  # layer -> [E] the step each expert's copy was saved at
    lost_steps: dict[int, list[int]]  # layer -> [E] steps of updates lost
    lost_tokens: dict[int, list[int]]  # layer -> [E] routed pairs whose updates were lost
    tokens: int  # routed pairs over all MoE layers through ``step``: eq. 7's L * I * k
    plt: float  # this fault's lost tokens / ``tokens``
    total_plt: float  # every fault on this trajectory, over ``tokens`` (eq. 7)
    experts_per_save: int  # K for the later saves (doubled by dynamic K)

    def event(self) -> dict[str, Any]:
        """The ``checkpoint_recovery`` event of events.jsonl."""
        return {
            "event": "checkpoint_recovery",
            "step": self.step,
            "layers": {
                str(layer): {
                    "sources": self.sources[layer],
                    "lost_steps": self.lost_steps[layer],
                    "lost_tokens": self.lost_tokens[layer],
                }
                for layer in self.lost_steps
            },
            "lost_tokens": int(sum(sum(v) for v in self.lost_tokens.values())),
            "tokens": self.tokens,
            "plt": self.plt,
            "total_plt": self.total_plt,
            "experts_per_save": self.experts_per_save,
        }

    def describe(self) -> str:
        lost = int(sum(sum(v) for v in self.lost_tokens.values()))
        return (
            f"step {self.step} lost {lost} of {self.tokens} routed tokens (PLT {self.plt:.4f}, "
            f"total {self.total_plt:.4f})"
        )


class ExpertLedger:
    """Tokens routed to each (MoE layer, expert), where each expert's copies are, and the faults.

    ``layers``: the model indices of the MoE layers (the ``layers/<i>/moe`` keys), ``ranks``:
    expert-parallel ranks (``mesh.expert``), ``k``: experts per layer per save (1 <= k <= E).
    """

    def __init__(
        self,
        layers: Sequence[int],
        num_experts: int,
        ranks: int,
        k: int,
        *,
        selection: str = "sequential",
        plt_limit: float = 0.0375,
        dynamic_k: bool = False,
        history: int = 3,
    ):
        if not layers:
            raise ValueError("partial expert checkpoints need MoE layers")
        if num_experts % ranks:
            raise ValueError(f"{ranks} expert-parallel ranks do not divide {num_experts} experts")
        if not 1 <= k <= num_experts:
            raise ValueError(f"k={k} must be in [1, {num_experts}]")
        if selection not in SELECTIONS:
            raise ValueError(f"selection {selection!r} is not one of {SELECTIONS}")
        self.layers = tuple(int(i) for i in layers)
        self.num_experts, self.ranks, self.k = num_experts, ranks, k
        self.selection, self.plt_limit, self.dynamic_k = selection, plt_limit, dynamic_k
        self.history = history  # newest saves whose rows are kept whatever they hold
        shape = (len(self.layers), num_experts)
        self.step = 0  # steps counted
        self.tokens = np.zeros(shape, np.int64)  # routed pairs per expert through `step`
        self.cursor = np.arange(len(self.layers), dtype=np.int64) * k  # next position per layer
        self.saved_at = np.full(shape, _NONE, np.int64)  # step of each expert's newest copy
        # Per save step: [2, L, E] the tokens and the step the state of each expert at that
        # save reflects (the storage may save more rows than asked: every entry is kept).
        # A recovery shifts them (`recover`); _NONE: a state the trajectory no longer has.
        self.rows: dict[int, np.ndarray] = {}
        self.lost_tokens = 0  # over every fault on this trajectory
        # Steps whose rows are kept whatever else holds: with two-level checkpoints the ledger
        # records in-memory copies, and a restart reads the copies in storage (these steps).
        self.pinned: set[int] = set()

    # -- counting ------------------------------------------------------------------------------

    def count(self, step: int, tokens_per_expert: Any) -> None:
        """Add the routed pairs [MoE layers, E] of training step ``step`` (1-based: the step
        that makes the state of checkpoint ``step``). Steps already counted are ignored (a
        save counts the newest steps before the Monitor hands them over)."""
        if step <= self.step:
            return
        if step != self.step + 1:
            raise ValueError(f"step {step} counted after step {self.step}: steps were skipped")
        loads = np.asarray(tokens_per_expert, np.int64)
        if loads.shape != self.tokens.shape:
            raise ValueError(f"tokens_per_expert {loads.shape}, expected {self.tokens.shape}")
        self.tokens += loads
        self.step = step

    def counted(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """`count` of step ``step``'s host metrics (its `TOKENS`); returns the running PLT
        (`rows.RowPolicy`)."""
        self.count(step, metrics[TOKENS])
        return {PLT: self.plt}

    @property
    def plt(self) -> float:
        """Eq. 7 on this trajectory so far: lost over processed routed pairs."""
        total = int(self.tokens.sum())
        return self.lost_tokens / total if total else 0.0

    # -- selection -----------------------------------------------------------------------------

    def position_expert(self, position: Any) -> Any:
        """The expert at ``position`` of the rank-interleaved order (module docstring)."""
        p = np.asarray(position) % self.num_experts
        return (p % self.ranks) * (self.num_experts // self.ranks) + p // self.ranks

    def rank_of(self, expert: Any) -> Any:
        return np.asarray(expert) // (self.num_experts // self.ranks)

    def select(self, ahead: int = 0) -> dict[int, list[int]] | None:
        """The experts the next save writes, per MoE layer; None = all (the first save, or
        K = E). Pure: `saved` records it once the save started. ``ahead``: partial saves
        taken but not yet recorded (a snapshot's step is counted a few steps late): the
        sequential window moves past them (load-aware sees the counts recorded so far)."""
        if self.k == self.num_experts or (self.saved_at == _NONE).any():
            return None
        if self.selection == "sequential":
            window = self.cursor[:, None] + ahead * self.k + np.arange(self.k)
            chosen = self.position_expert(window)
        else:
            unsaved = self.tokens - self._newest(0)
            order = np.lexsort((self.saved_at, -unsaved), axis=-1)  # most tokens, then stalest
            chosen = order[:, : self.k]
        pairs = zip(self.layers, chosen, strict=True)
        return {layer: sorted(int(e) for e in row) for layer, row in pairs}

    def meta_after(self, step: int, experts: Mapping[int, Sequence[int]] | None) -> dict[str, Any]:
        """`to_meta` as it will be once the save at ``step`` of ``experts`` is recorded: what
        that save's metadata holds (its own copies included). Changes nothing."""
        after = copy.deepcopy(self)
        after.saved(step, experts)
        return after.to_meta()

    def saved(self, step: int, experts: Mapping[int, Sequence[int]] | None) -> None:
        """Record that the save at ``step`` (== the steps counted) holds ``experts`` (None =
        all)."""
        if step != self.step:
            raise ValueError(f"save at step {step}, but {self.step} steps are counted")
        held = np.zeros(self.tokens.shape, bool)
        if experts is None:
            held[:] = True
        else:
            for i, layer in enumerate(self.layers):
                held[i, list(experts.get(layer, ()))] = True
            if self.selection == "sequential":
                self.cursor += self.k
        self.rows[step] = np.stack([self.tokens, np.full_like(self.tokens, step)])
        self.saved_at[held] = step
        self._prune()

    def _newest(self, which: int) -> np.ndarray:
        """[L, E]: what each expert's newest copy reflects (0 tokens, 1 step)."""
        out = np.zeros(self.tokens.shape, np.int64)
        for step in np.unique(self.saved_at[self.saved_at != _NONE]):
            mask = self.saved_at == step
            out[mask] = self.rows[int(step)][which][mask]
        return out

    def _prune(self) -> None:
        """Keep the rows a restore may read from: those of the steps holding an expert's newest
        copy and of the ``history`` newest saves (the checkpoints kept on disk)."""
        newest = sorted(self.rows)[-self.history :]
        needed = set(newest) | self.pinned
        needed |= {int(s) for s in np.unique(self.saved_at) if s != _NONE}
        self.rows = {s: r for s, r in self.rows.items() if s in needed}

    # -- recovery ------------------------------------------------------------------------------

    def recover(self, sources: Mapping[int, Sequence[int]]) -> Recovery:
        """Account a restore of step ``self.step`` (the ledger from that checkpoint's metadata)
        whose expert e of MoE layer ``layer`` came from step ``sources[layer][e]``.

        Each expert's lost tokens are those routed to it since the state its copy reflects.
        From now on that copy *is* its state at this step: the rows are shifted by the loss,
        so a later fault restoring the same copy loses only the tokens after this step, and
        copies newer than the source (unusable, or the restore would have taken them) are
        dropped. Then dynamic K doubles K if the accumulated PLT exceeds the limit (§5.3).
        """
        step = self.step
        src = np.array([list(sources[layer]) for layer in self.layers], np.int64)
        if src.shape != self.tokens.shape:
            raise ValueError(f"expert_sources {src.shape}, expected {self.tokens.shape}")
        self.rows = {s: r for s, r in self.rows.items() if s <= step}
        reflected = np.zeros((2, *self.tokens.shape), np.int64)
        for s in np.unique(src):
            mask = src == s
            row = self.rows.get(int(s))
            if row is None or (row[1][mask] == _NONE).any():
                # Only if the storage read a copy the ledger never heard of: count from the
                # oldest copy it knows (a lower bound), and say so.
                log.warning("expert copies of step %d are not in the ledger: PLT is a lower "
                            "bound", s)
                now = np.stack([self.tokens, np.full_like(self.tokens, step)])
                row = self.rows[min(self.rows)] if self.rows else now
                row = np.where(row == _NONE, now, row)
            reflected[:, mask] = row[:, mask]
        lost_tokens = self.tokens - reflected[0]
        lost_steps = step - reflected[1]
        for s, row in self.rows.items():
            valid = row[1] != _NONE
            newer = valid & (s > src)
            row[:, newer] = _NONE
            shift = valid & ~newer
            row[0][shift] += lost_tokens[shift]
            row[1][shift] += lost_steps[shift]
        self.saved_at = src.copy()
        fault = int(lost_tokens.sum())
        self.lost_tokens += fault
        total = int(self.tokens.sum())
        if self.dynamic_k and self.plt > self.plt_limit and self.k < self.num_experts:
            self.set_k(min(2 * self.k, self.num_experts))
        return Recovery(
            step=step,
            sources={layer: src[i].tolist() for i, layer in enumerate(self.layers)},
            lost_steps={layer: lost_steps[i].tolist() for i, layer in enumerate(self.layers)},
            lost_tokens={layer: lost_tokens[i].tolist() for i, layer in enumerate(self.layers)},
            tokens=total,
            plt=fault / total if total else 0.0,
            total_plt=self.plt,
            experts_per_save=self.k,
        )

    def set_k(self, k: int) -> None:
        """Change K for the later saves. Each layer's sequential window keeps its cursor, so
        no expert waits longer than one cycle; the windows of the layers then overlap in the
        interleaved order, and the ranks' shares may differ by two experts instead of one."""
        if not 1 <= k <= self.num_experts:
            raise ValueError(f"k={k} must be in [1, {self.num_experts}]")
        self.k = k

    # -- metadata ------------------------------------------------------------------------------

    def to_meta(self) -> dict[str, Any]:
        """JSON for the checkpoint's metadata: enough to continue the ledger after a restart."""
        return {
            "layers": list(self.layers),
            "num_experts": self.num_experts,
            "ranks": self.ranks,
            "k": self.k,
            "step": self.step,
            "tokens": self.tokens.tolist(),
            "cursor": self.cursor.tolist(),
            "saved_at": self.saved_at.tolist(),
            "rows": {str(s): r.tolist() for s, r in self.rows.items()},
            "lost_tokens": self.lost_tokens,
        }

    @classmethod
    def from_meta(
        cls,
        meta: Mapping[str, Any],
        *,
        selection: str,
        plt_limit: float,
        dynamic_k: bool,
        history: int,
        ranks: int | None = None,
    ) -> ExpertLedger:
        """The ledger saved by `to_meta`; the settings (and ``ranks``, if the run resumes on
        another ``mesh.expert``) come from the current config."""
        ledger = cls(
            meta["layers"],
            meta["num_experts"],
            ranks or meta["ranks"],
            meta["k"],
            selection=selection,
            plt_limit=plt_limit,
            dynamic_k=dynamic_k,
            history=history,
        )
        ledger.step = int(meta["step"])
        ledger.tokens = np.array(meta["tokens"], np.int64)
        ledger.cursor = np.array(meta["cursor"], np.int64)
        ledger.saved_at = np.array(meta["saved_at"], np.int64)
        ledger.rows = {int(s): np.array(r, np.int64) for s, r in meta["rows"].items()}
        ledger.lost_tokens = int(meta["lost_tokens"])
        return ledger


@dataclasses.dataclass(frozen=True)
class ExpertRows:
    """MoE's `dynjax.checkpoint.rows.PartialRows`: its expert leaves and the ledger's
    settings, unpacked from the config at the edge (`MoEPlugin.checkpoint_rows`)."""

    ids: tuple[int, ...]  # the MoE layers (model indices)
    rows: int  # E
    ranks: int  # mesh.expert
    k: int  # experts per save (K_snapshot with two-level checkpoints); 0 = no ledger
    persist_k: int  # K_persist: experts per MoE layer per persist; 0 = all the snapshot copied
    selection: str
    plt_limit: float
    dynamic_k: bool
    history: int  # train.keep_checkpoints
    stacks: RowStacks = EXPERT_STACKS

    @classmethod
    def of(
        cls,
        layers: Sequence[int],
        num_experts: int,
        ranks: int,
        checkpoint: CheckpointSettings,
        history: int,
    ) -> ExpertRows:
        """From the run's ``checkpoint`` section's record: K is ``experts_per_save``, or with
        two-level checkpoints K_snapshot (``snapshot_experts``; 0: all E)."""
        k = checkpoint.experts_per_save
        if checkpoint.snapshot_every:
            k = checkpoint.snapshot_experts or num_experts
        return cls(
            ids=tuple(layers),
            rows=num_experts,
            ranks=ranks,
            k=k,
            persist_k=checkpoint.persist_experts,
            selection=checkpoint.pec_selection,
            plt_limit=checkpoint.plt_limit,
            dynamic_k=checkpoint.dynamic_k,
            history=history,
        )

    def _options(self) -> dict[str, Any]:
        return {
            "selection": self.selection,
            "plt_limit": self.plt_limit,
            "dynamic_k": self.dynamic_k,
            "history": self.history,
        }

    def fresh(self, step: int) -> ExpertLedger:
        ledger = ExpertLedger(self.ids, self.rows, self.ranks, self.k, **self._options())
        ledger.step = step  # a full checkpoint's run: counts from it
        return ledger

    def from_meta(self, meta: Mapping[str, Any]) -> ExpertLedger:
        """The ledger of `ExpertLedger.to_meta` ``meta``, with the current config's settings."""
        return ExpertLedger.from_meta(meta, ranks=self.ranks, **self._options())
