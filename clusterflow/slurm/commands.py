"""The Slurm commands clusterflow asks questions of: ``squeue``, ``scontrol``, ``sacct``,
``scancel`` and ``sinfo``, each through :func:`run`, which never hangs (every call has a timeout)
and never raises (a missing command, a timeout or an OS error is a :class:`Result` too).
``sbatch`` is started by submitit, from ``sbatch.py``.

One function per question, each with the answer its callers need. Login-node module: no torch.
"""

from __future__ import annotations

import dataclasses
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from clusterflow.errors import UserError


@dataclass(frozen=True)
class Result:
    """What one command said. ``returncode`` is None when it did not run to its end."""

    command: str  # argv[0]
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    missing: bool = False  # not on PATH
    timed_out: bool = False
    error: str = ""  # why it did not run to its end, as a sentence

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def why(self) -> str:
        """Why the command gave no answer: ``error``, else the last line of stderr, else its exit
        status."""
        if self.returncode is None:
            return self.error
        return (self.stderr.strip().splitlines() or [f"exit status {self.returncode}"])[-1]


def run(argv: list[str], timeout_s: float, *, outlive_term: bool = False) -> Result:
    """Run one Slurm command and capture its output (undecodable bytes replaced).

    ``outlive_term``: the command ignores SIGTERM. A job that requeues itself runs ``scontrol``
    as one of its own processes, and Slurm answers the requeue by sending SIGTERM to every process
    of the job: it could end ``scontrol`` after Slurm did the work and before it exits 0, and the
    job would read a requeue that happened as one that failed. SIGKILL follows ``KillWait``
    seconds later, so the command still cannot outlive the job."""
    name = argv[0]
    missing = Result(name, missing=True, error=f"{name} is not installed here")
    if shutil.which(name) is None:
        return missing
    try:
        p = _start(argv, outlive_term)
    except FileNotFoundError:
        return missing
    except OSError as exc:
        return Result(name, error=f"{name}: {exc}")
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        return Result(name, timed_out=True, error=f"{name} did not answer within {timeout_s:g} s")
    return Result(name, p.returncode, out, err)


def _start(argv: list[str], outlive_term: bool) -> subprocess.Popen[str]:
    """Start ``argv``; with ``outlive_term``, through ``sh``, which sets SIGTERM to ignored before
    it execs the command. An ignored signal stays ignored across exec, and a shell cannot undo one
    it inherited, so this holds for any command; no disposition of this process changes, and
    Slurm sends nothing before the command has asked it to requeue."""
    if outlive_term:
        argv = ["sh", "-c", 'trap "" TERM; exec "$0" "$@"', *argv]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace"
    )


# -- squeue ------------------------------------------------------------------------------------


def queue_state(job_id: str, timeout_s: float = 5) -> str | None:
    """``STATE|REASON`` while the job is queued (pending, running, completing...), "" once it is
    not (squeue no longer lists it, or no longer knows the id), None when squeue does not answer."""
    job_id = str(job_id or "")
    if not job_id or not job_id.replace("_", "").isdigit():
        return None
    out = run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"], timeout_s)
    if out.returncode is None:
        return None
    if not out.ok:
        # "Invalid job id": forgotten after MinJobAge, so long gone
        return "" if "Invalid job id" in out.stderr else None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""


@dataclass(frozen=True)
class QueuedJob:
    """A job as squeue lists it, with its times: ``time_limit_s`` (None: no limit),
    ``elapsed_s`` and ``left_s`` as of ``asked_at`` (seconds since 1970), ``start_at``: when it
    started, or while it is pending when Slurm's scheduler expects it to start (``squeue
    --start``'s START_TIME, the same ``%S``; None until the scheduler has planned it), ``nodes``
    (the nodes it runs on) and ``scheduled_nodes`` (while pending, where Slurm plans to start
    it)."""

    state: str
    reason: str = ""
    time_limit_s: float | None = None
    elapsed_s: float | None = None
    left_s: float | None = None
    start_at: float | None = None
    node_count: int | None = None
    nodes: str = ""
    scheduled_nodes: str = ""
    asked_at: float = 0.0

    @property
    def line(self) -> str:
        """``STATE|REASON``, as :func:`queue_state` answers."""
        return f"{self.state}|{self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# %i job (an array task as A_T with -r), %T state, %r reason, %l time limit, %M elapsed, %L left,
