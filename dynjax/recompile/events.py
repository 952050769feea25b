"""`events.jsonl`: one JSON object per line, appended from any thread.

The controller emits from its policy thread and from the training thread, so writes are
serialised by a lock and flushed at once (a crashed run keeps every event before the crash).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any


class EventLog:
    """A thread-safe `emit` for `Controller`: appends each event, stamped with `time`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._lock = threading.Lock()

    def __call__(self, event: dict[str, Any]) -> None:
        line = json.dumps({**event, "time": time.time()})
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")

    def read(self) -> list[dict[str, Any]]:
        """Every event written so far, oldest first."""
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]
