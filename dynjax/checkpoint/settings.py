"""The run config's ``checkpoint`` section as a frozen record, here beside the strategies that
use it: the one core section handed whole below the edge (a scheme declaring row-stacked leaves
reads its K and selection, `dynjax.dynamism.base.Plugin.checkpoint_rows`), so it must be
nameable without importing the edge. Each key's one default and meaning is
`dynjax.config.default_config`'s; `dynjax.settings.read_run` reads the section into it."""

from __future__ import annotations

import dataclasses
from typing import Literal

from dynjax.checkpoint.rows import CONTENTS


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    """``checkpoint``: saving, partial expert checkpoints and two-level checkpoints."""

    async_save: bool
    experts_per_save: int
    pec_content: Literal[tuple(CONTENTS)]
    pec_selection: str  # its choices are the row policy's (checked in `dynjax.config`)
    plt_limit: float
    dynamic_k: bool
    snapshot_every: int
    snapshot_experts: int
    persist_every: int
    persist_experts: int
    inject_fault_at: int
