"""``RUN_DIR/trackers.json``: what each tracker needs to reopen its run (its id) and, where the
tracker cannot be asked, the last step it holds of each tag."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from clusterflow.rundir.paths import RunPaths
from clusterflow.storage import durable

log = logging.getLogger("clusterflow.trackers")


class StateFile:
    """``RUN_DIR/trackers.json``: a mapping per tracker, written whole and atomically."""

    def __init__(self, paths: RunPaths) -> None:
        self.path = paths.trackers
        self._lock = threading.Lock()
        try:
            with open(self.path) as f:
                data = json.load(f)
            self.data: dict[str, Any] = data if isinstance(data, dict) else {}
        except FileNotFoundError:
            self.data = {}
        except (OSError, ValueError) as exc:
            log.warning("%s unreadable (%s): the trackers start new runs", self.path, exc)
            self.data = {}

    def section(self, name: str) -> dict[str, Any]:
        return self.data.setdefault(name, {})

    def save(self, fsync: bool = True) -> None:
        with self._lock:
            durable.write_atomic(self.path, json.dumps(self.data, sort_keys=True), fsync=fsync)