# %S start (expected while pending), %D node count, %N nodes, %Y nodes scheduled while pending
_QUEUED_FORMAT = "%i|%T|%r|%l|%M|%L|%S|%D|%N|%Y"


def slurm_duration(text: str) -> float | None:
    """Seconds of Slurm's ``[days-][hours:]minutes:seconds`` (or bare minutes, as a limit is
    written); None for ``UNLIMITED``, ``NOT_SET``, ``INVALID``, ``N/A`` or anything else."""
    text = text.strip()
    days, dash, clock = text.rpartition("-")
    parts = clock.split(":")
    if (dash and not days.isdigit()) or not all(p.isdigit() for p in parts) or len(parts) > 3:
        return None
    if days:  # days-hours[:minutes[:seconds]]
        parts += ["0"] * (3 - len(parts))
    elif len(parts) == 1:  # minutes (sbatch --time=90)
        parts += ["0"]
    seconds = 0
    for p in parts:
        seconds = seconds * 60 + int(p)
    return float(seconds + int(days or 0) * 86400)


def _queued(fields: list[str], asked_at: float) -> QueuedJob:
    state, reason, limit, elapsed, left, start, count, nodes, scheduled = fields
    return QueuedJob(
        state=state,
        reason=reason,
        time_limit_s=slurm_duration(limit),
        elapsed_s=slurm_duration(elapsed),
        left_s=slurm_duration(left),
        start_at=slurm_time(start),
        node_count=int(count) if count.isdigit() else None,
        nodes="" if nodes in ("", "(null)") else nodes,
        scheduled_nodes="" if scheduled in ("", "(null)") else scheduled,
        asked_at=asked_at,
    )


def queued_jobs(job_ids: Iterable[str], timeout_s: float = 5) -> dict[str, QueuedJob | None] | None:
    """Many jobs in one squeue call (the dashboard's runs, a run's ``status``): job id -> its
    :class:`QueuedJob`, or None for one squeue does not list; None when squeue does not answer.
    Ids that are not Slurm job ids are left out."""
    ids = sorted({str(j) for j in job_ids if str(j or "").replace("_", "").isdigit()})
    if not ids:
        return {}
    # -r: one line per array task (an array's pending tasks are otherwise listed as 12_[3-7])
    out = run(["squeue", "-h", "-r", "-j", ",".join(ids), "-o", _QUEUED_FORMAT], timeout_s)
    asked_at = time.time()
    if out.returncode is None:
        return None
    if not out.ok:
        # "Invalid job id": squeue forgot every one of them (MinJobAge), so all long gone
        return dict.fromkeys(ids) if "Invalid job id" in out.stderr else None
    listed: dict[str, QueuedJob] = {}
    for line in out.stdout.splitlines():
        fields = line.strip().split("|")
        if len(fields) == 10 and fields[0] and fields[1]:
            listed.setdefault(fields[0], _queued(fields[1:], asked_at))
    return {j: listed.get(j) for j in ids}


def queue_states(job_ids: Iterable[str], timeout_s: float = 5) -> dict[str, str] | None:
    """:func:`queue_state` of many jobs in one squeue call: job id -> ``STATE|REASON``, or ""
    for one squeue does not list; None when squeue does not answer."""
    jobs = queued_jobs(job_ids, timeout_s)
    if jobs is None:
        return None
    return {j: q.line if q is not None else "" for j, q in jobs.items()}


