"""Each attempt's fault: what ended it, when, how long until the run trained again, and where its
state came from. The one reader of "an attempt's fault" that ``status``, the dashboard, the
goodput ledger and ``benchmarks/chaos.py`` share.

A fault is read from the records its witnesses already write, first that applies:

| record                                            | kind                                         |
|---------------------------------------------------|----------------------------------------------|
| ``faults.jsonl``: a line for the attempt          | its ``kind`` (a fault no other record names: |
| (:func:`note`)                                    | ``no_progress``)                             |
| ``restarts.jsonl``: a restart after the attempt   | ``crash``: ``killed`` (``disk_full`` or      |
| (the batch step's driver)                         | ``error`` when the first-error record says   |
|                                                   | so); ``stall``: ``hang``; ``node``:          |
|                                                   | ``node_lost``; a cause that is a kind: itself|
| ``stops.jsonl``: the attempt's stop (rank 0)      | ``timeout``: ``time_limit``; ``preempted``:  |
|                                                   | ``preemption`` while Slurm still ran the job |
|                                                   | (or outside Slurm), ``requeue`` when Slurm   |
|                                                   | requeued it (scontrol requeue);              |
|                                                   | ``node_failure``: ``node_lost``; a user's    |
|                                                   | Ctrl-C or cancel is no fault                 |
| ``errors/first.attempt<A>.json`` (the first rank  | ``stall``: ``hang``; a full disk:            |
| that failed)                                      | ``disk_full``; a peer's connection lost      |
|                                                   | (gloo, NCCL): ``killed`` (a peer died        |
|                                                   | without a word); else ``error``              |
| none, and a later attempt began                   | ``killed`` (SIGKILL of the job, its node     |
|                                                   | lost with it: nothing could write)           |

Each fault is a dict (times in seconds since 1970, durations in seconds; None where unknown):

    attempt          the attempt the fault ended (numbered from 0)
    kind             a :class:`FaultKind`
    at               when it happened: the restart's ``fault_at`` (when the driver saw it), the
                     stop's signal (a time-limit stop the job decided itself: when it decided),
                     the first error's time, or, for a kill nothing recorded, the attempt's last
                     record
    rank, host       the rank and node a record names
    message          what the record says (the error, srun's words, how a stop came about)
    job_id           the Slurm job (or local id) of the attempt
    step             the last step the attempt trained (for a stop: the step it saved)
    in_job           a restart inside the job's allocation followed (``restarts.jsonl``)
    end_at, save_s   a time-limit stop: Slurm's end as the job knew it, a save's measured time
    samples          a ``no_progress`` fault noted with them: the indices of the batch it failed on
    how              a time-limit stop: ``signal`` (Slurm's --signal) or ``end`` (the job's own
                     watch of its end)
    next_attempt     the attempt that began after it (None: none yet)
    recovered_by     the first later attempt that trained a step (None: none yet)
    recovered_at     when that attempt's first step ended
    recovery_s       ``recovered_at - at``: the time from the fault to training again
    restored_step    the step that attempt resumed from (0: from scratch)
    restored_from    where its state came from: ``memory`` (a snapshot in its nodes' memory),
                     ``replica`` (some from a peer's replica), ``shared`` (the checkpoint on the
                     shared filesystem), None (a fresh start)
    restored_where   the words for the tier (``memory of node2``)
    steps_lost       ``step - restored_step`` (>= 0): the steps trained again; the timeline
                     records the step at most a second behind the loop, so it may be short for
                     an attempt killed with no record; None when the attempt trained nothing

Every record here is a hint (``records.py``): a damaged line or field is skipped, never an error.
"""

from __future__ import annotations

import time
from typing import Any

from clusterflow.rundir import first_error, records, restarts, timeline
from clusterflow.rundir.paths import RunPaths
from clusterflow.rundir.restarts import RestartCause
from clusterflow.rundir.states import Cause, Name, StopHow, StopReason
from clusterflow.storage import diskfull


