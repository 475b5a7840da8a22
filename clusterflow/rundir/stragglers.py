"""Ranks named stragglers: ``RUN_DIR/stragglers.jsonl``, one line per naming.

Rank 0's heartbeat thread appends a line when a rank has been slower than
``observe.straggler_ratio`` x the others' median for ``observe.straggler_window_s``
(``observe/stragglers.py``): ``{"attempt", "rank", "node", "ratio", "busy_s", "median_s",
"since", "time"}``. ``status --ranks``, the goodput ledger and a restart that leaves slow nodes
out (``cluster.exclude_stragglers``) read it here."""

from __future__ import annotations

from typing import Any

from clusterflow.rundir import records
from clusterflow.rundir.paths import RunPaths

STRAGGLER = records.Schema(
    {
        "attempt": records.INT,
        "rank": records.INT,
        "node": records.TEXT,
        "ratio": records.NUMBER,
        "busy_s": records.NUMBER,
        "median_s": records.NUMBER,
        "since": records.TIME,
        "time": records.TIME,
    },
    required=("rank", "node"),
)


def record(paths: RunPaths, **fields: object) -> None:
    records.append_jsonl(paths.stragglers, fields)


def read(paths: RunPaths, attempt: int | None = None) -> list[dict[str, Any]]:
    """Every naming (of ``attempt`` only, when given), oldest first."""
    found = records.read_jsonl(paths.stragglers, STRAGGLER)
    return [r for r in found if attempt is None or r.get("attempt") == attempt]


def straggler_nodes(run_paths: RunPaths, attempt: int | None = None) -> list[str]:
    """The nodes of the ranks named stragglers (in ``attempt`` only, when given), sorted."""
    return sorted({str(r["node"]) for r in read(run_paths, attempt)})
