"""When each attempt did what: ``RUN_DIR/timeline/attempt<A>.json``, the goodput ledger's record.

Rank 0 rewrites its attempt's record whole (``storage.durable.write_atomic``) at the attempt's
first step, after each committed checkpoint, at log steps at most once a second, and when the
loop ends; a kill leaves the last one. Fields (times in seconds since 1970, durations in seconds):

    attempt, job_id, restart_count    which attempt, in which Slurm job (or local process)
    world_size                        ranks of the attempt (GPU-time = wall x ranks)
    process_started_at                when rank 0's process started (before imports)
    restored_step, restore_s          the checkpoint it resumed from (0: fresh) and how long
                                      reading it took
    restored_from, restored_where     which tier the state came from: memory (the snapshots in
                                      the nodes' memory), replica (some from a peer's replica)
                                      or shared (the shared filesystem), and where ("memory of
                                      node2"); absent after a fresh start
    startup                           rank 0's seconds per start-up phase, from its process's
                                      start (imports, rendezvous, run dir, task data, model,
                                      restore, first batch, first step), as of this write
    first_step_at                     when its first optimizer step ended
    last_step, written_at             the newest step trained, as of this write
    seconds                           time in each phase since the first step (train, eval,
                                      mining, checkpoint), as of this write
    commit                            the newest checkpoint it committed: step, at, and the
                                      phase seconds at that moment
    write_s                           the longest checkpoint write it measured, from the write's
                                      start to its publish (a later attempt's first estimate of
                                      a save, for the watch of the job's end)
    ended_at, outcome                 when the loop ended and how (completed, preempted, ...)

Readers get the fields that fit :data:`TIMELINE` (records.py's checked readers): a field that
does not fit (a negative duration, a string for a time) is named and left out; a record that is
no JSON object (empty, garbage, cut short) is named and its attempt listed as ``unreadable``."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from clusterflow.rundir import records
from clusterflow.rundir.paths import RunPaths
from clusterflow.storage import durable

_SECONDS = records.Check(
    "an object of finite numbers of seconds >= 0",
    lambda v: isinstance(v, dict) and all(records.SECONDS.test(x) for x in v.values()),
)
_COMMIT = records.Check(
    "an object with step, at and seconds",
    lambda v: (
        isinstance(v, dict)
        and records.INT.test(v.get("step"))
        and records.TIME.test(v.get("at"))
        and _SECONDS.test(v.get("seconds", {}))
    ),
)
TIMELINE = records.Schema(
    {
        "attempt": records.INT,
        "job_id": records.JOB_ID,
        "restart_count": records.INT,
        "world_size": records.RANKS,
        "process_started_at": records.TIME,
        "restored_step": records.INT,
        "restore_s": records.SECONDS,
        "restored_from": records.TEXT,
        "restored_where": records.TEXT,
        "startup": _SECONDS,
        "first_step_at": records.TIME,
        "first_step": records.INT,
        "last_step": records.INT,
        "written_at": records.TIME,
        "seconds": _SECONDS,
        "commit": _COMMIT,
        "write_s": records.SECONDS,
        "ended_at": records.TIME,
        "outcome": records.TEXT,
    },
    required=("attempt",),
)


def write(paths: RunPaths, record: dict[str, Any], fsync: bool = False) -> None:
    """Replace attempt ``record["attempt"]``'s timeline (rank 0)."""
    durable.write_atomic(
        paths.timeline_file(int(record["attempt"])), json.dumps(record), fsync=fsync
    )


@dataclass
class Timelines:
    """Every attempt's timeline that could be read (by attempt number), the attempts whose
    timeline exists but is unreadable, a warning for each damaged record or field, and the
    first of them for each attempt whose timeline is damaged (unreadable or a field left out)."""

    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    unreadable: set[int] = field(default_factory=set)
    damaged: list[str] = field(default_factory=list)
    damaged_attempts: dict[int, str] = field(default_factory=dict)


def read_all(paths: RunPaths) -> Timelines:
    """Every attempt's timeline, by attempt number."""
    out = Timelines()
    try:
        names = sorted(os.listdir(paths.timelines))
    except OSError:
        return out
    for name in names:
        m = re.fullmatch(r"attempt(\d+)\.json", name)
        if not m:
            continue
        rec, said = records.read_checked(
            os.path.join(paths.timelines, name), TIMELINE, f"timeline/{name}", within=paths.root
        )
        out.damaged += said
        n = int(m.group(1))
        if said:
            out.damaged_attempts[n] = said[0]
        if rec is None:
            out.unreadable.add(n)
        else:
            out.records[n] = rec
    out.records = dict(sorted(out.records.items()))
    return out


def longest_write(tls: Timelines) -> float:
    """The longest checkpoint write any attempt recorded (0: none)."""
    return max((float(r.get("write_s") or 0.0) for r in tls.records.values()), default=0.0)


def restored_from(tls: Timelines, attempts: int) -> list[str | None]:
    """Where each of ``attempts`` attempts (by number from 0) took its state: ``memory``,
    ``replica`` or ``shared``; None after a fresh start, or where its record does not say (a
    record of an older version that resumed says ``shared``: the only tier it had)."""
    out: list[str | None] = []
    for n in range(attempts):
        rec = tls.records.get(n, {})
        tier = rec.get("restored_from")
        if tier is None and (rec.get("restored_step") or 0) > 0:
            tier = "shared"
        out.append(tier)
    return out
