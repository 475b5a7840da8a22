"""The goodput ledger: where every second of every attempt's wall time went.

Pure over the run's own records (``attempts.jsonl``, ``timeline/attempt<A>.json``,
``submissions.jsonl``, the attempt's first cause, ``stragglers.jsonl``) and, when the caller has
them, Slurm's start and end of each run of a job (``slurm.commands.job_runs``). docs/goodput.md
says what each category holds and where each time comes from.

Each attempt is cut at five instants, each clamped to lie between its neighbours, so no part is
ever negative and the parts add up to the attempt's wall time exactly:

    queued -queue- allocated -startup, restore- first step -active- last record -tail- end

- allocated: Slurm's start, else the earliest start of the attempt's processes (its timeline,
  else ``attempts.jsonl``), so an attempt that dies in start-up counts from its ranks' start.
- active: the phase seconds since the first step (train, eval, mining, checkpoint), scaled down
  if the clocks disagree; whatever the phases do not cover is ``other``, explicit. Train is
  split by steps: steps that an earlier attempt had trained already are ``recomputed``, steps
  trained after the attempt's last commit that no later attempt took over are ``lost``, the
  rest ``productive``; eval, mining and checkpoint work after the last commit (or, with none,
  since the first step) of an attempt that ended without completing is ``lost`` too. A later
  attempt that resumed from a newer step than the attempt recorded committing proves that it
  committed that step (a kill between the commit and its record).
- tail: after a clean end of the loop (completed, stopped, failed with a record) ``shutdown``;
  after a stall the watchdog named, ``stalls``; a kill with no record, ``lost``.
- end: Slurm's end, else the recorded end of the loop (``ended_at``: file times are not trusted
  where a record says it, since a copy of the run dir gives every file the copy's time), else
  the last sign of life: the last record, the first error, or the rank logs' last write (not
  taken when it is later than the next attempt's start: a copy's time).
- Each attempt's fault (``rundir/faults.py``) is charged what it cost (:func:`charge`): the time
  from the fault to training again and the steps trained again, each second to one fault only.
- An attempt whose timeline is unreadable is named in ``damaged_records``, and its time from
  its allocation to its end is ``other``: the records cannot split it. ``warnings`` says so, with
  the seconds, for every attempt whose damaged timeline left time in ``other``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from clusterflow import rundir
from clusterflow.rundir import faults, first_error, records, restarts, stragglers, timeline
from clusterflow.rundir.states import COMPLETED, RUNNING, Cause
from clusterflow.slurm.jobids import SLURM_SOURCES

CATEGORIES = (
    "queue_wait",
    "startup",
    "restore",
    "productive",
    "recomputed",
    "eval",
    "mining",
    "checkpoint_stall",
    "stalls",
    "shutdown",
    "lost",
    "other",
)
LABELS = {
    "queue_wait": "queue wait",
    "startup": "start-up",
    "restore": "restore",
    "productive": "productive",
    "recomputed": "recomputed steps",
    "eval": "eval",
    "mining": "mining",
    "checkpoint_stall": "checkpoint stall",
    "stalls": "stalls/hangs",
    "shutdown": "shut-down",
    "lost": "lost after ckpt",
    "other": "other",
}


def _clamp(t: float | None, low: float, high: float) -> float:
    return low if t is None else min(max(t, low), high)


class _Attempt:
    """The instants and records of one attempt, as the ledger needs them."""

    def __init__(self, rec: dict[str, Any], tl: dict[str, Any], unreadable: bool) -> None:
        self.rec, self.tl, self.unreadable = rec, tl, unreadable
        self.n = int(rec.get("attempt", tl.get("attempt", 0)))
        self.job = str(rec.get("job_id") or tl.get("job_id") or "")
        self.restart = rec.get("restart_count", tl.get("restart_count"))
        self.slurm = (rec.get("source") or "") in SLURM_SOURCES
        self.ranks = int(tl.get("world_size") or rec.get("world_size") or 1)
        self.restored = int(tl.get("restored_step") or 0)
        self.last_step = int(tl.get("last_step", self.restored))
        self.commit: dict[str, Any] = tl.get("commit") or {}
        self.last_record = tl.get("ended_at") or tl.get("written_at")
        # Every rank's process start where attempts.jsonl has it, else rank 0's (the timeline).
        starts = [
            t
            for t in (rec.get("process_started_at"), tl.get("process_started_at"))
            if t is not None
        ]
        self.process_start: float | None = min(starts) if starts else None

    def start(self) -> float | None:
        """The earliest recorded start of this attempt: its processes', else the record's."""
        return self.process_start if self.process_start is not None else self.rec.get("started_at")

    def committed_by_later(self, later: list[_Attempt]) -> None:
        """A later attempt that resumed from a step newer than this attempt's recorded commit and
        than its own restore resumed from this attempt's commit, which a kill kept out of its
        timeline (attempts in between that recorded no restore never trained)."""
        if "first_step_at" not in self.tl:  # it never trained a step: it committed nothing
            return
        for b in later:
            if b.unreadable:
                return
            if "restored_step" not in b.tl:
                continue
            if b.restored > max(int(self.commit.get("step") or 0), self.restored):
                # Its phase seconds as of its last record: nothing recorded came after the commit.
                self.commit = {"step": b.restored, "seconds": self.tl.get("seconds") or {}}
                self.last_step = max(self.last_step, b.restored)
            return


@dataclass(frozen=True)
class _Sources:
    """What the ledger reads once for all attempts of a run."""

    paths: rundir.RunPaths
    slurm: Mapping[str, list[dict[str, Any]]]  # job id -> Slurm's runs of it
    subs: list[dict[str, Any]]  # submissions.jsonl
    now: float


def _run_of(runs: Mapping[str, list[dict[str, Any]]], a: _Attempt) -> dict[str, Any] | None:
    """Slurm's run of the attempt's job that has its restart count (sacct lists each requeue)."""
    for run in runs.get(a.job, []):
        if run.get("restart") == a.restart:
            return run
    return None


def _last_log_line(paths: rundir.RunPaths, attempt: int) -> float | None:
    """When any rank last wrote to its log of ``attempt`` (the files' mtimes): the last sign of
    life of an attempt killed without a record, where Slurm has no end time for it."""
    try:
        names = os.listdir(paths.logs)
    except OSError:
        return None
    times = []
    for name in names:
        if name.startswith("rank") and name.endswith(f".attempt{attempt}.log"):
            with contextlib.suppress(OSError):
                times.append(os.path.getmtime(os.path.join(paths.logs, name)))
    return max(times) if times else None


def _submitted(subs: list[dict[str, Any]], job: str) -> float | None:
    times = [s.get("submitted_at") for s in subs if str(s.get("job_id")) == job]
    times = [t for t in times if t is not None]
    return min(times) if times else None


def ledger(
    paths: rundir.RunPaths,
    slurm: Mapping[str, list[dict[str, Any]]] | None = None,
    running: bool | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """Every attempt's seconds per category, its GPU-time and ratio, and the run's total.

    ``slurm``: job id -> runs (``{"restart", "submit", "start", "end", "source"}``); ``running``:
    whether the newest attempt still runs (None: read status.json)."""
    now = time.time() if now is None else now
    slurm = slurm or {}
    recs, damaged = records.read_records(paths.attempts, records.ATTEMPT)
    tls = timeline.read_all(paths)
    damaged += tls.damaged
    known = set(tls.records) | tls.unreadable
    numbers = sorted({int(r.get("attempt", i)) for i, r in enumerate(recs)} | known)
    by_n = {int(r.get("attempt", i)): r for i, r in enumerate(recs)}
    attempts = [
        _Attempt(by_n.get(n, {"attempt": n}), tls.records.get(n, {}), n in tls.unreadable)
        for n in numbers
    ]
    for i, a in enumerate(attempts):
        a.committed_by_later(attempts[i + 1 :])
    if running is None:
        st, _ = records.read_object(paths.status, records.STATUS)
        running = st.get("state") == RUNNING
    subs, said = records.read_records(paths.submissions, records.SUBMISSION)
    damaged += said
    src = _Sources(paths, slurm, subs, now)
    rows, prev, high = [], None, 0
    restarted = {r.get("next_attempt"): r for r in restarts.read(paths)}
    by_number = {a.n: a for a in attempts}
    for i, a in enumerate(attempts):
        newest = i == len(attempts) - 1
        row = _row(src, a, prev, high, attempts[i + 1 :], newest and running)
        back = restarted.get(a.n)
        failed = by_number.get(back.get("failed_attempt")) if back else None
        row["restart_in_job"] = _restart(back, a, failed)
        rows.append(row)
        prev, high = (a, row), max(high, a.last_step)
    charged = charge(faults.read(paths, tls), {r["attempt"]: r for r in rows}, running, now)
    for row in rows:
        row["fault"] = next((f for f in charged if f["attempt"] == row["attempt"]), None)
    return {
        "run_dir": paths.root,
        "attempts": rows,
        "total": _total(rows),
        "faults": charged,
        "faults_by_kind": by_kind(charged),
        "damaged_records": damaged,
        "warnings": [
            f"attempt {r['attempt']}: {r['seconds']['other']:.1f} s of its "
            f"{r['wall_s'] - r['seconds']['queue_wait']:.1f} s allocated are counted as other, "
            f"since its timeline is damaged and cannot split them ({why})"
            for r in rows
            if (why := tls.damaged_attempts.get(r["attempt"])) and r["seconds"]["other"] > 0
        ],
    }


def charge(
    found: list[dict[str, Any]],
    rows: Mapping[int, dict[str, Any]],
    running: bool,
    now: float,
) -> list[dict[str, Any]]:
    """Each fault (``rundir/faults.py``) with the time it cost: ``downtime_s``, from the fault to
    the first step of the attempt that recovered (or, sooner, the next fault of an attempt that
    never trained; while the run still recovers, until now), and ``retrained_s``, the steps that
    attempt trained again (its ``recomputed`` seconds, charged to the first fault it recovered
    from: a fault of an attempt that trained nothing lost no step); ``lost_s`` is their sum,
    ``lost_gpu_s`` the same over the ranks of the failed and of the recovering attempt. Each
    second is charged to one fault at most."""
    out, claimed = [], set()
    for i, f in enumerate(found):
        by = f.get("recovered_by")
        cut = [
            g["at"]
            for g in found[i + 1 :]
            if g.get("at") is not None and (by is None or g["attempt"] < by)
        ]
        until = min([*cut, *([f["recovered_at"]] if by is not None else [])], default=None)
        if until is None and running and by is None:
            until = now
        at = f.get("at")
        down = max(0.0, until - at) if at is not None and until is not None else 0.0
        again = 0.0
        if by is not None and by not in claimed and by in rows:
            claimed.add(by)
            again = float(rows[by]["seconds"]["recomputed"])
        ranks = rows[f["attempt"]]["ranks"] if f["attempt"] in rows else 1
        back = rows[by]["ranks"] if by in rows else ranks
        out.append(
            {
                **f,
                "downtime_s": down,
                "retrained_s": again,
                "lost_s": down + again,
                "lost_gpu_s": down * ranks + again * back,
            }
        )
    return out


def by_kind(charged: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The faults' count and lost time per kind, in the order the kinds are declared."""
    out: dict[str, dict[str, float]] = {}
    for kind in faults.FaultKind:
        these = [f for f in charged if f["kind"] == kind]
        if these:
            out[str(kind)] = {
                "count": len(these),
                "lost_s": sum(f["lost_s"] for f in these),
                "lost_gpu_s": sum(f["lost_gpu_s"] for f in these),
            }
    return out


def _restart(
    r: dict[str, Any] | None, a: _Attempt, failed: _Attempt | None
) -> dict[str, Any] | None:
    """How attempt ``a``, which a restart inside the allocation began after ``failed``, came about
    (``RUN_DIR/restarts.jsonl``): the fault, the nodes left out, the seconds from the fault to its
    first step (``recovery_s``, None until it trained one), where its state came from
    (``restored_from``: memory, replica or shared; ``restored_where``) and the steps the crash
    cost (``steps_lost``: the failed attempt's last recorded step less the step restored; its
    timeline records the step at most a second behind the loop, so it may be a step short)."""
    if r is None:
        return None
    keep = ("cause", "rank", "host", "left_out", "fault_at", "first_step_at", "recovery_s")
    out = {k: r.get(k) for k in keep}
    restored = "restored_step" in a.tl
    out["restored_from"] = a.tl.get("restored_from") if restored else None
    out["restored_where"] = a.tl.get("restored_where") if restored else None
    out["steps_lost"] = (
        max(0, failed.last_step - a.restored)
        if restored and failed is not None and not failed.unreadable
        else None
    )
    return out


def _instants(
    src: _Sources,
    a: _Attempt,
    prev: tuple[_Attempt, dict[str, Any]] | None,
    later: list[_Attempt],
    running: bool,
) -> tuple[list[float], dict[str, str]]:
    """[queued, allocated, first step, last record, end], clamped in order, and where each came
    from."""
    now, subs = src.now, src.subs
    run = _run_of(src.slurm, a) if a.slurm else None
    prev_end = prev[1]["ended_at"] if prev else None
    same_run = prev is not None and a.slurm and prev[0].job == a.job
    in_job = same_run and prev is not None and prev[0].restart == a.restart
    started = a.start()
    started = now if started is None else started
    said: dict[str, str] = {}
    if in_job:
        allocated, said["allocated"] = prev_end, "previous attempt's end (same allocation)"
    elif run and run.get("start"):
        allocated, said["allocated"] = run["start"], str(run["source"])
    else:
        allocated = started
        said["allocated"] = (
            "timeline (process start)"
            if a.process_start is not None and a.process_start == a.tl.get("process_started_at")
            else "attempts.jsonl (process start)"
            if a.process_start is not None
            else "attempts.jsonl"
        )
    if in_job or same_run or (prev_end is not None and not a.slurm):
        queued, said["queued"] = prev_end, "previous attempt's end"
    elif a.slurm and _submitted(subs, a.job) is not None:
        queued, said["queued"] = _submitted(subs, a.job), "submissions.jsonl"
    elif run and run.get("submit"):
        queued, said["queued"] = run["submit"], str(run["source"])
    else:
        queued, said["queued"] = allocated, "no queue known"
    last_of_run = not any(b.job == a.job and b.restart == a.restart for b in later)
    last = a.last_record or a.tl.get("first_step_at") or started
    if running:
        end, said["ended"] = now, "now (running)"
    elif run and run.get("end") and last_of_run:
        end, said["ended"] = max(run["end"], last), str(run["source"])
    elif a.tl.get("ended_at"):
        end, said["ended"] = a.tl["ended_at"], "timeline"
    else:
        end, said["ended"] = _last_sign_of_life(src, a, last, later)
    b0 = float(queued if queued is not None else allocated)
    b1 = max(float(allocated if allocated is not None else b0), b0)
    b4 = max(float(end), b1)
    b2 = _clamp(a.tl.get("first_step_at") or b4, b1, b4)
    b3 = _clamp(now if running else last, b2, b4)
    return [b0, b1, b2, b3, b4], said


def _last_sign_of_life(
    src: _Sources, a: _Attempt, last: float, later: list[_Attempt]
) -> tuple[float, str]:
    """The end of an attempt with no record of its end (killed, or dead in start-up): the latest
    of its last record, its first error and its rank logs' last write, and where it came from.
    The logs' time is a file time, which a copy of the run dir resets: one later than the next
    attempt's start is the copy's, not this attempt's, and is not taken."""
    signs = [(last, "timeline" if a.last_record else "attempts.jsonl")]
    first = first_error.read(src.paths, a.n)
    if first is not None and first.get("time"):
        signs.append((float(first["time"]), "first error"))
    logged = _last_log_line(src.paths, a.n)
    nxt = next((t for b in later if (t := b.start()) is not None), None)
    if logged is not None and (nxt is None or logged <= nxt):
        signs.append((logged, "rank logs (last line)"))
    end, said = signs[0]
    for t, where in signs[1:]:
        if t > end:
            end, said = t, where
    return end, said


def _row(
    src: _Sources,
    a: _Attempt,
    prev: tuple[_Attempt, dict[str, Any]] | None,
    high: int,
    later: list[_Attempt],
    running: bool,
) -> dict[str, Any]:
    """One attempt's seconds per category; ``high``: the highest step an earlier attempt
    reached; ``running``: the attempt still runs."""
    (b0, b1, b2, b3, b4), said = _instants(src, a, prev, later, running)
    s = dict.fromkeys(CATEGORIES, 0.0)
    s["queue_wait"] = b1 - b0
    if a.unreadable:  # nothing tells what the attempt did between its start and its end
        s["other"] = b4 - b1
        steps = {"restored": 0, "last": 0, "committed": 0, "recomputed": 0, "lost": 0}
    else:
        s["restore"] = min(max(0.0, float(a.tl.get("restore_s") or 0.0)), b2 - b1)
        s["startup"] = (b2 - b1) - s["restore"]
        steps = _active(a, b3 - b2, high, bool(later), running, s)
        _tail(src, a, b4 - b3, s)
    wall = b4 - b0
    allocated = wall - s["queue_wait"]
    return {
        "attempt": a.n,
        "job_id": a.job or None,
        "ranks": a.ranks,
        "outcome": a.tl.get("outcome"),
        "queued_at": b0,
        "ended_at": b4,
        "wall_s": wall,
        "seconds": s,
        "gpu_seconds": {k: v * a.ranks for k, v in s.items()},
        "ratio": s["productive"] / allocated if allocated > 0 else None,
        "steps": steps,
        "sources": said,
        "stragglers": stragglers.read(src.paths, a.n),
        # Rank 0's start-up by phase (observe/timeline.py's Startup): where start-up and restore
        # went, from its process's start to its first step.
        "startup_phases": dict(a.tl.get("startup") or {}),
    }


def _tail(src: _Sources, a: _Attempt, tail: float, s: dict[str, float]) -> None:
    """The time after the last record: shut-down after an end of the loop it recorded, a stall
    the watchdog named, else lost."""
    first = first_error.read(src.paths, a.n)
    if a.tl.get("outcome"):
        s["shutdown"] = tail
    elif first is not None and first.get("kind") == Cause.STALL:
        s["stalls"] = tail
    else:
        s["lost"] += tail


def _active(
    a: _Attempt, span: float, high: int, later: bool, running: bool, s: dict[str, float]
) -> dict[str, int]:
    """Split the time from the first step to the last record (``span``) into ``s``; returns the
    step counts. ``later``: a later attempt took over; ``running``: the attempt still runs."""
    phase = {k: max(0.0, float(v)) for k, v in (a.tl.get("seconds") or {}).items()}
    measured = sum(phase.get(k, 0.0) for k in ("train", "eval", "mining", "checkpoint"))
    scale = min(1.0, span / measured) if measured > 0 else 0.0
    train, ev, mi, ck = (
        phase.get(k, 0.0) * scale for k in ("train", "eval", "mining", "checkpoint")
    )
    s["other"] = max(0.0, span - (train + ev + mi + ck))
    trained = max(0, a.last_step - a.restored)
    per_step = train / trained if trained else 0.0
    again = min(max(0, min(a.last_step, high) - a.restored), trained)
    committed = max(int(a.commit.get("step", 0)), a.restored)
    clean = a.tl.get("outcome") == COMPLETED
    # Steps after the last commit that no later attempt took over (nor will: the run ended).
    lost_steps = 0 if later or running or clean else max(0, a.last_step - max(committed, high))
    s["recomputed"] = again * per_step
    s["lost"] = lost_steps * per_step
    s["productive"] = train - s["recomputed"] - s["lost"]
    if trained == 0:
        s["productive"], s["other"] = 0.0, s["other"] + train
    # Eval, mining and saves after the last commit of an attempt that ended without completing:
    # the next attempt resumes from that commit (or, with none, from where this one started).
    after = {k: 0.0 for k in ("eval", "mining", "checkpoint")}
    if not clean and not running:
        at_commit = a.commit.get("seconds") or {}
        after = {k: max(0.0, (phase.get(k, 0.0) - at_commit.get(k, 0.0)) * scale) for k in after}
    s["lost"] += sum(after.values())
    s["eval"], s["mining"] = ev - after["eval"], mi - after["mining"]
    s["checkpoint_stall"] = ck - after["checkpoint"]
    return {
        "restored": a.restored,
        "last": a.last_step,
        "committed": committed,
        "recomputed": again,
        "lost": lost_steps,
    }


def total_of(books: list[dict[str, Any]]) -> dict[str, Any]:
    """The total of several runs' ledgers (a sweep's members), in the form of one run's."""
    return _total([b["total"] for b in books])


def _total(rows: list[dict[str, Any]]) -> dict[str, Any]:
    s = {k: sum(r["seconds"][k] for r in rows) for k in CATEGORIES}
    gpu = {k: sum(r["gpu_seconds"][k] for r in rows) for k in CATEGORIES}
    allocated = sum(r["gpu_seconds"][k] for r in rows for k in CATEGORIES if k != "queue_wait")
    return {
        "wall_s": sum(r["wall_s"] for r in rows),
        "seconds": s,
        "gpu_seconds": gpu,
        "allocated_gpu_s": allocated,
        "ratio": gpu["productive"] / allocated if allocated > 0 else None,
    }


def scalars(book: dict[str, Any]) -> dict[str, float]:
    """The run's goodput for TensorBoard and the trackers: the ratio and GPU-hours per
    category."""
    total = book["total"]
    out = {f"goodput/{k}_gpu_h": v / 3600 for k, v in total["gpu_seconds"].items()}
    if total["ratio"] is not None:
        out["goodput/ratio"] = total["ratio"]
    return out


def render_sweep(sweep: dict[str, Any]) -> str:
    """The sweep's line under its members' tables: how many started, and their goodput."""
    total, members = sweep["total"], sweep["members"]
    waiting = sweep["not_started"]
    ratio = "-" if total["ratio"] is None else f"{total['ratio']:.1%}"
    return (
        f"sweep total: {len(members)} member{'s' if len(members) != 1 else ''} started"
        + (f" (not started: {', '.join(waiting)})" if waiting else "")
        + f", goodput {ratio} of {total['allocated_gpu_s'] / 3600:.2f} GPU-h allocated, "
        f"wall {total['wall_s']:.1f} s summed over them"
    )


def render(book: dict[str, Any]) -> str:
    """The table: one column per attempt and the total, one row per category (seconds)."""
    rows = book["attempts"]
    heads = [f"attempt {r['attempt']}" for r in rows] + ["total"]
    cols = [r["seconds"] for r in rows] + [book["total"]["seconds"]]
    width = max(12, *(len(h) + 1 for h in heads))
    lines = [f"{'seconds':<18}" + "".join(f"{h:>{width}}" for h in heads)]
    for k in CATEGORIES:
        lines.append(f"{LABELS[k]:<18}" + "".join(f"{c[k]:>{width}.1f}" for c in cols))
    walls = [r["wall_s"] for r in rows] + [book["total"]["wall_s"]]
    lines.append(f"{'wall':<18}" + "".join(f"{w:>{width}.1f}" for w in walls))
    lines.append(f"{'ranks':<18}" + "".join(f"{r['ranks']:>{width}}" for r in rows))
    ratios = [r["ratio"] for r in rows] + [book["total"]["ratio"]]
    lines.append(
        f"{'goodput':<18}" + "".join(f"{'-' if x is None else f'{x:.1%}':>{width}}" for x in ratios)
    )
    for r in rows:
        back = r.get("restart_in_job")
        if back is not None:
            rank = "" if back.get("rank") is None else f" of rank {back['rank']}"
            host = f" on {back['host']}" if back.get("host") else ""
            out = f"; left out {', '.join(back['left_out'])}" if back.get("left_out") else ""
            took = (
                "no step trained yet"
                if back.get("recovery_s") is None
                else f"back training {back['recovery_s']:.1f} s after the fault"
            )
            came = (
                f"; restored from the {back['restored_where']}"
                if back.get("restored_where") and back.get("restored_from") != "shared"
                else "; restored from the shared filesystem"
                if back.get("restored_from") == "shared"
                else ""
            )
            lost = (
                f"; {back['steps_lost']} step(s) trained again"
                if back.get("steps_lost") is not None
                else ""
            )
            lines.append(
                f"restart in job: attempt {r['attempt']} after a {back.get('cause')}{rank}{host}: "
                f"{took}{came}{lost}{out}"
            )
        f = r.get("fault")
        if f is not None:
            lines.append(
                f"fault: {faults.describe(f)}; charged {f['lost_s']:.1f} s "
                f"({f['downtime_s']:.1f} s without training + {f['retrained_s']:.1f} s training "
                "steps again)"
            )
        phases = r.get("startup_phases") or {}
        if phases:
            said = ", ".join(f"{k} {v:.1f}" for k, v in phases.items())
            lines.append(f"start-up of attempt {r['attempt']} (rank 0, s): {said}")
        for g in r["stragglers"]:
            lines.append(
                f"straggler: attempt {r['attempt']} rank {g['rank']} on {g['node']} "
                f"({g.get('ratio', 0):.2f}x the others' median)"
            )
    return "\n".join(lines)
