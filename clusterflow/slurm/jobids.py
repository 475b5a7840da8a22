"""Slurm job ids: which id requeues this job (or array task) alone, and what a job id looks like.

A job-array task has two ids: its own ``SLURM_JOB_ID`` and
``<SLURM_ARRAY_JOB_ID>_<SLURM_ARRAY_TASK_ID>``. For one task of every array the two numbers look
alike: its SLURM_JOB_ID *is* the array's id, and ``scontrol requeue <array id>`` requeues every
task of the array (Lightning #15022). So a requeue always names the task as ``A_T``.

Which job a run dir is held by is ``clusterflow.rundir.submissions``. Pure functions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

SLURM_ID = re.compile(r"^\d+(_\d+)?$")
# Attempt sources (DistEnv.source) whose job_id is a Slurm job id; torchrun inside sbatch reports
# SLURM_JOB_ID.
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
