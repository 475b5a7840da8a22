"""Is a Slurm job still queued? One question to ``squeue``, with a timeout (used by status and the lease)."""

from __future__ import annotations

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