class Queue:
    """squeue's answers for the jobs one caller asks about, one squeue call per job id:
    :meth:`state` as :func:`queue_state` answers, :meth:`job` with its times."""

    def __init__(self, timeout_s: float = 5) -> None:
        self.timeout_s = timeout_s
        self._answers: dict[str, dict[str, QueuedJob | None] | None] = {}

    def _ask(self, job_id: str) -> dict[str, QueuedJob | None] | None:
        if job_id not in self._answers:
            self._answers[job_id] = queued_jobs([job_id], self.timeout_s)
        return self._answers[job_id]

    def state(self, job_id: str) -> str | None:
        job_id = str(job_id or "")
        if not job_id.replace("_", "").isdigit():
            return None  # not a Slurm job: squeue is not asked
        answer = self._ask(job_id)
        if answer is None:
            return None
        job = answer.get(job_id)
        return job.line if job is not None else ""

    def job(self, job_id: str) -> QueuedJob | None:
        answer = self._ask(str(job_id or ""))
        return (answer or {}).get(str(job_id))


def wait_until_gone(job_id: str, poll_s: float = 3.0) -> None:
    """Block until the job (or every task of an array) has left the queue. A requeued job stays
    in the queue, so this spans all its attempts; while squeue does not answer, it keeps asking."""
    while queue_state(job_id) != "":
        time.sleep(poll_s)


# -- scontrol ----------------------------------------------------------------------------------


def available(name: str) -> bool:
    """Whether the Slurm command ``name`` is on this process's PATH (a job in a container may have
    none: it cannot ask Slurm anything, nor requeue itself)."""
    return shutil.which(name) is not None


# JobState words of a job that still runs, or is back in the queue.
_LIVE = ("RUNNING", "PENDING", "CONFIGURING", "SUSPENDED", "RESIZING", "REQUEUED", "REQUEUE_")


def cancelled(fields: Mapping[str, str], restart_count: int) -> bool:
    """Whether ``scontrol show job``'s ``fields``, seen by the job's own attempt ``restart_count``,
    say the job was cancelled (a plain ``scancel``): CANCELLED, or COMPLETING with no requeue
    counted beyond that attempt after the cancel's SIGTERM ended the batch script (ExitCode
    ``0:15``, Reason None). A job's own processes hold it in COMPLETING until they end, so its
    ranks never see CANCELLED themselves; a batch script that died otherwise ends with a code
    (``137:0``, Reason NonZeroExitCode) or another signal, and a requeue counts a restart."""
    state, restarts = fields.get("JobState", ""), fields.get("Restarts", "")
    if state == "CANCELLED":
        return True
    return (
        state == "COMPLETING"
        and restarts.isdigit()
        and int(restarts) <= restart_count
        and fields.get("ExitCode") == f"0:{int(signal.SIGTERM)}"
        and fields.get("Reason") == "None"
    )


def not_requeued(job_id: str, fields: Mapping[str, str], restart_count: int) -> str | None:
    """Slurm's words that the job is ending, or ended, for good, from ``scontrol show job``'s
    ``fields`` seen by the job's own attempt ``restart_count`` (SLURM_RESTART_COUNT); None while
    it runs, when it was cancelled (:func:`cancelled`), when Slurm counted a requeue beyond that
    attempt (Restarts: ``scontrol requeue`` or a preemption under way), or when the fields do
    not say. Both a requeue and the end of a job whose batch script died show COMPLETING while
    the steps are being ended; only the requeue counts a restart."""
    state, restarts = fields.get("JobState", ""), fields.get("Restarts", "")
    if not state or state.startswith(_LIVE) or cancelled(fields, restart_count):
        return None
    if not restarts.isdigit():
        return None
    if int(restarts) > restart_count:
        return None
    said = ", ".join(
        f"{key} {fields[key]}" for key in ("JobState", "ExitCode", "Reason") if fields.get(key)
    )
    return f"Slurm ends job {job_id} without requeueing it ({said}; Restarts {restarts})"


