"""``RUN_DIR/trackers.json``: what each tracker needs to reopen its run (its id), where the
tracker cannot be asked, the last step it holds of each tag, and ``received_step``: the last step
it is known to have received (set at its first delivery and when an attempt ends; ``status``
warns about a tracker that never received one)."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from clusterflow.rundir import records
from clusterflow.rundir.paths import RunPaths
from clusterflow.storage import confined, durable

log = logging.getLogger("clusterflow.trackers")


class StateFile:
    """``RUN_DIR/trackers.json``: a mapping per tracker, written whole and atomically."""

    def __init__(self, paths: RunPaths) -> None:
        self.path = paths.trackers
        self._lock = threading.Lock()
        try:
            data = json.loads(confined.read_bytes(self.path, limit=records.MAX_RECORD_BYTES))
            self.data: dict[str, Any] = data if isinstance(data, dict) else {}
        except FileNotFoundError:
            self.data = {}
        except (OSError, ValueError, RecursionError) as exc:
            log.warning("%s unreadable (%s): the trackers start new runs", self.path, exc)
            self.data = {}

    def section(self, name: str) -> dict[str, Any]:
        return self.data.setdefault(name, {})

    def record(self, name: str, fsync: bool = True, **fields: object) -> None:
        """Update tracker ``name``'s section and write the file (pumps run on their own threads)."""
        with self._lock:
            self.data.setdefault(name, {}).update(fields)
            durable.write_atomic(self.path, json.dumps(self.data, sort_keys=True), fsync=fsync)

    def save(self, fsync: bool = True) -> None:
        with self._lock:
            durable.write_atomic(self.path, json.dumps(self.data, sort_keys=True), fsync=fsync)


def received_steps(paths: RunPaths, names: list[str]) -> dict[str, int | None]:
    """The last step each named tracker is known to have received (None: none so far), for
    ``status``; an unreadable file reads as nothing received."""
    data = records.read_json(paths.trackers, {})
    data = data if isinstance(data, dict) else {}
    out: dict[str, int | None] = {}
    for name in names:
        step = (
            (data.get(name) or {}).get("received_step")
            if isinstance(data.get(name), dict)
            else None
        )
        out[name] = step if isinstance(step, int) and not isinstance(step, bool) else None
    return out
