"""Row-stacked leaves: what a scheme declares for partial checkpoints, and the names they keep.

A leaf is *row-stacked* when its leading axis holds independent rows (stacked expert weights,
[E, ...]): a save may hold only some rows of it, and a restore assembles each row from
the newest save holding a copy (partial expert checkpoints, MoC-System, seed 004 §3, here for
any such leaves). The leaves of one *stack* (a number, e.g. the model layer) share the
rows a save picks, weights and optimizer moments alike; per stack and `row_group` the restore
records which step each row came from.

The checkpoint machinery names no scheme. A scheme with such leaves declares them, and the
policy choosing the rows of each save, through its plugin's ``checkpoint_rows`` hook
(`dynjax.dynamism.base.Plugin`): a `RowStacks` (which leaves, `Checkpointer`'s) and a
`PartialRows` (the stacks, K, and the `RowPolicy` of a run: the rotation, the accounting of
lost updates, its metadata).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

# Saved checkpoints, events.jsonl and the tools reading them use these names, chosen when
# partial saves were written for one scheme's experts alone (issue 13, layout 2 of issue 15):
# renaming them would orphan saved checkpoints and the workdirs' readers, so they stay, here
# only.
ROWS_ITEM = "experts"  # the Orbax item of the row-stacked leaves (`layout`)
ROWS_META = "expert_rows"  # meta: per leaf, the rows its array holds ({"of": n, "rows": [...]})
V1_ROW_ITEM = r"^expert_l(\d+)_e(\d+)$"  # layout 1: one item per (stack, row)
V1_ROW_NAME = "expert_l{stack}_e{row}"
POLICY_META = "pec"  # meta: the row policy's own metadata (`RowPolicy.to_meta`)
SOURCES = "expert_sources"  # restored meta: {stack: {group: [step per row]}}
SAVED_EVENT = "experts_saved"  # the ``checkpoint`` event's field: {stack: rows saved}
COPIED_EVENT = "experts"  # the ``snapshot`` event's field: {stack: rows copied} (None: all)
FALLBACK_EVENT = "checkpoint_expert_fallback"  # a row's copy unusable: the one before it
ROW, STACK = "expert", "layer"  # how events and errors name a row and its stack

WEIGHTS, OPTIMIZER = "weights", "optimizer"
# Seed 004 §3's PEC_W, PEC_O and PEC_WO: the row groups a partial save cuts to K rows.
CONTENTS: dict[str, frozenset[str]] = {
    "W": frozenset({WEIGHTS}),
    "O": frozenset({OPTIMIZER}),
    "WO": frozenset({WEIGHTS, OPTIMIZER}),
}

Rows = Mapping[int, Sequence[int]]  # stack -> the rows a save holds


def row_group(key: str) -> str:
    """`WEIGHTS` for a row-stacked leaf of the parameters or of the pruning keep masks (a mask
    says which weights exist, so it is saved with them), else `OPTIMIZER` (Adam moments)."""
    names = key.split("/")
    return WEIGHTS if names[0] == "params" or "masks" in names else OPTIMIZER


@dataclasses.dataclass(frozen=True)
class RowStacks:
    """Which leaves of the state are row-stacked: ``stack_of(key)`` (a leaf's ``"/"``-joined
    path, ``params/layers/1/attn/qkv/kernel``) is the number of the stack it belongs to, None for
    every other leaf."""

    stack_of: Callable[[str], int | None]

    def stacked(self, key: str) -> bool:
        return self.stack_of(key) is not None


NO_ROWS = RowStacks(lambda key: None)  # a state without row-stacked leaves: saved whole


class Recovered(Protocol):
    """What a restore of older rows cost, as a `RowPolicy` accounts it."""

    def event(self) -> dict[str, Any]:
        """The ``checkpoint_recovery`` event of events.jsonl."""
        ...

    def describe(self) -> str:
        """One log line."""
        ...


class RowPolicy(Protocol):
    """A run's choice of the rows each save holds and its accounting of what restores of older
    rows lost (seed 004 §3-§5.3); host-side and pure. It travels in every checkpoint's
    metadata (`to_meta`, under `POLICY_META`), so it follows the state's trajectory."""

    pinned: set[int]  # save steps whose records are kept whatever else holds (the storage's)

    def counted(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Count training step ``step`` from its host metrics; returns metrics of its own."""
        ...

    def select(self, ahead: int = 0) -> dict[int, list[int]] | None:
        """The rows the next save holds per stack (None: all); ``ahead``: partial saves taken
        whose steps are not counted yet."""
        ...

    def saved(self, step: int, rows: Rows | None) -> None:
        """The save at ``step`` (the steps counted) holds ``rows`` (None: all)."""
        ...

    def meta_after(self, step: int, rows: Rows | None) -> dict[str, Any]:
        """`to_meta` once the save at ``step`` of ``rows`` is recorded; changes nothing."""
        ...

    def to_meta(self) -> dict[str, Any]: ...

    def recover(self, sources: Mapping[int, Sequence[int]]) -> Recovered:
        """Account a restore of the counted step whose row r of stack s came from
        ``sources[s][r]``."""
        ...

    def set_k(self, k: int) -> None:
        """Rows per stack for the later saves."""
        ...


class PartialRows(Protocol):
    """A scheme's row-stacked leaves as the checkpoint strategies see them
    (`dynjax.dynamism.base.Plugin.checkpoint_rows`)."""

    stacks: RowStacks
    ids: tuple[int, ...]  # the stacks' numbers
    rows: int  # rows per stack
    k: int  # rows per stack per save (two-level: per snapshot); 0: every save whole
    persist_k: int  # two-level: rows per stack per persist; 0: all its snapshot copied

    def fresh(self, step: int) -> RowPolicy:
        """The policy of a run starting at ``step`` (a whole checkpoint's, or none)."""
        ...

    def from_meta(self, meta: Mapping[str, Any]) -> RowPolicy:
        """The policy saved by `RowPolicy.to_meta`, with this run's settings."""
        ...


def row_sources(meta: Mapping[str, Any], partial: PartialRows) -> dict[int, list[int]]:
    """Per stack, the step each row's restored state comes from: the older of its weights' and
    its optimizer state's (`SOURCES`, filled by the restore), so that with content ``"O"`` the
    updates whose moments were lost count too; the restored step for rows read whole."""
    sources = meta.get(SOURCES) or {}
    out = {stack: [meta["step"]] * partial.rows for stack in partial.ids}
    for stack, groups in sources.items():
        out[int(stack)] = [min(steps) for steps in zip(*groups.values(), strict=True)]
    return out
