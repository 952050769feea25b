"""What a run writes to its workdir: metrics.jsonl, events.jsonl and TensorBoard event files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dynjax.recompile import EventLog


class MetricsWriter:
    """Scalar metrics to ``metrics.jsonl`` and TensorBoard (tensorboardX: no TensorFlow needed)."""

    def __init__(self, workdir: Path):
        from tensorboardX import SummaryWriter

        self.lines = EventLog(workdir / "metrics.jsonl")
        self.tb = SummaryWriter(str(workdir / "tensorboard"))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **metrics}
        self.lines(record)
        for key, value in metrics.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.tb.add_scalar(key, value, step)

    def close(self) -> None:
        self.tb.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All records of a JSON-lines file (a torn last line from a killed process is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
