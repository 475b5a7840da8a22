"""python -m clusterflow.cancel RUN_DIR|SWEEP_DIR

Stop a run (or every unfinished member of a sweep) for good: write ``RUN_DIR/cancelled.json``
first, then ``scancel`` the run's current Slurm job. The marker comes first so that a job which
catches the cancel's SIGTERM and would requeue itself sees it and does not; status reports
``cancelled`` from the marker; a resubmitted sweep skips cancelled members. Submitting a single
run again is the explicit way back (submit clears its marker with :func:`clear`).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

from clusterflow import rundir
from clusterflow.storage import durable
from clusterflow.slurm import jobids
from clusterflow.sweeps import index as sweep_index
from clusterflow.errors import EXIT_OK, UserError, cli

# States after which a job may still hold the run (status.json can lag behind a crash; scancel of a
# finished job only costs a warning).
STOPPED = ("completed", "failed", "stopped", "cancelled")
EXAMPLES = """examples:
  python -m clusterflow.cancel runs/exp1          # one run
  python -m clusterflow.cancel runs/lr-sweep      # every unfinished member of a sweep
"""


def is_cancelled(run_dir: str) -> bool:
    """True once a user cancelled the run: the job must neither requeue nor start training."""
    return os.path.exists(rundir.RunPaths(run_dir).cancelled)


def mark_cancelled(run_dir: str, job_id: str | None, now: float | None = None) -> None:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    record = {"cancelled_at": time.time() if now is None else now, "job_id": job_id, "by": f"{user}@{socket.gethostname()}"}
    durable.write_atomic(rundir.RunPaths(run_dir).cancelled, json.dumps(record, indent=1))


def clear(run_dir: str) -> bool:
    """Remove the marker (an explicit resubmission of this run). Returns True when there was one."""
    try:
        os.remove(rundir.RunPaths(run_dir).cancelled)
        return True
    except FileNotFoundError:
        return False


def effective_state(run_dir: str, state: str) -> str:
    """What status shows: cancelled wins over anything but completed (the job may have finished
    just before the cancel arrived)."""
    return "cancelled" if state != "completed" and is_cancelled(run_dir) else state


def runs_of(target: str) -> list[str]:
    """The run dirs behind RUN_DIR or SWEEP_DIR."""
    if not os.path.isdir(target):
        raise UserError(f"{target!r} does not exist; pass a run dir or a sweep dir (the run.dir you submitted)")
    index = sweep_index.read_index(target) if sweep_index.is_sweep_dir(target) else None
    if index is not None:
        return list(sweep_index.member_dirs(target, index).values())
    if not os.path.exists(rundir.RunPaths(target).config):
        raise UserError(f"{target!r} holds neither config.yaml nor sweep.json: not a clusterflow run or sweep dir")
    return [target]


def job_state(run_dir: str) -> str | None:
    """The state the run's job last wrote (not the marker's: after a failed scancel, cancelling
    again retries it), or None when a submission is newer than it (a resubmitted job may be pending)."""
    paths = rundir.RunPaths(run_dir)
    st = rundir.read_json(paths.status, {}) or {}
    submitted = [float(r.get("submitted_at") or 0) for r in rundir.read_jsonl(paths.submissions)]
    if submitted and max(submitted) > float(st.get("updated_at") or 0):
        return None
    return st.get("state")


def targets(runs: list[tuple[str, str | None, str | None]]) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """From (run_dir, state, job id): (run dirs to mark, (run dir, job id) pairs to scancel, notes).

    Completed runs are left alone. Every other run is marked, so that it never comes back by
    itself; its job is cancelled unless status says the job already ended.
    """
    mark, kill, notes = [], [], []
    for run_dir, state, job_id in runs:
        if state == "completed":
            notes.append(f"{run_dir}: already completed; left alone")
            continue
        mark.append(run_dir)
        if state == "cancelled":
            notes.append(f"{run_dir}: already cancelled")
        elif state in STOPPED:
            notes.append(f"{run_dir}: {state}; marked cancelled so that it is not resumed")
        elif job_id is None:
            notes.append(f"{run_dir}: no Slurm job known (a local run stops with Ctrl-C in its terminal); marked cancelled")
        else:
            kill.append((run_dir, job_id))
    return mark, kill, notes


def scancel(job_ids: list[str], timeout: float = 30) -> None:
    """Run ``scancel`` on the ids; a failure raises UserError naming it (the markers stay written)."""
    if not job_ids:
        return
    if shutil.which("scancel") is None:
        raise UserError(f"scancel is not on PATH, so jobs {' '.join(job_ids)} still run (they are marked cancelled and "
                        f"will not requeue); run scancel {' '.join(job_ids)} on a Slurm login node")
    try:
        out = subprocess.run(["scancel", *job_ids], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UserError(f"scancel {' '.join(job_ids)} did not answer within {timeout:.0f} s (is slurmctld up?); the runs "
                        f"are marked cancelled and will not requeue; run the same command again") from None
    if out.returncode != 0:
        message = (out.stderr or out.stdout).strip()
        # A job that already left the queue is what we wanted; anything else is reported.
        if "Invalid job id" not in message and "already completing or completed" not in message:
            raise UserError(f"scancel {' '.join(job_ids)} failed: {message}; the runs are marked cancelled and will not "
                            f"requeue; check squeue and scancel by hand")


def cancel(target: str) -> list[str]:
    """Mark and scancel; returns the lines to print."""
    runs: list[tuple[str, Any, Any]] = []
    skipped = []
    for run_dir in runs_of(target):
        if not os.path.exists(rundir.RunPaths(run_dir).config):
            skipped.append(f"{run_dir}: never submitted; nothing to cancel")
            continue
        runs.append((run_dir, job_state(run_dir), jobids.current_job_id(run_dir)))
    mark, kill, notes = targets(runs)
    ids = {run_dir: job for run_dir, job in kill}
    for run_dir in mark:
        mark_cancelled(run_dir, ids.get(run_dir))
    scancel(list(dict.fromkeys(ids.values())))
    return skipped + notes + [f"{run_dir}: cancelled job {job}" for run_dir, job in kill]


@cli
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clusterflow.cancel", description="Cancel a run or a sweep for good.",
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", metavar="RUN_DIR|SWEEP_DIR")
    args = p.parse_args(argv)
    for line in cancel(args.dir):
        print(line)
    return EXIT_OK

