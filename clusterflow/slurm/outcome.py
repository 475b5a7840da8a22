"""Why Slurm ended a job: OUT_OF_MEMORY, NODE_FAIL, TIMEOUT, CANCELLED, PREEMPTED, FAILED or
COMPLETED.

:func:`ask` runs ``sacct -j JOB -D -P -n --format=JobID,State,ExitCode,Reason,Start,End,NodeList``
(with a timeout: a slow slurmdbd must not hang `status`) and, when sacct does not answer (no
slurmdbd, as on our local test cluster: "Slurm accounting storage is disabled"), falls back to
``scontrol show job -o JOB``, which knows the job until MinJobAge after its end, and says that
sacct was unavailable. The parsers are pure functions over the commands' text.

sacct prints one row for the job and one per step (``1234.batch``, ``1234.extern``, ``1234.0``);
an OOM kill often shows only on a step while the job row says FAILED or CANCELLED, so the steps of
the last attempt are read too. ``-D`` (``--duplicates``) makes sacct print every attempt of a
requeued job (without it sacct shows only the most recent record); the verdict is the last
attempt's, and ``attempts`` counts them. ExitCode is ``code:signal``.

:func:`first_task_failure` reads the job's own output for the task srun saw fail first. The
commands run through ``commands.py``.
"""

from __future__ import annotations

import re
import signal as _signal
from dataclasses import asdict, dataclass, replace
from typing import Any

from clusterflow.errors import EXIT_STALLED
from clusterflow.slurm import commands

# Start/End: for the reader. The fields are parsed by position.
SACCT_FORMAT = "JobID,State,ExitCode,Reason,Start,End,NodeList"
ENDED = (
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "TIMEOUT",
    "CANCELLED",
    "PREEMPTED",
    "FAILED",
    "COMPLETED",
    "BOOT_FAIL",
    "DEADLINE",
    "REVOKED",
)


@dataclass(frozen=True)
class Verdict:
    # Slurm's state word (OUT_OF_MEMORY, ...), RUNNING/PENDING/REQUEUED while alive, UNKNOWN.
    state: str
    source: str  # "sacct", "scontrol" or "none"
    exit_code: int | None = None
    signal: int | None = None
    by: str | None = None  # "CANCELLED by <uid>"
    reason: str | None = None
    nodes: str | None = None
    # The step that decided, e.g. 1234.0 for an OOM kill seen on a step only.
    step: str | None = None
    attempts: int = 1
    note: str | None = None

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"line": self.line()}

    def line(self) -> str:
        """One sentence for `status`: what happened and, where it helps, what to do."""
        text = f"{self.state}: {_explain(self)}"
        if self.attempts > 1:
            text += f" (last of {self.attempts} attempts)"
        return text + (f"; {self.note}" if self.note else "")


def _exit(v: Verdict) -> str:
    if v.signal:
        try:
            name = _signal.Signals(v.signal).name
        except ValueError:
            name = f"signal {v.signal}"
        return f"killed by signal {v.signal} ({name})"
    return f"exit code {v.exit_code}" if v.exit_code is not None else "no exit code"


def _explain(v: Verdict) -> str:
    where = f" on {v.nodes}" if v.nodes and v.nodes not in ("None assigned", "(null)") else ""
    step = f"step {v.step}" if v.step else "a task"
    return {
        "OUT_OF_MEMORY": (
            f"{step} was killed for exceeding its host memory{where}; a CUDA out-of-memory is a "
            "Python error in the rank log instead; raise cluster.mem_gb or lower data.num_workers"
        ),
        "NODE_FAIL": (
            f"a node failed{where}; resubmit the same config to resume from the last checkpoint"
        ),
        "TIMEOUT": (
            "the time limit was reached; raise cluster.time_min or resubmit to resume from the "
            "last checkpoint"
        ),
        "CANCELLED": f"cancelled{' by uid ' + v.by if v.by else ''} (scancel or an administrator)",
        "PREEMPTED": "preempted by a higher-priority job and not requeued; resubmit to resume",
        "FAILED": (
            f"{_exit(v)}: a rank's stall watchdog ended it, see errors/first.attempt*.json"
            if v.exit_code == EXIT_STALLED
            else f"{_exit(v)}{where}; see the rank logs"
        ),
        "COMPLETED": (
            f"the job script exited 0, but step {v.step} was {_exit(v)}"
            if v.step
            else "exit code 0"
        ),
        "UNKNOWN": "Slurm no longer knows this job",
    }.get(
        v.state,
        f"{_exit(v)}{where}" + (f", reason {v.reason}" if v.reason and v.reason != "None" else ""),
    )


def _code(text: str) -> tuple[int | None, int | None]:
    m = re.fullmatch(r"(\d+):(\d+)", text.strip())
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


def _state(text: str) -> tuple[str, str | None]:
    """``CANCELLED by 1000`` -> ("CANCELLED", "1000"); ``OUT_OF_ME+`` (sacct truncation) is not
    produced with -P."""
    parts = text.strip().split()
    if not parts:
        return "UNKNOWN", None
    by = parts[2] if len(parts) >= 3 and parts[1] == "by" else None
    return parts[0].rstrip("+"), by