class FaultKind(Name):
    """What ended an attempt (``kind`` of a fault)."""

    KILLED = "killed"  # a rank (or the whole job) ended by a signal: SIGKILL, the OOM killer
    ERROR = "error"  # an exception on a rank
    HANG = "hang"  # the stall watchdog ended a rank that made no progress
    NODE_LOST = "node_lost"  # a node's fault: a device error, the node gone; left out
    REQUEUE = "requeue"  # Slurm requeued the job (scontrol requeue, an admin)
    PREEMPTION = "preemption"  # SIGTERM while the job still ran (a more urgent job); saved
    TIME_LIMIT = "time_limit"  # the time limit: Slurm's signal or the job's end near; saved
    DISK_FULL = "disk_full"  # a checkpoint could not be written: the disk is full
    NO_PROGRESS = "no_progress"  # the same step failed again and again


LABELS = {
    FaultKind.KILLED: "killed",
    FaultKind.ERROR: "error",
    FaultKind.HANG: "hang",
    FaultKind.NODE_LOST: "node lost",
    FaultKind.REQUEUE: "requeue",
    FaultKind.PREEMPTION: "preemption",
    FaultKind.TIME_LIMIT: "time limit",
    FaultKind.DISK_FULL: "disk full",
    FaultKind.NO_PROGRESS: "no progress",
}

# What the stops.jsonl lines say that a fault reads.
STOP = records.Schema(
    {
        "reason": records.TEXT,
        "attempt": records.INT,
        "at": records.TIME,
        "job_id": records.JOB_ID,
        "signal_at": records.TIME,
        "step": records.INT,
        "how": records.TEXT,
        "end_at": records.TIME,
        "save_s": records.SECONDS,
        "due_at": records.TIME,
        "slurm_state": records.TEXT,
        "rank": records.INT,
        "node": records.TEXT,
        "error": records.TEXT,
    },
    required=("reason",),
)
NOTE = records.Schema(
    {
        "attempt": records.INT,
        "kind": records.TEXT,
        "at": records.TIME,
        "rank": records.INT,
        "host": records.TEXT,
        "message": records.TEXT,
        "step": records.INT,
        "samples": records.Check(
            "a list of sample indices",
            lambda v: isinstance(v, list) and all(records.INT.test(x) for x in v),
        ),
    },
    required=("attempt", "kind"),
)


def note(paths: RunPaths, attempt: int, kind: FaultKind, **fields: object) -> None:
    """Record that ``kind`` ended ``attempt`` (``RUN_DIR/faults.jsonl``), for a fault no other
    record names (``no_progress``: the driver's verdict over several attempts); ``fields``:
    ``at`` (default now), ``rank``, ``host``, ``message``, ``step``, ``samples`` (the indices of
    the batch it failed on)."""
    records.append_jsonl(
        paths.faults, {"attempt": attempt, "kind": str(kind), "at": time.time(), **fields}
    )


def _kind(value: object, default: FaultKind) -> FaultKind:
    try:
        return FaultKind(value)
    except ValueError:
        return default


# What a rank's collective says when a peer vanished (gloo, NCCL, a socket): a rank that records
# it first was the victim of a peer that died without a word (SIGKILL, the OOM killer).
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
)


def _said_kind(first: dict[str, Any] | None) -> FaultKind:
    """The kind a first-error record names: a stall, a full disk, a peer that vanished (killed),
    or another error."""
    if first is None:
        return FaultKind.ERROR
    if first.get("kind") == Cause.STALL:
        return FaultKind.HANG
    said = str(first.get("error") or "")
    if diskfull.says_full(said):
        return FaultKind.DISK_FULL
    return FaultKind.KILLED if any(w in said for w in _PEER_LOST) else FaultKind.ERROR


def _from_first(first: dict[str, Any]) -> dict[str, Any]:
    kind = _said_kind(first)
    said = {"kind": kind, "at": first.get("time"), "message": first.get("error")}
    if kind == FaultKind.KILLED:  # the record names the victim, not the rank that died
        said["message"] = (
            f"a peer ended without a word; rank {first.get('rank')} on {first.get('host')} "
            f"saw: {first.get('error')}"
        )
        return said
    return {**said, "rank": first.get("rank"), "host": first.get("host")}


