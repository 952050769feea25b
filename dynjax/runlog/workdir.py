"""Reading a run's workdir into a `Run`: the records of its JSON-lines files and its config, of
every process of a multi-process run, on a finished run or a live one (a torn last line is
skipped)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynjax.writers import read_jsonl


class ReportError(Exception):
    """A workdir the report cannot read; the message says what is wrong."""


@dataclass
class Run:
    """What one process of a run wrote. ``processes`` holds the runs of ``process_<i>/`` (the
    other processes of a multi-process run), keyed by process index."""

    workdir: Path
    config: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    layer_costs: list[dict[str, Any]] = field(default_factory=list)
    processes: dict[int, Run] = field(default_factory=dict)

    def events_of(self, *kinds: str) -> list[dict[str, Any]]:
        """The events of these kinds, in file order."""
        return [e for e in self.events if e.get("event") in kinds]

    def config_value(self, dotted: str, default: Any = None) -> Any:
        """``config.json``'s value at ``"section.key"``, or ``default`` when absent."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node


def _records(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file; none if it does not exist (yet)."""
    if not path.is_file():
        return []
    return [r for r in read_jsonl(path) if isinstance(r, dict)]


def _config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _process_dirs(workdir: Path) -> dict[int, Path]:
    out = {}
    for p in workdir.glob("process_*"):
        suffix = p.name[len("process_") :]
        if p.is_dir() and suffix.isdigit():
            out[int(suffix)] = p
    return dict(sorted(out.items()))


def load_run(workdir: str | Path) -> Run:
    """Read a run's workdir (finished or live). Raises `ReportError` when ``workdir`` does not
    exist or holds no ``metrics.jsonl``."""
    workdir = Path(workdir)
    if not workdir.exists():
        raise ReportError(f"workdir {workdir} does not exist")
    if not workdir.is_dir():
        raise ReportError(f"workdir {workdir} is not a directory")
    if not (workdir / "metrics.jsonl").is_file():
        raise ReportError(
            f"no metrics.jsonl in {workdir}: not a dynjax run directory, or its run has not "
            "started yet (python -m dynjax.train --workdir DIR writes it)"
        )
    run = _read(workdir)
    run.processes = {i: _read(p) for i, p in _process_dirs(workdir).items()}
    return run


def _read(workdir: Path) -> Run:
    return Run(
        workdir=workdir,
        config=_config(workdir / "config.json"),
        metrics=_records(workdir / "metrics.jsonl"),
        events=_records(workdir / "events.jsonl"),
        layer_costs=_records(workdir / "layer_costs.jsonl"),
    )
