"""What Slurm says about a job: is it still queued (``squeue``, with a timeout: used by status and the
lease), and which task srun saw fail first (from the job's output)."""

from __future__ import annotations

import re
import shutil
import subprocess


def state(job_id: str, timeout_s: float = 5) -> str | None:
    """``STATE|REASON`` while the job is queued (pending, running, completing...), "" once it is
    not (squeue no longer lists it, or no longer knows the id), None when squeue does not answer."""
    job_id = str(job_id or "")
    if not job_id or not job_id.replace("_", "").isdigit() or shutil.which("squeue") is None:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"], capture_output=True, text=True, timeout=timeout_s)
    except (subprocess.TimeoutExpired, OSError):
        return None
    if out.returncode != 0:
        return "" if "Invalid job id" in out.stderr else None  # forgotten after MinJobAge: long gone
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""


_SRUN_ERROR = re.compile(r"^srun: error: (\S+): tasks? (\d+)[\d,-]*: (.+)$", re.M)


def first_task_failure(text: str) -> tuple[int, str, str] | None:
    """(rank, node, what) of the first task srun reported as failed in a job's output
    (``srun: error: node2: task 1: Killed``), or None. With ``--kill-on-bad-exit`` srun ends the
    other tasks right after it, so their own errors ("connection reset") come from that one."""
    m = _SRUN_ERROR.search(text)
    return (int(m.group(2)), m.group(1), m.group(3).strip()) if m else None