def _from_restart(r: dict[str, Any], first: dict[str, Any] | None) -> dict[str, Any]:
    cause = r.get("cause")
    if cause == RestartCause.CRASH:
        # srun saw a task end by a signal first; a rank that named its own error before it
        # (a full disk) is the cause.
        named = first is not None and first.get("kind") != Cause.STALL
        own = named and r.get("error") == first.get("error")
        kind = _said_kind(first) if own else FaultKind.KILLED
    elif cause == RestartCause.STALL:
        kind = FaultKind.HANG
    elif cause == RestartCause.NODE:
        kind = FaultKind.NODE_LOST
    elif cause == RestartCause.DISK:
        kind = FaultKind.DISK_FULL
    else:
        kind = _kind(cause, _said_kind(first))
    return {
        "kind": kind,
        "at": r.get("fault_at"),
        "rank": r.get("rank"),
        "host": r.get("host"),
        "message": r.get("error"),
        "in_job": True,
    }


def _from_stop(s: dict[str, Any]) -> dict[str, Any] | None:
    reason = s["reason"]
    out: dict[str, Any] = {"at": s.get("signal_at") or s.get("due_at") or s.get("at")}
    if reason == StopReason.TIMEOUT:
        out.update(kind=FaultKind.TIME_LIMIT, how=s.get("how"), end_at=s.get("end_at"))
        out.update(save_s=s.get("save_s"), message=_time_limit_words(s))
        if s.get("how") == StopHow.END and s.get("due_at"):
            out["at"] = s["due_at"]
    elif reason == StopReason.PREEMPTED:
        state = s.get("slurm_state")
        requeued = bool(state) and state != "RUNNING"
        out["kind"] = FaultKind.REQUEUE if requeued else FaultKind.PREEMPTION
        out["message"] = (
            f"SIGTERM; Slurm's JobState {state}"
            if state
            else "SIGTERM (outside Slurm, or Slurm not asked)"
        )
    elif reason == StopReason.NODE_FAILURE:
        out.update(kind=FaultKind.NODE_LOST, rank=s.get("rank"), host=s.get("node"))
        out.update(message=s.get("error"), at=s.get("at"))
    else:  # a user's Ctrl-C or cancel: no fault
        return None
    if "step" in s:
        out["step"] = s["step"]
    return out


def _time_limit_words(s: dict[str, Any]) -> str:
    if s.get("how") == StopHow.END and s.get("end_at") and s.get("due_at"):
        return (
            f"the job's end was {max(0.0, s['end_at'] - s['due_at']):.1f} s away, closer than "
            f"two saves of {float(s.get('save_s') or 0):.1f} s and the margin"
        )
    return "Slurm's time-limit signal"


def read(paths: RunPaths, tls: timeline.Timelines | None = None) -> list[dict[str, Any]]:
    """Every attempt's fault, oldest first (the fields above). ``tls``: the timelines, when the
    caller has read them already."""
    tls = tls if tls is not None else timeline.read_all(paths)
    attempts = records.read_jsonl(paths.attempts, records.ATTEMPT)
    numbers = sorted({int(a.get("attempt", i)) for i, a in enumerate(attempts)} | set(tls.records))
    by_n = {int(a.get("attempt", i)): a for i, a in enumerate(attempts)}
    stops = {s["attempt"]: s for s in records.read_jsonl(paths.stops, STOP) if "attempt" in s}
    after = {
        r["failed_attempt"]: r for r in reversed(restarts.read(paths)) if "failed_attempt" in r
    }
    notes = {n["attempt"]: n for n in records.read_jsonl(paths.faults, NOTE)}
    out = []
    for i, n in enumerate(numbers):
        later = numbers[i + 1 :]
        tl = tls.records.get(n, {})
        first = first_error.read(paths, n)
        if n in notes:
            said = {k: v for k, v in notes[n].items() if k != "attempt"}
            said["kind"] = _kind(said["kind"], FaultKind.ERROR)
        elif n in after:
            said = _from_restart(after[n], first)
        elif n in stops:
            said = _from_stop(stops[n])
        elif first is not None:
            said = _from_first(first)
        elif later and not tl.get("outcome"):
            said = {
                "kind": FaultKind.KILLED,
                "at": tl.get("written_at") or by_n.get(n, {}).get("started_at"),
                "message": "no record: SIGKILL, the OOM killer, or its node lost",
            }
        else:
            said = None
        if said is None:
            continue
        out.append(_recovery(n, said, tl, by_n.get(n, {}), later, tls))
    return out


