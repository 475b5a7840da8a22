"""What ``status`` shows as a run's ``state`` and ``error``: one pure function over what was seen.

What is committed is the truth: the final ``model.pt`` next to a committed checkpoint of the
run's last step means the run completed, whatever the records say. The records are hints that
may be lost: status.json holds what the run last wrote, and a run killed by SIGKILL, the OOM
killer or a node failure writes nothing more (an empty or damaged one says nothing at all); a
user's cancel, Slurm's queue and the attempt's first-error record each know something
status.json may not. :func:`decide` weighs them, in this order:

| evidence (first that applies wins)                      | state                     |
|---------------------------------------------------------|---------------------------|
| committed: model.pt and the last step's checkpoint      | completed                 |
| cancelled marker, a live process still trains          | running (note: cancel     |
| (liveness: alive)                                       | requested)                |
| cancelled marker, run not completed                     | cancelled                 |
| no live process; recorded running/pending (or nothing); | failed                    |
| squeue: RUNNING, COMPLETING, CONFIGURING or gone        |                           |
| no live process; squeue not PENDING; recorded running,  | failed                    |
| or nothing once an attempt or checkpoint exists         |                           |
| recorded requeued, squeue not PENDING nor RUNNING, and  | failed (cancelled when    |
| Slurm's record (sacct, scontrol) shows no requeue       | Slurm says CANCELLED)     |
| (``slurm_says``)                                        |                           |
| recorded requeued, squeue COMPLETING, Slurm counted a   | requeued                  |
| requeue                                                 |                           |
| squeue: PENDING                                         | requeued (pending before  |
|                                                         | any attempt)              |
| squeue: RUNNING, COMPLETING, CONFIGURING                | running                   |
| squeue: gone, recorded running/pending (or nothing)     | failed                    |
| status.json's state                                     | that state                |
| no state recorded                                       | running once an attempt   |
|                                                         | or checkpoint exists,     |
|                                                         | else pending              |

| evidence for ``error`` (first that applies wins)        | error                                |
|---------------------------------------------------------|--------------------------------------|
| Slurm ended a job recorded requeued without a requeue   | that, with Slurm's line and how to   |
|                                                         | resume                               |
| the first cause is a stall (state failed or running)    | the stall's line (rank, host, step)  |
| failed: status.json's error, else the first-error       | that cause, with srun's first failed |
| record                                                  | task in front when another rank      |
|                                                         | ended first                          |
| not failed                                              | status.json's error                  |
| none of these, the process is gone                      | what liveness saw                    |

The collecting (files, squeue, processes) lives in ``status.py``; nothing here reads anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clusterflow.rundir import first_error
from clusterflow.rundir.states import (
    CANCELLED,
    COMPLETED,
    FAILED,
    PENDING,
    REQUEUED,
    RUNNING,
    Cause,
)
from clusterflow.slurm import outcome

_QUEUE_RUNNING = ("RUNNING", "COMPLETING", "CONFIGURING")
# Slurm's words for a job that is still queued or runs: it comes back (or never left).
_SLURM_LIVE = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RUNNING", "CONFIGURING")


@dataclass(frozen=True)
class Evidence:
    recorded_state: str | None = None  # status.json's state (None: no record, or a damaged one)
    recorded_error: str | None = None  # status.json's error
    attempts: int = 0  # job starts recorded in attempts.jsonl
    started: bool = False  # something else shows the run began (a committed checkpoint)
    queue: str | None = None  # squeue: "STATE|REASON", "" once gone, None: not asked or no answer
    alive: bool | None = None  # a live process seen (None: not asked, or nothing can tell)
    liveness: str | None = None  # what was checked, when no process is alive
    cancelled: bool = False  # RUN_DIR/cancelled.json exists
    first_error: dict[str, Any] | None = None  # this attempt's first-error record
    srun_first: tuple[int, str, str] | None = None  # (rank, node, what) srun saw fail first
    completed: bool = False  # committed: model.pt and a checkpoint of the run's last step
    job_id: str = ""  # the Slurm job that holds the run
    slurm: outcome.Verdict | None = None  # Slurm's record of it, asked when ``needs_slurm``
    slurm_runs: int = 0  # the runs of that job the records know (its highest restart count + 1)
    resume: str = ""  # how to resume the run (``saved_config.how_to_resume``)
    # Why the run gave up on a step that kept failing without progress (``rundir/tries.py``)
    gave_up: str | None = None


@dataclass(frozen=True)
class Verdict:
    state: str
    error: str | None
    stalled: dict[str, Any] | None = None  # the stall's facts, when the first cause is one
    note: str | None = None  # what is under way (a cancel the job has not acted on yet)


# A cancelled run whose job still trains: it stops at its next agreement, saves, ends cancelled.
CANCEL_REQUESTED = (
    "cancel requested: the job stops at its next step boundary, saves and ends cancelled"
)


def queued_state(e: Evidence) -> str:
    """The state from status.json, corrected by what is committed and what squeue says (when it
    answers)."""
    if e.completed:
        return COMPLETED
    state = e.recorded_state or (RUNNING if e.attempts or e.started else PENDING)
    if e.queue is None:
        return state
    queued = e.queue.split("|")[0]
    if queued == "PENDING":
        return REQUEUED if e.attempts else PENDING
    if queued in _QUEUE_RUNNING:
        return RUNNING
    if queued == "" and state in (RUNNING, PENDING):
        return FAILED  # left the queue without writing an outcome: killed or crashed
    return state


def needs_slurm(e: Evidence) -> bool:
    """Whether Slurm's own record of the job must be asked: the run's record says requeued, but
    squeue shows the job neither pending nor running (completing, or gone), so only Slurm knows
    whether it comes back."""
    if e.recorded_state != REQUEUED or e.queue is None or not e.job_id or e.completed:
        return False
    return e.queue.split("|")[0] not in ("PENDING", "RUNNING", "CONFIGURING")


def slurm_says(e: Evidence) -> str | None:
    """The state Slurm's record gives a job that the run's record calls requeued: requeued while
    it comes back (queued again, or a requeue counted beyond the runs the records know), failed
    (cancelled, when scancel ended it) once it ended without one; None when not asked, or it
    cannot tell."""
    v = e.slurm
    if v is None or not needs_slurm(e):
        return None
    if v.state in _SLURM_LIVE or (e.slurm_runs and v.attempts > e.slurm_runs):
        return REQUEUED
    if v.state == "UNKNOWN":  # Slurm forgot the job: gone from the queue, it never comes back
        return FAILED if e.queue == "" else None
    return CANCELLED if v.state == "CANCELLED" else FAILED


def needs_liveness(e: Evidence) -> bool:
    """Whether the claim is worth checking against live processes: the run says (or, by the
    queue, seems) to run or to have just failed, and its own record does not say it ended."""
    return queued_state(e) in (RUNNING, FAILED) and e.recorded_state in (RUNNING, PENDING, None)


def decide(e: Evidence) -> Verdict:
    """The state and error ``status`` shows for this evidence (the tables above)."""
    state = queued_state(e)
    slurm = slurm_says(e)
    state = slurm or state
    gone = needs_liveness(e) and e.alive is False
    if gone:
        state = FAILED
    note = None
    if e.cancelled and state == RUNNING and needs_liveness(e) and e.alive is True:
        note = CANCEL_REQUESTED  # never "cancelled" while a live process trains
    elif e.cancelled and state != COMPLETED:
        state = CANCELLED
    if slurm in (FAILED, CANCELLED) and state == slurm and e.slurm is not None:
        said = e.slurm.line()
        error = (
            f"Slurm ended job {e.job_id} without requeueing it ({said}), although the run "
            f"recorded it requeued; {e.resume}"
        )
        return Verdict(state, error, note=note)
    rec = e.first_error
    if e.gave_up and state == FAILED:
        return Verdict(state, e.gave_up, note=note)
    if rec is not None and rec.get("kind") == Cause.STALL and state in (FAILED, RUNNING):
        facts = {k: rec.get(k) for k in ("rank", "host", "step", "phase", "stalled_s", "where")}
        if rec.get("silent_host"):  # the rank that stopped, not the one that waited for it
            facts.update(rank=rec.get("silent_rank"), host=rec["silent_host"])
        return Verdict(state, first_error.headline(rec), facts, note)
    if state == FAILED:
        error = _with_srun(first_error.worded(e.recorded_error, e.first_error), e.srun_first)
    else:
        error = e.recorded_error
    return Verdict(state, error or (e.liveness if gone else None), note=note)


def _with_srun(error: str | None, first: tuple[int, str, str] | None) -> str | None:
    """srun names the task that failed first (a SIGKILL leaves that rank no chance to record
    anything), so a peer's later error is put after it."""
    if first is None or (error or "").startswith(f"rank {first[0]}:"):
        return error
    rank, node, what = first
    said = f"rank {rank} on {node} ended first ({what}, as srun reports it)"
    return said + (f"; then {error}" if error else "")
