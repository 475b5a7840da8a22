"""Is anything of a run still alive? What ``status`` asks before it repeats "running".

``status.json`` holds what the run last wrote; a run ended by SIGKILL, the OOM killer or a node
failure writes nothing more, so a claimed "running" is checked against what can be seen:

- a Slurm job: ``squeue`` (a job that left the queue runs nowhere);
- the processes each attempt recorded when it started (``attempts.jsonl``: host, pid, process start
  time): those on this host, by pid;
- elsewhere: the run dir's lease, which rank 0 renews while the job lives (``lease.judge``).

The last sign of life is the newest of status.json's and the lease's modification times.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clusterflow import rundir
from clusterflow.rundir import lease, records
from clusterflow.slurm import commands as slurm_commands


@dataclass(frozen=True)
class Liveness:
    alive: bool | None  # None: nothing seen can tell
    last_seen: float | None  # the last sign of life (epoch seconds)
    how: str  # what was checked, for the reader

    def note(self, last_step: object) -> str:
        since = (
            time.strftime("%H:%M:%S", time.localtime(self.last_seen))
            if self.last_seen
            else "its start"
        )
        return f"no live process since {since} ({self.how}); last step {last_step}"


def _last_seen(paths: rundir.RunPaths) -> float | None:
    times = []
    for path in [paths.status] + _lease_files(paths):
        try:
            times.append(os.stat(path).st_mtime)
        except OSError:
            pass
    return max(times) if times else None


def _lease_files(paths: rundir.RunPaths) -> list[str]:
    try:
        return [
            os.path.join(paths.lease, n)
            for n in os.listdir(paths.lease)
            if lease.generation(n) is not None
        ]
    except OSError:
        return []


def check(
    paths: rundir.RunPaths,
    attempt: dict[str, Any],
    queue: str | None,
    queue_state: Callable[[str], str | None] = slurm_commands.queue_state,
) -> Liveness:
    """``attempt``: the last line of attempts.jsonl; ``queue``: squeue's answer for its Slurm job
    (None when it is not a Slurm job or squeue did not answer); ``queue_state``: how to ask
    squeue about the job holding the lease."""
    seen = _last_seen(paths)
    if queue is not None:
        job = attempt.get("job_id")
        return Liveness(
            bool(queue),
            seen,
            f"Slurm job {job} is {queue.split('|')[0]}"
            if queue
            else f"Slurm job {job} is no longer queued",
        )
    host = socket.gethostname()
    procs = [p for p in attempt.get("procs") or [] if isinstance(p, list) and len(p) == 3]
    here = [(pid, start) for h, pid, start in procs if h == host]
    alive = [
        pid for pid, start in here if isinstance(pid, int) and lease.process_start(pid) == start
    ]
    if alive:
        return Liveness(True, seen, f"process {alive[0]} is alive on {host}")
    if procs and len(here) == len(procs):
        return Liveness(False, seen, f"its {len(procs)} process(es) on {host} are gone")
    gen, rec, age = lease.current(paths)
    if gen:
        # Only the fields that fit the lease's schema: a hand-edited one must not stop status.
        rec, _ = records.checked(rec or {}, records.LEASE, "lease")
        ok, why = lease.judge(rec or {}, age, lease.identity(), queue_state)
        return Liveness(ok, seen, f"the job holding its lease: {why}")
    # Rank 0, the lease holder, ran here: gone, and it left no lease.
    if procs and procs[0][0] == host:
        return Liveness(
            False, seen, f"rank 0's process on {host} is gone and the run holds no lease"
        )
    return Liveness(None, seen, "its processes run on other hosts and it holds no lease")
