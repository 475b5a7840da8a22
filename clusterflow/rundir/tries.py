"""How many times the run tried the step it is stuck at, across restarts inside a job and
requeues: ``RUN_DIR/tries.jsonl``, one line per fault that ended an attempt.

A fault after the run made progress (a step committed newer than at the fault before) is tried
again, however many came before; the same step failing again and again with nothing committed
between (a poisoned sample that crashes native code, a deterministic error, a hang that comes
back) is a restart storm, and the run gives up after ``cluster.restarts_in_job`` restarts of
that step: ``restarts_in_job + 1`` tries, restarts in the job and requeues counted together,
since the count lives here, in the run dir, not in a process.

    {"fault": "41:0:2", "attempt": 3, "job_id": "41", "at": <time>, "cause": "crash",
     "rank": 1, "host": "node2", "error": "Segmentation fault", "committed": 12, "step": 13,
     "epoch": 2, "indices": {"1": [17, 4, 29, 8]}, "progress": false, "tries": 3,
     "limit": 2, "gave_up": true}

``fault``: which srun step failed (:func:`fault_id`: the job, its Slurm restart count, the
restart inside it), ``attempt`` the attempt number that step's rank 0 records;
``committed``: the newest step the run had committed when the fault came (the step the attempt
resumed from, a checkpoint it committed on the shared filesystem, or a snapshot every rank
committed into its node's memory: the timeline and the in-flight records say which);
``step``, ``epoch`` and ``indices``: the step the failed rank was training (every rank's when
the failed one is not known), its epoch and each rank's slice of its batch, from the in-flight
records (``inflight.py``); ``tries``: the faults in a row without progress, this one included.
One line per failed step: whoever judges the fault first (the batch step's driver, or a rank
that requeues the job itself after a node's fault) writes it, and a second judge of the same
step reads it back. Readers survive damaged lines (records.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from clusterflow.rundir import inflight, records, saved_config
from clusterflow.rundir.paths import RunPaths
from clusterflow.rundir.timeline import TIMELINE

_INDICES = records.Check(
    "an object of rank -> list of sample indices",
    lambda v: (
        isinstance(v, dict)
        and all(isinstance(x, list) and all(isinstance(i, int) for i in x) for x in v.values())
    ),
)
TRY = records.Schema(
    {
        "fault": records.TEXT,
        "attempt": records.INT,
        "job_id": records.JOB_ID,
        "at": records.TIME,
        "cause": records.TEXT,
        "rank": records.INT,
        "host": records.TEXT,
        "error": records.TEXT,
        "committed": records.INT,
        "step": records.INT,
        "epoch": records.INT,
        "indices": _INDICES,
        "progress": records.FLAG,
        "tries": records.INT,
        "limit": records.INT,
        "gave_up": records.FLAG,
        "said": records.TEXT,
    },
    required=("fault", "attempt", "tries"),
)
# The samples of a batch a line keeps at most (a thousand ranks' slices of a large batch would
# make one line megabytes): the failed rank's slice is kept first.
MAX_INDICES = 4096


@dataclass(frozen=True)
class Verdict:
    """What a fault means for the run: ``tries`` of the step in a row without progress (1 after
    progress), and whether the run gives up (``gave_up``: ``said`` says why, in one line)."""

    tries: int
    progress: bool
    committed: int
    step: int | None = None
    epoch: int | None = None
    indices: dict[str, list[int]] = field(default_factory=dict)
    gave_up: bool = False
    said: str = ""


def read(paths: RunPaths) -> list[dict[str, Any]]:
    """Every fault recorded, oldest first."""
    return records.read_jsonl(paths.tries, TRY, within=paths.root)


def latest(paths: RunPaths) -> dict[str, Any] | None:
    lines = read(paths)
    return lines[-1] if lines else None


def fault_id(job_id: str, restart_count: int | str, restart_in_job: int | str) -> str:
    """Which srun step failed: the Slurm job, its restart count (requeues) and the restart
    inside the job that started the step; the same from the driver and from the step's
    ranks (their environment)."""
    return f"{job_id}:{restart_count or 0}:{restart_in_job or 0}"


def gave_up(paths: RunPaths, attempt: int) -> str | None:
    """Why the run gave up at its newest fault ("no progress ..."), when no attempt began after
    it (``attempt``: the newest attempt recorded), or None."""
    last = latest(paths)
    if last is None or last.get("attempt", -1) < attempt or not last.get("gave_up"):
        return None
    return str(last.get("said") or "") or None


def committed_at(
    timeline: Mapping[str, Any] | None,
    ranks: Mapping[int, Mapping[str, Any]],
    world_size: int,
    before: int,
) -> int:
    """The newest step committed when an attempt failed: the step it resumed from, its newest
    checkpoint on the shared filesystem (its ``timeline``), or the newest snapshot every one of
    its ``world_size`` ranks committed into memory (their in-flight records, ``ranks``).
    ``before``: the committed step of the fault before (an attempt that left no timeline trained
    nothing new). Pure."""
    if not timeline:
        return before
    out = int(timeline.get("restored_step") or 0)
    commit = timeline.get("commit")
    if isinstance(commit, dict):
        out = max(out, int(commit.get("step") or 0))
    if world_size > 0 and len(ranks) == world_size:
        out = max(out, min(int(r.get("snapshot", -1)) for r in ranks.values()))
    return out


def died_on(
    ranks: Mapping[int, Mapping[str, Any]], failed: int | None
) -> tuple[int | None, int | None, dict[str, list[int]]]:
    """(step, epoch, rank -> indices) of the batch the attempt died on: the failed rank's
    in-flight record when there is one, else the newest step any rank was on (every rank's slice
    of it). Pure."""
    if failed is not None and failed in ranks:
        rec = ranks[failed]
        chosen = {failed: rec}
    elif ranks:
        newest = max(r["step"] for r in ranks.values())
        chosen = {k: r for k, r in ranks.items() if r["step"] == newest}
    else:
        return None, None, {}
    first = next(iter(chosen.values()))
    indices: dict[str, list[int]] = {}
    kept = 0
    for rank in sorted(chosen):
        slice_ = chosen[rank]["indices"][: max(0, MAX_INDICES - kept)]
        if slice_ or not indices:
            indices[str(rank)] = slice_
        kept += len(slice_)
    return int(first["step"]), int(first["epoch"]), indices


def count(previous: Mapping[str, Any] | None, committed: int) -> tuple[int, bool]:
    """(tries, progress) of a fault at ``committed`` after the fault ``previous`` (None: the
    run's first): progress when a step newer than at that fault was committed. Pure."""
    if previous is None:
        return 1, True
    progress = committed > int(previous.get("committed", -1))
    return (1 if progress else int(previous.get("tries", 0)) + 1), progress


@dataclass(frozen=True)
class Failure:
    """What ended a step, as its line in the tries records it: ``cause`` (crash, node, stall),
    the rank that failed and its host (None where not known), its one-line ``error``, and when
    it was seen (``at``, seconds since 1970; None: now)."""

    cause: str
    rank: int | None
    host: str | None
    error: str
    at: float | None = None


def judge(
    paths: RunPaths,
    *,
    fault: str,
    attempt: int,
    world_size: int,
    limit: int,
    job_id: str,
    failure: Failure,
) -> Verdict:
    """Record the fault of the srun step ``fault`` (:func:`fault_id`), whose rank 0 records
    attempt ``attempt``, once (a second call reads the first one's line back), and say whether
    the run gives up: more than ``limit`` (``cluster.restarts_in_job``) restarts of one step
    without progress."""
    rank, host = failure.rank, failure.host
    lines = read(paths)
    for line in reversed(lines):
        if line.get("fault") == fault:
            return _verdict(line)
    previous = lines[-1] if lines else None
    tl, _ = records.read_checked(paths.timeline_file(attempt), TIMELINE, within=paths.root)
    ranks = inflight.read_attempt(paths, attempt, world_size)
    committed = committed_at(
        tl, ranks, world_size, int(previous.get("committed", 0)) if previous else 0
    )
    tries, progress = count(previous, committed)
    step, epoch, indices = died_on(ranks, rank)
    rec: dict[str, Any] = {
        "fault": fault,
        "attempt": attempt,
        "job_id": job_id,
        "at": failure.at if failure.at is not None else time.time(),
        "cause": failure.cause,
        **({"rank": rank} if rank is not None else {}),
        **({"host": host} if host else {}),
        "error": failure.error,
        "committed": committed,
        **({"step": step, "epoch": epoch} if step is not None else {}),
        "indices": indices,
        "progress": progress,
        "tries": tries,
        "limit": limit,
        "gave_up": tries > limit,
    }
    if rec["gave_up"]:
        rec["said"] = no_progress(rec, saved_config.how_to_resume(paths))
    try:
        records.append_jsonl(paths.tries, rec)
    except OSError:
        pass  # a full disk: the verdict still stands for this fault
    return _verdict(rec)


def _verdict(rec: Mapping[str, Any]) -> Verdict:
    return Verdict(
        tries=int(rec.get("tries", 1)),
        progress=bool(rec.get("progress")),
        committed=int(rec.get("committed", 0)),
        step=rec.get("step"),
        epoch=rec.get("epoch"),
        indices=dict(rec.get("indices") or {}),
        gave_up=bool(rec.get("gave_up")),
        said=str(rec.get("said") or ""),
    )


def no_progress(rec: Mapping[str, Any], resume: str) -> str:
    """The one line a run that gives up ends with: the step, the tries, the last fault, the
    samples of the batch it died on, and what to do."""
    step = rec.get("step")
    where = f"at step {step}" if step is not None else f"past step {rec.get('committed')}"
    who = (
        f"rank {rec.get('rank')} on {rec.get('host')}: "
        if rec.get("rank") is not None and rec.get("host")
        else ""
    )
    said = (
        f"no progress {where}: tried {rec.get('tries')} times with no newer step committed "
        f"between (cluster.restarts_in_job={rec.get('limit')} restarts of one step, in the job "
        f"and by requeue together), the last time {who}{rec.get('error')} ({rec.get('cause')})"
    )
    indices = rec.get("indices") or {}
    if any(indices.values()):
        slices = "; ".join(
            f"rank {r}'s slice: {', '.join(str(i) for i in v)}" for r, v in indices.items()
        )
        said += (
            f"; the batch it died on (epoch {int(rec.get('epoch') or 0) + 1}) held samples "
            f"{slices}: check those samples of the training set (or the code they reach), "
            f"fix them, then {resume}"
        )
    else:
        said += f"; find the cause in the rank logs, fix it, then {resume}"
    return said
