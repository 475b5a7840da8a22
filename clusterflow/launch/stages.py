"""``submit ... --after RUN_DIR`` (repeatable): a stage that starts when earlier runs completed.
A sweep dir stands for all its members.

On Slurm the new job gets ``--dependency=afterok:<job>[:<job>...]`` on each earlier run's current
job (``submissions.current_job_id``: the newest of what submit recorded and what the last attempt
ran as). A requeued job keeps its id, so the dependency holds across preemptions and time-limit
requeues of the earlier stage; it is satisfied only when that job finally completes. An earlier
run that already completed needs no dependency; one that failed, stopped or was cancelled is
refused (``afterok`` would never be met). With ``--local`` nothing can wait in a queue, so every
earlier run must have completed (run the stages one after another). Login-node module: no torch.
"""

from __future__ import annotations

import os
import sys

from clusterflow import rundir
from clusterflow.errors import UserError
from clusterflow.manage import status
from clusterflow.rundir import states, submissions
from clusterflow.slurm import jobids
from clusterflow.sweeps import index as sweep_index


def _state(paths: rundir.RunPaths) -> str | None:
    return status.collect(paths)["state"]


def dependency(after: list[str], local: bool = False, dry_run: bool = False) -> str | None:
    """The ``--dependency`` value for ``--after`` run dirs, or None; refuses runs that cannot
    complete. A dry run only warns (the earlier stage is often not submitted yet when one looks at
    the script)."""
    if dry_run:
        try:
            return dependency(after, local)
        except UserError as exc:
            print(f"# warning: {exc} (a real submission refuses this)", file=sys.stderr)
            return None
    runs = []
    for paths in after_runs(after):
        run_dir = paths.root
        if not os.path.isdir(run_dir):
            raise UserError(
                f"--after {run_dir}: no such run dir; pass the run.dir of a submitted run"
            )
        state = _state(paths)
        if local and state != states.COMPLETED:
            raise UserError(
                f"--after {run_dir}: that run is {state}; with --local the earlier stage must have "
                f"completed (run it first, e.g. submit its config with --local)"
            )
        runs.append((run_dir, state, submissions.current_job_id(paths)))
    return after_dependency(runs)


def after_runs(after: list[str]) -> list[rundir.RunPaths]:
    """The run dirs behind ``--after``: a sweep dir stands for every member of its index (the new
    stage waits for all of them), in sweep order."""
    runs: list[rundir.RunPaths] = []
    for path in after:
        paths = rundir.RunPaths(path)
        if sweep_index.is_sweep_dir(paths):
            index = sweep_index.read_index(paths) or {"members": []}
            runs += sweep_index.member_dirs(paths, index).values()
        else:
            runs.append(paths)
    return list(dict.fromkeys(runs))


def after_dependency(runs: list[tuple[str, str | None, str | None]]) -> str | None:
    """``--after RUN_DIR`` (repeatable) -> the ``--dependency`` value, from (run_dir, state, job
    id).

    A completed run needs no dependency (Slurm forgets finished jobs, and ``afterok`` on a
    forgotten id is refused). A failed, stopped or cancelled run would never satisfy ``afterok``,
    so it is refused rather than leaving the new job pending forever.
    """
    ids = []
    for run_dir, state, job_id in runs:
        if state == states.COMPLETED:
            continue
        if states.ended(state):
            raise UserError(
                f"--after {run_dir}: that run is {state}, so a job waiting for it to complete "
                "would never start; "
                f"resume it first (submit its config again), then submit this one with --after"
            )
        if not jobids.is_slurm_id(job_id):
            raise UserError(
                f"--after {run_dir}: no Slurm job is known for that run "
                f"(state {state or 'unknown'}); "
                f"--after needs a run submitted to Slurm with clusterflow.submit"
            )
        ids.append(str(job_id))
    return "afterok:" + ":".join(dict.fromkeys(ids)) if ids else None
