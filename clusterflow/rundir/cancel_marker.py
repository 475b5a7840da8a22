"""``RUN_DIR/cancelled.json``: a user cancelled the run, for good.

``clusterflow cancel`` writes it before it asks Slurm to end the job, so a job that catches the
cancel's SIGTERM and would requeue itself sees it and does not; ``status`` shows ``cancelled``
from it; a resubmitted sweep skips cancelled members. Submitting a run again is the explicit way
back (``submit`` clears the marker).
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import time

from clusterflow.errors import UserError
from clusterflow.rundir.paths import RunPaths
from clusterflow.storage import durable


def is_cancelled(paths: RunPaths) -> bool:
    """True once a user cancelled the run: the job must neither requeue nor start training."""
    return os.path.exists(paths.cancelled)


def mark(paths: RunPaths, job_id: str | None, now: float | None = None) -> None:
    """Record the cancel: when, which job, by whom."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    record = {
        "cancelled_at": time.time() if now is None else now,
        "job_id": job_id,
        "by": f"{user}@{socket.gethostname()}",
    }
    target = paths.cancelled
    try:
        durable.write_atomic(target, json.dumps(record, indent=1))
    except OSError as exc:  # a folder in its place, a read-only run dir
        raise UserError(
            f"cannot write the cancel marker {target} ({type(exc).__name__}: {exc.strerror}); "
            "make the run dir writable (remove a folder of that name) and cancel again"
        ) from None


def clear(paths: RunPaths) -> bool:
    """Remove the marker (an explicit resubmission of this run). True when there was one."""
    try:
        os.remove(paths.cancelled)
        return True
    except FileNotFoundError:
        return False