def _attempts(rows: list[dict[str, str]]) -> list[list[dict[str, str]]]:
    """Group rows into attempts: a job row starts one (a repeat of the first job id), steps follow
    it. Heterogeneous-job components (1234+0, 1234+1) stay in one attempt."""
    out: list[list[dict[str, str]]] = []
    first_id = None
    for row in rows:
        is_step = "." in row["JobID"]
        if not is_step and (first_id is None or row["JobID"] == first_id):
            first_id = first_id or row["JobID"]
            out.append([])
        if out:
            out[-1].append(row)
    return out


def parse_sacct(text: str) -> Verdict | None:
    """``sacct -D -P -n --format=SACCT_FORMAT`` output -> the last attempt's verdict (None when
    empty)."""
    names = SACCT_FORMAT.split(",")
    # a job id starts with a digit: skips a header line (sacct without -n) and error text
    rows = [
        dict(zip(names, line.split("|")))
        for line in text.splitlines()
        if re.match(r"\d", line) and "|" in line
    ]
    rows = [r | {k: "" for k in names if k not in r} for r in rows]
    attempts = _attempts(rows)
    if not attempts:
        return None
    last = attempts[-1]  # sacct lists a job's records oldest first
    job, steps = last[0], last[1:]
    state, by = _state(job["State"])
    code, sig = _code(job["ExitCode"])
    decided = None
    if state == "COMPLETED":
        # the batch script exited 0, yet an srun step may have died of a signal (an unhandled
        # SIGUSR1, say)
        decided = next((s for s in steps if _code(s["ExitCode"])[1]), None)
    else:
        oom = [s for s in last if _state(s["State"])[0] == "OUT_OF_MEMORY"]
        if oom:
            state, decided = "OUT_OF_MEMORY", oom[0]
        elif state == "FAILED" and not (code or sig):
            # the step that failed
            decided = next((s for s in steps if any(_code(s["ExitCode"]))), None)
    if decided is not None and decided is not job:
        code, sig = _code(decided["ExitCode"])
    return Verdict(
        state=state,
        source="sacct",
        exit_code=code,
        signal=sig,
        by=by,
        reason=job["Reason"] or None,
        nodes=job["NodeList"] or None,
        step=decided["JobID"] if decided is not None else None,
        attempts=len(attempts),
    )


_SCONTROL_KEYS = ("JobState", "Reason", "ExitCode", "Restarts", "NodeList")


def parse_scontrol(text: str) -> Verdict | None:
    """``scontrol show job -o JOB`` -> a verdict (None when the job is unknown). Keys are matched by
    name because Command= may hold spaces and ``key=value`` words of its own."""
    line = next((ln for ln in text.splitlines() if "JobState=" in ln), None)
    if line is None:
        return None
    found: dict[str, str] = {}
    for key in _SCONTROL_KEYS:
        m = re.search(rf"(?:^|\s){key}=(\S*)", line)
        if m:
            found[key] = m.group(1)
    state, _ = _state(found.get("JobState", ""))
    code, sig = _code(found.get("ExitCode", ""))
    restarts = int(found["Restarts"]) if found.get("Restarts", "").isdigit() else 0
    return Verdict(
        state=state,
        source="scontrol",
        exit_code=code,
        signal=sig,
        reason=found.get("Reason") or None,
        nodes=found.get("NodeList") or None,
        attempts=restarts + 1,
    )


_SRUN_ERROR = re.compile(r"^srun: error: (\S+): tasks? (\d+)[\d,-]*: (.+)$", re.MULTILINE)


def first_task_failure(text: str) -> tuple[int, str, str] | None:
    """(rank, node, what) of the first task srun reported as failed in a job's output
    (``srun: error: node2: task 1: Killed``), or None. With ``--kill-on-bad-exit`` srun ends the
    other tasks right after it, so their own errors ("connection reset") come from that one."""
    m = _SRUN_ERROR.search(text)
    return (int(m.group(2)), m.group(1), m.group(3).strip()) if m else None


def ask(job_id: str, timeout_s: float = 10.0) -> Verdict:
    """Ask sacct, then scontrol; never raises. ``note`` says when sacct could not answer."""
    if not re.fullmatch(r"[0-9]+(_[0-9]+)?", str(job_id)):
        return Verdict("UNKNOWN", "none", note=f"{job_id!r} is not a Slurm job id")
    out = commands.sacct(job_id, SACCT_FORMAT, timeout_s)
    why = out.why()
    if out.ok:
        verdict = parse_sacct(out.stdout)
        if verdict is not None:
            return verdict
        why = "it has no record of the job yet"
    out = commands.show_job(job_id, timeout_s)
    verdict = parse_scontrol(out.stdout) if out.ok else None
    if verdict is not None:
        return replace(verdict, note=f"sacct unavailable ({why}); this is scontrol's record")
    sc_why = ("" if out.ok else out.why()) or "no record (expired after MinJobAge)"
    return Verdict("UNKNOWN", "none", note=f"sacct unavailable ({why}); scontrol: {sc_why}")
