"""What `status` adds per rank, and why Slurm ended a job: the reading side of heartbeats,
the stall watchdog and ``slurm/outcome.py``.

- ``ranks``: every rank's latest heartbeat of the last attempt (``observe.heartbeat.read_ranks``),
  with ages and the marks ``silent`` and ``straggler``; ``ranks_summary`` names the odd ones in
  one line; ``stragglers``: the ranks named slow in the attempt (``rundir/stragglers.py``).
- ``slurm``: once a failed or unfinished Slurm job has left the queue, sacct's verdict
  (OUT_OF_MEMORY, NODE_FAIL, TIMEOUT, CANCELLED, PREEMPTED, ...) or scontrol's, saying sacct was
  unavailable (``slurm.outcome.ask``, with timeouts).
"""

from __future__ import annotations

from typing import Any

from clusterflow import rundir
from clusterflow.config.sections import DistConfig, ObserveConfig
from clusterflow.observe import heartbeat
from clusterflow.rundir import states, stragglers
from clusterflow.slurm import outcome as slurm_outcome


def _setting(data: dict[str, Any], section: str, key: str, default: float) -> float:
    """A number of config.yaml read as plain YAML (a damaged file must not stop status): the
    default where it is missing, not a number, or negative."""
    try:
        value = float(data[section].get(key, default))
    except (ValueError, TypeError, KeyError, AttributeError):
        return default
    return value if value >= 0 else default


def ranks(
    paths: rundir.RunPaths,
    data: dict[str, Any],
    last: dict[str, Any],
    world_size: object,
    damaged: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Every rank of the last attempt, from its heartbeat (none when heartbeats are off or no
    attempt began), marked a straggler above ``observe.straggler_ratio``; ``data``: config.yaml
    read as plain YAML (``saved_config.read_plain``); damaged heartbeats are named in
    ``damaged``."""
    every_s = _setting(data, "dist", "heartbeat_s", DistConfig.heartbeat_s)
    ratio = _setting(data, "observe", "straggler_ratio", ObserveConfig.straggler_ratio)
    if not last or not every_s:
        return []  # heartbeats off: no rank is silent for want of one
    world = int(world_size) if isinstance(world_size, int) and world_size > 0 else None
    # Nodes' clocks differ by seconds; an older attempt by minutes.
    since = float(last.get("started_at") or 0) - 60
    return heartbeat.read_ranks(
        paths, every_s, since=since, world_size=world, damaged=damaged, straggler_ratio=ratio
    )


def extend(
    out: dict[str, Any],
    paths: rundir.RunPaths,
    data: dict[str, Any],
    last: dict[str, Any],
    queue: str | None,
    *,
    damaged: list[str] | None = None,
    asked: slurm_outcome.Verdict | None = None,
) -> None:
    """Add ``ranks``, ``ranks_summary`` and ``slurm`` to a status object (damaged heartbeats to
    ``damaged``); ``data``: config.yaml read as plain YAML; ``asked``: Slurm's verdict when the
    status verdict already asked for it."""
    rs = ranks(paths, data, last, out.get("world_size"), damaged)
    if states.ended(out["state"]):
        for r in rs:
            # A finished run's ranks are quiet by design; the ages still say when they stopped.
            r["silent"] = False
    out["ranks"] = rs
    # The ranks rank 0 named slow for observe.straggler_window_s in this attempt.
    attempt = last.get("attempt")
    out["stragglers"] = stragglers.read(paths, attempt) if isinstance(attempt, int) else []
    out["ranks_summary"] = heartbeat.summary(rs) if out["state"] == states.RUNNING else None
    job_id = str(out.get("job_id") or "")
    left_queue = queue == "" and job_id.replace("_", "").isdigit()
    if asked is None and left_queue and out["state"] != states.COMPLETED:
        asked = slurm_outcome.ask(job_id)
    out["slurm"] = asked.to_dict() if asked is not None else None


def render(out: dict[str, Any]) -> list[str]:
    """Lines for the plain `status` view."""
    lines = []
    if out.get("ranks_summary"):
        lines.append(f"ranks        {out['ranks_summary']}")
    if out.get("slurm"):
        lines.append(f"slurm        {out['slurm']['line']}")
    return lines


def table(out: dict[str, Any]) -> str:
    """`status --ranks`: one row per rank, then the odd ones in a line."""
    if not out["ranks"]:
        return "no heartbeats in this attempt (dist.heartbeat_s=0, or no rank has started yet)"
    text = heartbeat.render(out["ranks"])
    summary = heartbeat.summary(out["ranks"]) if out["state"] == states.RUNNING else None
    named = [_named(g) for g in out.get("stragglers") or []]
    return "\n".join([text, *([summary] if summary else []), *named])


def _named(g: dict[str, Any]) -> str:
    return (
        f"straggler: rank {g['rank']} on {g['node']} at {g.get('ratio', 0):.2f}x the other "
        f"ranks' median step time (named after {g.get('time', 0) - g.get('since', 0):.0f} s)"
    )
