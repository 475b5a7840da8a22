"""The restarts a job made inside its own allocation, and how long each took to train again.

    RUN_DIR/restarts.jsonl     one JSON line per event, appended:

    {"event": "restart", "job_id": "123", "restart": 1, "failed_attempt": 0, "next_attempt": 1,
     "cause": "crash" | "node" | "stall" | "disk", "rank": 1, "host": "node2", "error": "Killed",
     "fault_at": <time>, "restart_at": <time>, "nodes": ["node1", "node3"],
     "left_out": ["node2"], "world_size": 2, "shrunk": true, "warm": true, "tries": 1,
     "progress": true, "died_on": 13, "unfit": {"node3": "the run dir is not writable ..."}}
        written by the batch step's driver (``clusterflow/job/restarts.py``) when it starts a new
        srun step after a failure: ``fault_at`` is when the fault was seen (the first-error
        record's time, or the moment srun reported the task that ended first), ``restart_at`` when
        the new step was started, ``nodes`` the nodes it runs on, ``left_out`` the allocation's
        nodes it does not use (the failed node, a straggler), ``world_size`` its ranks, and
        ``shrunk`` (only when true) that it runs on fewer nodes than ``cluster.nodes`` because no
        spare was left (``cluster.shrink``), ``warm`` (with ``cluster.warm_restarts``) whether the
        processes of the driver's warm standby became the ranks (false: new processes),
        ``tries`` the faults in a row without progress this one ends (``tries.py``: 1 after
        progress), ``died_on`` the step the failed attempt died on, ``unfit`` the nodes their
        check before the restart left out, and why (``job/nodecheck.py``).
    {"event": "first_step", "attempt": 1, "step": 9, "at": <time>}
        written by rank 0 of an attempt that a restart started, when that attempt's first
        training step ends.

:func:`read` joins the two: one dict per restart, with ``first_step_at`` and ``recovery_s``
(``first_step_at - fault_at``: the time from the fault to the next training step) once the new
attempt trained a step. Times are seconds since 1970. Readers survive damaged lines (records.py).
"""

from __future__ import annotations

import time
from typing import Any

from clusterflow.rundir import records
from clusterflow.rundir.paths import RunPaths
from clusterflow.rundir.states import Cause, Name

RESTART, FIRST_STEP = "restart", "first_step"


class RestartCause(Name):
    """The fault a restart follows (``cause`` of a restart, and of a try in ``tries.jsonl``)."""

    CRASH = "crash"  # srun saw a task end first (a signal, an exit), nothing named a cause before
    NODE = "node"  # a node's fault: a device error, the node gone
    STALL = Cause.STALL.value  # the stall watchdog ended a rank that made no progress
    DISK = "disk"  # a full disk: the restart waits for room


RESTART_RECORD = records.Schema(
    {
        "event": records.TEXT,
        "job_id": records.JOB_ID,
        "restart": records.INT,
        "failed_attempt": records.INT,
        "next_attempt": records.INT,
        "cause": records.TEXT,
        "rank": records.INT,
        "host": records.TEXT,
        "error": records.TEXT,
        "fault_at": records.TIME,
        "restart_at": records.TIME,
        "nodes": records.TEXTS,
        "left_out": records.TEXTS,
        "world_size": records.RANKS,
        "shrunk": records.FLAG,
        "warm": records.FLAG,
        "tries": records.INT,
        "progress": records.FLAG,
        "unfit": records.OBJECT,
        "died_on": records.INT,
        "attempt": records.INT,
        "step": records.INT,
        "at": records.TIME,
    },
    required=("event",),
)


def record_restart(paths: RunPaths, **fields: object) -> None:
    """The driver: a new srun step was started after a fault (the fields above)."""
    records.append_jsonl(paths.restarts, {"event": RESTART, **fields})


def note_first_step(paths: RunPaths, attempt: int, step: int) -> bool:
    """Rank 0, at its attempt's first training step: record when it ended, if a restart inside the
    job started this attempt. True when recorded."""
    at = time.time()
    lines = records.read_jsonl(paths.restarts, RESTART_RECORD)
    if not any(r["event"] == RESTART and r.get("next_attempt") == attempt for r in lines):
        return False
    try:
        records.append_jsonl(
            paths.restarts, {"event": FIRST_STEP, "attempt": attempt, "step": step, "at": at}
        )
    except OSError:  # a record is a hint: a full disk must not stop the training
        return False
    return True


def read(paths: RunPaths) -> list[dict[str, Any]]:
    """One dict per restart inside a job, oldest first, with ``first_step_at`` and ``recovery_s``
    once its attempt trained a step."""
    lines = records.read_jsonl(paths.restarts, RESTART_RECORD)
    firsts = {r["attempt"]: r for r in lines if r["event"] == FIRST_STEP and "attempt" in r}
    out = []
    for r in lines:
        if r["event"] != RESTART:
            continue
        first = firsts.get(r.get("next_attempt"))
        rec = {k: v for k, v in r.items() if k != "event"}
        if first is not None and "at" in first:
            rec["first_step_at"] = first["at"]
            rec["first_step"] = first.get("step")
            if "fault_at" in r:
                rec["recovery_s"] = round(first["at"] - r["fault_at"], 3)
        out.append(rec)
    return out


def count(paths: RunPaths, job_id: str | None = None) -> int:
    """Restarts recorded (of the Slurm job ``job_id`` only, when given)."""
    return sum(
        1
        for r in records.read_jsonl(paths.restarts, RESTART_RECORD)
        if r["event"] == RESTART and (job_id is None or str(r.get("job_id")) == str(job_id))
    )
