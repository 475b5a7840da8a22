"""The first cause of a failed attempt, recorded once: a peer's later error cannot overwrite it.

When rank 1 hangs and the watchdog ends it, rank 0's next collective fails too (connection reset,
gloo/NCCL timeout) and would otherwise be what `status` shows. Whoever records first wins:

    RUN_DIR/errors/first.attempt<A>.json
        {"rank", "host", "error", "kind", "time", "attempt", ...}

The record is published once (``storage.durable.publish_once``: complete, then linked into
place, so a reader never sees half of it and a second writer learns it lost). One file per
attempt, so a requeued attempt records its own first cause.
The keys match errors/rank<R>.json (rank, host, error, time), which `status` already lists.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from clusterflow.rundir import records as rundir
from clusterflow.rundir.paths import RunPaths
from clusterflow.rundir.states import Cause
from clusterflow.storage import durable


def record(
    paths: RunPaths,
    attempt: int,
    rank: int,
    error: str,
    *,
    host: str | None = None,
    kind: Cause = Cause.ERROR,
    **extra: object,
) -> bool:
    """Record ``error`` as this attempt's first cause. True when it won, False when a cause was
    already there."""
    target = paths.first_error_file(attempt)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.exists(target):
        return False  # the common loser's path: skip writing a temp file
    rec = {
        "rank": rank,
        "host": host or socket.gethostname(),
        "error": error,
        "kind": kind,
        "time": time.time(),
        "attempt": attempt,
        "pid": os.getpid(),
        **extra,
    }
    return durable.publish_once(target, json.dumps(rec, indent=1))


def read(paths: RunPaths, attempt: int, damaged: list[str] | None = None) -> dict[str, Any] | None:
    """This attempt's first cause, or None; a record that does not fit its schema is named in
    ``damaged`` (when given), and one without a rank or an error is ignored."""
    rec, said = rundir.read_checked(
        paths.first_error_file(attempt),
        rundir.FIRST_ERROR,
        f"errors/first.attempt{attempt}.json",
        within=paths.root,
    )
    if damaged is not None:
        damaged += said
    return rec


def headline(rec: dict[str, Any]) -> str:
    """What `status` shows as ``error``: the message already names rank and host for a stall;
    other errors get them in front, the way `status` shows every rank's error."""
    if rec.get("kind") == Cause.STALL:
        return str(rec["error"])
    return f"rank {rec.get('rank')} on {rec.get('host')}: {rec.get('error')}"


def worded(recorded: str | None, rec: dict[str, Any] | None) -> str | None:
    """The failure's first cause as status.json words it ("rank R: ..."), or, when status.json
    lost it (two ranks' read-modify-writes of it at once), as the first-error record has it."""
    if recorded:
        return str(recorded)
    return f"rank {rec.get('rank')}: {rec.get('error')}" if rec else None


def cause(paths: RunPaths, status: dict[str, Any], attempt: int) -> str | None:
    """:func:`worded` for status.json's record and this attempt's first-error record."""
    return worded(status.get("error"), read(paths, attempt))
