"""python -m clusterflow.cancel RUN_DIR|SWEEP_DIR

Stop a run (or every unfinished member of a sweep) for good: write ``RUN_DIR/cancelled.json``
first, then ``scancel`` the run's current Slurm job. The marker comes first so that a job which
catches the cancel's SIGTERM and would requeue itself sees it and does not; status reports
``cancelled`` from the marker; a resubmitted sweep skips cancelled members. Submitting a single
run again is the explicit way back (submit clears its marker with ``cancel_marker.clear``).
"""

from __future__ import annotations

import argparse
import os

from clusterflow import rundir
from clusterflow.errors import EXIT_OK, UserError, cli
from clusterflow.rundir import cancel_marker, records, states, submissions
from clusterflow.slurm import commands as slurm_commands
from clusterflow.sweeps import index as sweep_index

EXAMPLES = """examples:
  python -m clusterflow.cancel runs/exp1          # one run
  python -m clusterflow.cancel runs/lr-sweep      # every unfinished member of a sweep
"""


def runs_of(target: rundir.RunPaths) -> list[rundir.RunPaths]:
    """The run dirs behind RUN_DIR or SWEEP_DIR."""
    if not os.path.isdir(target.root):
        raise UserError(
            f"{target.root!r} does not exist; pass a run dir or a sweep dir "
            "(the run.dir you submitted)"
        )
    index = sweep_index.read_index(target) if sweep_index.is_sweep_dir(target) else None
    if index is not None:
        return list(sweep_index.member_dirs(target, index).values())
    if not os.path.exists(target.config):
        raise UserError(
            f"{target.root!r} holds neither config.yaml nor sweep.json: "
            "not a clusterflow run or sweep dir"
        )
    return [target]


def job_state(paths: rundir.RunPaths) -> str | None:
    """The state the run's job last wrote (not the marker's: after a failed scancel, cancelling
    again retries it), or None when a submission is newer than it (a resubmitted job may be
    pending)."""
    st, _ = rundir.read_object(paths.status, records.STATUS)
    submitted = [
        r.get("submitted_at") or 0 for r in rundir.read_jsonl(paths.submissions, records.SUBMISSION)
    ]
    if submitted and max(submitted) > (st.get("updated_at") or 0):
        return None
    return st.get("state")


def targets(
    runs: list[tuple[str, str | None, str | None]],
) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """From (run_dir, state, job id): (run dirs to mark, (run dir, job id) pairs to scancel, notes).

    Completed runs are left alone. Every other run is marked, so that it never comes back by
    itself; its job is cancelled unless status says the job already ended.
    """
    mark, kill, notes = [], [], []
    for run_dir, state, job_id in runs:
        if state == states.COMPLETED:
            notes.append(f"{run_dir}: already completed; left alone")
            continue
        mark.append(run_dir)
        if state == states.CANCELLED:
            notes.append(f"{run_dir}: already cancelled")
        elif states.ended(state):
            notes.append(f"{run_dir}: {state}; marked cancelled so that it is not resumed")
        elif job_id is None:
            notes.append(
                f"{run_dir}: no Slurm job known (a local run stops at its next step); "
                "marked cancelled"
            )
        else:
            kill.append((run_dir, job_id))
    return mark, kill, notes


def cancel(target: str) -> list[str]:
    """Mark and scancel; returns the lines to print."""
    runs: list[tuple[str, str | None, str | None]] = []
    skipped = []
    found = {paths.root: paths for paths in runs_of(rundir.RunPaths(target))}
    for run_dir, paths in found.items():
        if not os.path.exists(paths.config):
            skipped.append(f"{run_dir}: never submitted; nothing to cancel")
            continue
        runs.append((run_dir, job_state(paths), submissions.current_job_id(paths)))
    mark, kill, notes = targets(runs)
    ids = {run_dir: job for run_dir, job in kill}
    for run_dir in mark:
        cancel_marker.mark(found[run_dir], ids.get(run_dir))
    slurm_commands.cancel(list(dict.fromkeys(ids.values())))
    return skipped + notes + [f"{run_dir}: cancelled job {job}" for run_dir, job in kill]


@cli
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m clusterflow.cancel",
        description="Cancel a run or a sweep for good.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dir", metavar="RUN_DIR|SWEEP_DIR")
    args = p.parse_args(argv)
    for line in cancel(args.dir):
        print(line)
    return EXIT_OK