def _recovery(
    n: int,
    said: dict[str, Any],
    tl: dict[str, Any],
    rec: dict[str, Any],
    later: list[int],
    tls: timeline.Timelines,
) -> dict[str, Any]:
    """The fault of attempt ``n`` with who recovered from it, when, from where, and the steps it
    cost."""
    trained = "first_step_at" in tl
    step = said.get("step", tl.get("last_step") if trained else None)
    fault: dict[str, Any] = {
        "attempt": n,
        "kind": said["kind"],
        "at": said.get("at"),
        "rank": said.get("rank"),
        "host": said.get("host"),
        "message": said.get("message"),
        "job_id": rec.get("job_id", tl.get("job_id")),
        "step": step,
        "in_job": bool(said.get("in_job")),
        **{k: said[k] for k in ("how", "end_at", "save_s", "samples") if k in said},
        "next_attempt": later[0] if later else None,
        "recovered_by": None,
        "recovered_at": None,
        "recovery_s": None,
        "restored_step": None,
        "restored_from": None,
        "restored_where": None,
        "steps_lost": None,
    }
    by = next((m for m in later if "first_step_at" in tls.records.get(m, {})), None)
    if by is None:
        return fault
    back = tls.records[by]
    restored = int(back.get("restored_step") or 0)
    fault.update(
        recovered_by=by,
        recovered_at=back["first_step_at"],
        restored_step=restored,
        restored_from=timeline.restored_from(tls, by + 1)[by],
        restored_where=back.get("restored_where"),
    )
    if fault["at"] is not None:
        fault["recovery_s"] = round(max(0.0, back["first_step_at"] - fault["at"]), 3)
    if isinstance(step, int):
        fault["steps_lost"] = max(0, step - restored)
    return fault


def source(f: dict[str, Any]) -> str:
    """Where the state of the attempt that recovered from fault ``f`` came from, in words."""
    step = f.get("restored_step")
    tier = f.get("restored_from")
    if f.get("recovered_by") is None:
        return "not recovered yet"
    if tier == "memory":
        return f"the memory snapshot at step {step} ({f.get('restored_where') or 'memory'})"
    if tier == "replica":
        return f"a peer's replica at step {step} ({f.get('restored_where') or 'replica'})"
    if tier == "shared":
        return f"the disk checkpoint at step {step}"
    return "step 0 (no checkpoint)"


def describe(f: dict[str, Any]) -> str:
    """One line for ``status`` and ``clusterflow goodput``: the kind, where, when, the time to
    train again and where the state came from."""
    where = "".join(
        [
            f", rank {f['rank']}" if f.get("rank") is not None else "",
            f" on {f['host']}" if f.get("host") else "",
        ]
    )
    when = time.strftime("%H:%M:%S", time.localtime(f["at"])) if f.get("at") else "?"
    head = f"attempt {f['attempt']}: {LABELS.get(f['kind'], f['kind'])}{where} at {when}"
    said = f" ({f['message']})" if f.get("message") else ""
    if f.get("recovery_s") is not None:
        back = (
            f"; training again {f['recovery_s']:.1f} s later (attempt {f['recovered_by']}"
            f"{', in the job' if f.get('in_job') else ''}) from {source(f)}"
        )
    elif f.get("recovered_by") is not None:
        back = f"; training again in attempt {f['recovered_by']} from {source(f)}"
    else:
        back = "; not training again yet"
    lost = f"; {f['steps_lost']} step(s) trained again" if f.get("steps_lost") is not None else ""
    return f"{head}{said}{back}{lost}"
