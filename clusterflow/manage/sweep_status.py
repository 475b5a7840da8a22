"""``status SWEEP_DIR``: one row per member (its varying values, secrets masked, state,
progress, last loss, last mining NMI/ARI, job id, run dir), as a JSON list or a text table.

:func:`collect` takes the single-run collector as an argument (``status.collect``), so status
can call it without an import cycle:

    if sweep_index.is_sweep_dir(paths):
        rows = sweep_status.collect(paths, collect)
        keys = sweep_status.keys_of(paths)
        print(json.dumps(rows, indent=1) if args.json else sweep_status.render(rows, keys))
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from clusterflow import rundir
from clusterflow.errors import UserError
from clusterflow.rundir.states import State
from clusterflow.sweeps import index as sweep_index
from clusterflow.sweeps.sweep import labels, show, shown_value


def row(
    member: dict[str, Any], run_dir: str, status: dict[str, Any] | None, job_id: str | None
) -> dict[str, Any]:
    """One member's row, its values with their secrets masked (``sweep.shown_value``). ``status``
    is what status.collect returned for its run dir (None when the run dir has no run yet);
    ``job_id`` is the index's, used until an attempt records its own."""
    s = status or {}
    mining = (s.get("mining") or [{}])[-1]
    return {
        **{k: shown_value(k, v) for k, v in member["values"].items()},
        "member": member["name"],
        "state": s.get("state") or (State.PENDING if job_id else "not submitted"),
        "epoch": s.get("epoch"),
        "current_epoch": s.get("current_epoch"),
        "global_step": s.get("global_step"),
        "last_loss": s.get("last_loss"),
        "nmi": mining.get("nmi"),
        "ari": mining.get("ari"),
        "job_id": s.get("job_id") or job_id,
        "run_dir": run_dir,
        "error": s.get("error"),
    }


def rows(
    dirs: dict[str, rundir.RunPaths],
    index: dict[str, Any],
    statuses: dict[str, dict[str, Any] | None],
) -> list[dict[str, Any]]:
    """Rows in sweep order; ``dirs`` and ``statuses`` map member names to their run dirs and
    status dicts (or None)."""
    return [
        row(
            m,
            dirs[m["name"]].root,
            statuses.get(m["name"]),
            sweep_index.member_job_id(index, m["name"]),
        )
        for m in index["members"]
    ]


def collect(
    paths: rundir.RunPaths, collect_run: Callable[[rundir.RunPaths], dict[str, Any]]
) -> list[dict[str, Any]]:
    """Read the index and every member's status (a member that cannot be read gets state
    unknown)."""
    index = sweep_index.read_index(paths) if sweep_index.is_sweep_dir(paths) else None
    if index is None:
        raise UserError(f"{paths.root!r} has no sweep.json, so it is not a sweep dir")
    dirs = sweep_index.member_dirs(paths, index)
    statuses: dict[str, dict[str, Any] | None] = {}
    for name, member in dirs.items():
        if not os.path.exists(member.config):
            statuses[name] = None
            continue
        try:
            statuses[name] = collect_run(member)
        except UserError as exc:
            statuses[name] = {"state": "unknown", "error": str(exc)}
    return rows(dirs, index, statuses)


def keys_of(paths: rundir.RunPaths) -> list[str]:
    index = sweep_index.read_index(paths)
    return list(index["keys"]) if index else []


def _cell(value: object, digits: int | None = None) -> str:
    if value is None:
        return "-"
    if digits is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.{digits}f}"
    return show(value)


def render(table: list[dict[str, Any]], keys: list[str]) -> str:
    """A fixed-width text table: the varying values first, then state, progress and quality."""
    short = labels(keys)
    columns = [(short[k], lambda r, k=k: _cell(r.get(k))) for k in keys] + [
        ("state", lambda r: r["state"]),
        ("epoch", lambda r: _cell(r["current_epoch"])),
        ("step", lambda r: _cell(r["global_step"])),
        ("loss", lambda r: _cell(r["last_loss"], 4)),
        ("nmi", lambda r: _cell(r["nmi"], 3)),
        ("ari", lambda r: _cell(r["ari"], 3)),
        ("job", lambda r: _cell(r["job_id"])),
        ("run dir", lambda r: r["member"]),
    ]
    cells = [[title for title, _ in columns]] + [[get(r) for _, get in columns] for r in table]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells]
    done = sum(1 for r in table if r["state"] == State.COMPLETED)
    lines.append(f"{len(table)} member(s), {done} completed")
    return "\n".join(lines)
