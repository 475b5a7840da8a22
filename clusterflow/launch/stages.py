"""``submit ... --after RUN_DIR`` (repeatable): a stage that starts when earlier runs completed.

On Slurm the new job gets ``--dependency=afterok:<job>[:<job>...]`` on each earlier run's current
job (``jobids.current_job_id``: the newest of what submit recorded and what the last attempt ran
as). A requeued job keeps its id, so the dependency holds across preemptions and time-limit
requeues of the earlier stage; it is satisfied only when that job finally completes. An earlier
run that already completed needs no dependency; one that failed, stopped or was cancelled is
refused (``afterok`` would never be met). With ``--local`` nothing can wait in a queue, so every
earlier run must have completed (run the stages one after another). Login-node module: no torch.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from clusterflow.slurm import jobids
from clusterflow.errors import UserError


def _state(run_dir: str) -> str | None:
    from clusterflow.manage import status

    return status.collect(run_dir)["state"]


def dependency(after: list[str], local: bool = False, dry_run: bool = False) -> str | None:
    """The ``--dependency`` value for ``--after`` run dirs, or None; refuses runs that cannot complete.
    A dry run only warns (the earlier stage is often not submitted yet when one looks at the script)."""
    if dry_run:
        try:
            return dependency(after, local)
        except UserError as exc:
            print(f"# warning: {exc} (a real submission refuses this)", file=sys.stderr)
            return None
    runs = []
    for run_dir in after:
        if not os.path.isdir(run_dir):
            raise UserError(f"--after {run_dir}: no such run dir; pass the run.dir of a submitted run")
        state = _state(run_dir)
        if local and state != "completed":
            raise UserError(f"--after {run_dir}: that run is {state}; with --local the earlier stage must have "
                            f"completed (run it first, e.g. submit its config with --local)")
        runs.append((run_dir, state, jobids.current_job_id(run_dir)))
    return jobids.after_dependency(runs)


def with_dependency(params: dict[str, Any], dep: str | None) -> dict[str, Any]:
    """submitit SlurmExecutor parameters with ``#SBATCH --dependency`` added (unchanged without one)."""
    if not dep:
        return params
    return dict(params, additional_parameters={**params.get("additional_parameters", {}), "dependency": dep})
