"""Which Slurm job a run is: the id to requeue, to cancel, and to depend on.

A job-array task has two ids: its own ``SLURM_JOB_ID`` and ``<SLURM_ARRAY_JOB_ID>_<SLURM_ARRAY_TASK_ID>``.
For one task of every array the two numbers look alike: its SLURM_JOB_ID *is* the array's id, and
``scontrol requeue <array id>`` requeues every task of the array (Lightning #15022). So a requeue
always names the task as ``A_T``.

A run's current job: ``submit`` appends ``{"job_id", "submitted_at"}`` to ``RUN_DIR/submissions.jsonl``
(:func:`record_submission`); each attempt appends its ``job_id`` to ``attempts.jsonl``. The newest
record of the two wins, so a pending job (no attempt yet) and a resubmitted run both answer right.
"""

from __future__ import annotations

import re
import time
from typing import Mapping

from clusterflow import rundir
from clusterflow.errors import UserError

SLURM_ID = re.compile(r"^\d+(_\d+)?$")
# Attempt sources (DistEnv.source) whose job_id is a Slurm job id; torchrun inside sbatch reports SLURM_JOB_ID.
SLURM_SOURCES = ("slurm", "torchrun")


def requeue_target(environ: Mapping[str, str]) -> str | None:
    """The id to pass to ``scontrol requeue`` so that only this job (or array task) comes back,
    or None when the environment does not say which task this is (better no requeue than all)."""
    job = (environ.get("SLURM_JOB_ID") or "").strip()
    array = (environ.get("SLURM_ARRAY_JOB_ID") or "").strip()
    task = (environ.get("SLURM_ARRAY_TASK_ID") or "").strip()
    if array or task:
        if array.isdigit() and task.isdigit():
            return f"{array}_{task}"
        if job.isdigit() and array.isdigit() and job != array:
            return job  # this task's own id: not the array's, so it requeues this task alone
        return None
    return job if job.isdigit() else None


def is_slurm_id(job_id: str | None) -> bool:
    return bool(job_id) and bool(SLURM_ID.match(str(job_id)))


def record_submission(run_dir: str, job_id: str, now: float | None = None) -> None:
    """Called by submit for every run dir it submits to Slurm (one run, or each member of a sweep)."""
    if not is_slurm_id(job_id):
        raise ValueError(f"not a Slurm job id: {job_id!r}")  # a programming error: local runs are not recorded
    rundir.append_jsonl(rundir.RunPaths(run_dir).submissions,
                        {"job_id": str(job_id), "submitted_at": time.time() if now is None else now})


def current_job_id(run_dir: str) -> str | None:
    """The Slurm job that holds the run now (or held it last), or None (never submitted to Slurm:
    a local run, whose job id is a process id that must never reach scancel, or a run by hand)."""
    paths = rundir.RunPaths(run_dir)
    records = [(float(r.get("submitted_at") or 0), str(r.get("job_id") or "")) for r in rundir.read_jsonl(paths.submissions)]
    records += [(float(r.get("started_at") or 0), str(r.get("job_id") or ""))
                for r in rundir.read_jsonl(paths.attempts) if r.get("source") in SLURM_SOURCES]
    records = [r for r in records if is_slurm_id(r[1])]
    return max(records, key=lambda r: r[0])[1] if records else None


def after_dependency(runs: list[tuple[str, str | None, str | None]]) -> str | None:
    """``--after RUN_DIR`` (repeatable) -> the ``--dependency`` value, from (run_dir, state, job id).

    A completed run needs no dependency (Slurm forgets finished jobs, and ``afterok`` on a
    forgotten id is refused). A failed, stopped or cancelled run would never satisfy ``afterok``,
    so it is refused rather than leaving the new job pending forever.
    """
    ids = []
    for run_dir, state, job_id in runs:
        if state == "completed":
            continue
        if state in ("failed", "stopped", "cancelled"):
            raise UserError(f"--after {run_dir}: that run is {state}, so a job waiting for it to complete would never start; "
                            f"resume it first (submit its config again), then submit this one with --after")
        if not is_slurm_id(job_id):
            raise UserError(f"--after {run_dir}: no Slurm job is known for that run (state {state or 'unknown'}); "
                            f"--after needs a run submitted to Slurm with clusterflow.submit")
        ids.append(str(job_id))
    return "afterok:" + ":".join(dict.fromkeys(ids)) if ids else None