def is_batch(job_id: str, timeout_s: float = 30) -> bool | None:
    """Whether the job is a batch job (``sbatch``), not an interactive allocation (``salloc``),
    whose steps Slurm refuses to requeue: ``BatchFlag`` of ``scontrol show job``; None when Slurm
    does not answer."""
    flag = job_fields(job_id, timeout_s).get("BatchFlag")
    return None if flag is None else flag != "0"


def show_job(job_id: str, timeout_s: float) -> Result:
    """``scontrol show job -o JOB``: one line of ``key=value`` words, for
    ``outcome.parse_scontrol``."""
    return run(["scontrol", "show", "job", "-o", str(job_id)], timeout_s)


def requeue(job_id: str, timeout_s: float = 60) -> Result:
    """``scontrol requeue JOB``: the job ends now and comes back to the queue with the same id."""
    return run(["scontrol", "requeue", str(job_id)], timeout_s, outlive_term=True)


def job_fields(job_id: str, timeout_s: float = 30) -> dict[str, str]:
    """The ``key=value`` words of ``scontrol show job -o JOB`` (empty when Slurm does not answer);
    a value with spaces (a reason) keeps only its first word."""
    out = run(["scontrol", "show", "job", "-o", str(job_id)], timeout_s)
    pairs = (word.split("=", 1) for word in out.stdout.split() if "=" in word)
    return {key: value for key, value in pairs} if out.ok else {}


@dataclass(frozen=True)
class JobEnd:
    """When Slurm ends a running job: ``end_at`` in seconds since 1970 (``scontrol show job``'s
    EndTime: its start plus its time limit, or what an admin set with ``scontrol update``), None
    for a job without a time limit; ``limit``: its TimeLimit as Slurm writes it."""

    end_at: float | None
    limit: str = ""


def job_end(job_id: str, timeout_s: float = 10) -> JobEnd | None:
    """Slurm's end of the running job ``job_id`` (an array task as ``A_T``), asked again at each
    call, so that a time limit an admin changed is seen; None when Slurm does not answer."""
    fields = job_fields(job_id, timeout_s)
    if "EndTime" not in fields:
        return None
    limit = fields.get("TimeLimit", "")
    unlimited = limit in ("UNLIMITED", "INFINITE") or fields["EndTime"] == "Unknown"
    return JobEnd(None if unlimited else slurm_time(fields["EndTime"]), limit)


def hostnames(expression: str, timeout_s: float = 10) -> list[str] | None:
    """The node names of a Slurm host list (``node[1-3],gpu7``), through ``scontrol show
    hostnames``; [] for an empty or ``(null)`` list, None when scontrol does not answer."""
    if expression in ("", "(null)", "None"):
        return []
    out = run(["scontrol", "show", "hostnames", expression], timeout_s)
    return out.stdout.split() if out.ok else None


def exclude_nodes(job_id: str, nodes: list[str], timeout_s: float = 30) -> Result:
    """``scontrol update JobId=JOB ExcNodeList=...``: the job's excluded nodes become ``nodes``
    (the caller passes the whole list). Slurm takes it only while the job is pending: after
    ``scontrol requeue``, before the job starts again."""
    return run(
        ["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"],
        timeout_s,
        outlive_term=True,  # run while Slurm ends the job after its requeue
    )


# -- sacct -------------------------------------------------------------------------------------


def sacct(job_id: str, fields: str, timeout_s: float) -> Result:
    """``sacct -j JOB -D -P -n --format=FIELDS``: the job and step rows of every attempt, with
    the fields ``|``-separated."""
    return run(["sacct", "-j", str(job_id), "-D", "-P", "-n", f"--format={fields}"], timeout_s)


_ENDED = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "PREEMPTED",
    "NODE_FAIL",
    "OUT_OF_ME",
    "BOOT_FAIL",
    "DEADLINE",
    "REQUEUED",
)


