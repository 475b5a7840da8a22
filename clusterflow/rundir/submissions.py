"""Which Slurm job holds a run dir: what ``submit`` recorded and what the attempts ran as.

``submit`` appends ``{"job_id", "submitted_at"}`` to ``RUN_DIR/submissions.jsonl`` for every run
dir it submits to Slurm (:func:`record_submission`); each attempt appends its ``job_id`` to
``attempts.jsonl``. The newest record of the two wins (:func:`current_job_id`), so a pending job
(no attempt yet) and a resubmitted run both answer right. ``cancel``, ``status`` and ``--after``
ask it.
"""

from __future__ import annotations

import time

from clusterflow.rundir.paths import RunPaths
from clusterflow.rundir.records import ATTEMPT, SUBMISSION, append_jsonl, read_records
from clusterflow.slurm.jobids import SLURM_SOURCES, is_slurm_id


def record_submission(paths: RunPaths, job_id: str, now: float | None = None) -> None:
    """Called by submit for every run dir it submits to Slurm (one run, or each sweep member)."""
    if not is_slurm_id(job_id):
        # a programming error: local runs are not recorded
        raise ValueError(f"not a Slurm job id: {job_id!r}")
    append_jsonl(
        paths.submissions,
        {"job_id": str(job_id), "submitted_at": time.time() if now is None else now},
    )


def current_job_id(paths: RunPaths, damaged: list[str] | None = None) -> str | None:
    """The Slurm job that holds the run now (or held it last), or None (never submitted to Slurm:
    a local run, whose job id is a process id that must never reach scancel, or a run by hand).
    A record that does not fit its schema is named in ``damaged`` (when given) and the fields
    that do not fit are ignored."""
    submitted, said = read_records(paths.submissions, SUBMISSION)
    attempts, _ = read_records(paths.attempts, ATTEMPT)  # status names damaged attempts itself
    if damaged is not None:
        damaged += said
    records = [(r.get("submitted_at") or 0, str(r["job_id"])) for r in submitted]
    records += [
        (r.get("started_at") or 0, str(r.get("job_id") or ""))
        for r in attempts
        if r.get("source") in SLURM_SOURCES
    ]
    records = [r for r in records if is_slurm_id(r[1])]
    return max(records, key=lambda r: r[0])[1] if records else None
