"""What a run writes to its workdir: metrics.jsonl, events.jsonl and TensorBoard event files."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dynjax.recompile import EventLog


class MetricsWriter:
    """Scalar metrics to ``metrics.jsonl`` and TensorBoard (tensorboardX: no TensorFlow needed).

    ``resumed_from``: the checkpoint step a resumed run started from, written in each of its
    records: a step logged by an earlier run and trained again after a resume is in the file
    twice, and the record with the larger ``resumed_from`` (the later line) is the one that
    counts."""

    def __init__(self, workdir: Path, resumed_from: int | None = None):
        from tensorboardX import SummaryWriter

        self.lines = EventLog(workdir / "metrics.jsonl")
        self.tb = SummaryWriter(str(workdir / "tensorboard"))
        self.resumed_from = resumed_from

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **metrics}
        if self.resumed_from is not None:
            record["resumed_from"] = self.resumed_from
        self.lines(record)
        for key, value in metrics.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.tb.add_scalar(key, value, step)

    def close(self) -> None:
        self.tb.close()


class LayerCostsWriter:
    """``layer_costs.jsonl`` (docs/plugins.md): per logged or profiled step, each
    layer's modelled cost under the Plan the step ran with and the state its host metrics
    report (e.g. pruned density), and its profiled forward and backward seconds on profiled
    steps: the traces the balancers are judged on."""

    def __init__(self, workdir: Path, model_costs: Callable[[Any, dict[str, Any]], list[float]]):
        self.lines = EventLog(workdir / "layer_costs.jsonl")
        self.model_costs = model_costs  # (plan, host metrics) -> [L]

    def write(self, step: int, plan: Any, metrics: dict[str, Any]) -> None:
        record: dict[str, Any] = {"step": step, "layer_cost": self.model_costs(plan, metrics)}
        for name in ("layer_forward_seconds", "layer_backward_seconds"):
            if f"profile/{name}" in metrics:
                record[name] = [float(v) for v in metrics[f"profile/{name}"]]
        self.lines(record)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All records of a JSON-lines file (a torn last line from a killed process is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