def slurm_time(text: str) -> float | None:
    """Seconds since 1970 from Slurm's local ``YYYY-MM-DDTHH:MM:SS`` (None for Unknown, None,
    an empty field)."""
    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def job_runs(job_id: str, timeout_s: float = 10) -> tuple[list[dict[str, Any]], str]:
    """Each run of a job (a requeue starts another), oldest first: ``{"restart", "submit",
    "start", "end", "state", "source"}``, and where they came from. ``sacct`` lists every run
    (with slurmdbd); without it, ``scontrol show job`` knows the newest run while Slurm still
    remembers the job (``restart`` from its Restarts; ``end`` only once it ended); ([], why)
    when neither answers."""
    out = sacct(job_id, "JobIDRaw,Submit,Start,End,State", timeout_s)
    if out.ok and out.stdout.strip():
        rows = [line.split("|") for line in out.stdout.splitlines() if line.count("|") >= 4]
        runs = [r for r in rows if r[0] == str(job_id)]
        return [
            {
                "restart": i,
                "submit": slurm_time(r[1]),
                "start": slurm_time(r[2]),
                "end": slurm_time(r[3]),
                "state": r[4].split()[0] if r[4] else "",
                "source": "sacct",
            }
            for i, r in enumerate(runs)
        ], "sacct"
    fields = job_fields(job_id, timeout_s)
    if not fields:
        return [], f"sacct: {out.why() or 'no rows'}; scontrol does not know job {job_id}"
    state = fields.get("JobState", "")
    try:
        restart = int(fields.get("Restarts", "0"))
    except ValueError:
        restart = 0
    return [
        {
            "restart": restart,
            "submit": slurm_time(fields.get("SubmitTime", "")),
            "start": slurm_time(fields.get("StartTime", "")),
            "end": slurm_time(fields.get("EndTime", "")) if state.startswith(_ENDED) else None,
            "state": state,
            "source": "scontrol",
        }
    ], "scontrol"


# -- scancel -----------------------------------------------------------------------------------


def cancel(job_ids: list[str], timeout_s: float = 30) -> None:
    """Run ``scancel`` on the ids; a failure raises UserError naming it (the cancel markers are
    written before, and stay)."""
    if not job_ids:
        return
    ids = " ".join(job_ids)
    out = run(["scancel", *job_ids], timeout_s)
    if out.missing:
        raise UserError(
            f"scancel is not on PATH, so jobs {ids} still run (they are marked "
            f"cancelled and will not requeue); run scancel {ids} on a Slurm login node"
        )
    if out.timed_out:
        raise UserError(
            f"scancel {ids} did not answer within {timeout_s:.0f} s (is slurmctld up?); "
            f"the runs are marked cancelled and will not requeue; run the same command "
            f"again"
        )
    if not out.ok:
        message = out.error if out.returncode is None else (out.stderr or out.stdout).strip()
        # A job that already left the queue is what we wanted; anything else is reported.
        if "Invalid job id" not in message and "already completing or completed" not in message:
            raise UserError(
                f"scancel {ids} failed: {message}; the runs are marked cancelled and "
                f"will not requeue; check squeue and scancel by hand"
            )


# -- sinfo -------------------------------------------------------------------------------------


def partition_nodes(partition: str, timeout_s: float = 10) -> str | None:
    """The host list of a partition's nodes (``sinfo -h -p PART -o %N``), None when sinfo does not
    answer."""
    out = run(["sinfo", "-h", "-p", partition, "-o", "%N"], timeout_s)
    return ",".join(out.stdout.split()) if out.ok else None


def partitions(timeout_s: float = 10) -> list[list[str]] | None:
    """One row per partition and node kind: [name (``*`` marks the default), nodes, cpus, gres],
    or None when sinfo does not answer."""
    out = run(["sinfo", "-h", "-o", "%P|%D|%c|%G"], timeout_s)
    if not out.ok:
        return None
    return [line.split("|") for line in out.stdout.split() if "|" in line]
