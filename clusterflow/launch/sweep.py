"""``submit CONFIG --sweep KEY=V1,V2 [--sweep ...] [--max-parallel N]``: a sweep as one Slurm job
array.

The steps, in order, so that a bad member never leaves half a sweep in the queue:

1. expand the sweep and validate every member (``sweeps.sweep.expand``: all failures at once);
2. under the sweep's lock, merge the members into ``RUN_DIR/sweep.json`` (another sweep into the
   same dir is refused; changed resources are named) and plan: completed, running and cancelled
   members are skipped, the others are new or resumed (``sweeps.index.plan``);
3. check each member's run dir and write its config (a resumed member keeps its saved one), and
   freeze the task's code into it;
4. submit the members to run as one job array (``slurm.sbatch``) and record the array task of each
   member in the index and in the member's ``submissions.jsonl`` (``cancel`` and ``--after`` read
   it).

``--local`` runs the members one after another here; ``--dry-run`` lists the members with what a
submission would do and prints the array's sbatch script, writing nothing. Login-node module: no
torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from clusterflow import rundir, tasks
from clusterflow.errors import EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_OK, UserError
from clusterflow.launch import jobs, local
from clusterflow.manage import status, sweep_status
from clusterflow.observe import trackers
from clusterflow.rundir import (
    cancel_marker,
    frozen_code,
    preflight,
    saved_config,
    submissions,
    transitions,
)
from clusterflow.rundir.states import State
from clusterflow.slurm import commands as slurm_commands
from clusterflow.slurm import sbatch
from clusterflow.sweeps import index as sweep_index
from clusterflow.sweeps import sweep


def member_state(run_dir: str) -> str | None:
    """What a resubmission decides on: None for a member that never ran (no config.yaml, or
    written by a submission whose sbatch failed), else the state status reports."""
    if not os.path.exists(os.path.join(run_dir, "config.yaml")):
        return None
    try:
        s = status.collect(run_dir)
    except UserError:
        return "unknown"
    if s["state"] == State.PENDING and not s["job_id"] and not s["attempts"]:
        return None
    return s["state"]


def _plan(sw: sweep.Sweep) -> tuple[dict[str, Any], list[Any], sweep_index.Plan]:
    index, changes = sweep_index.merge(sweep_index.read_index(sw.dir), sw)
    names = [m.name for m in sw.members]
    dirs = {m.name: m.run_dir for m in sw.members}
    return index, changes, sweep_index.plan(names, {n: member_state(dirs[n]) for n in names})


def _show_plan(sw: sweep.Sweep, plan: sweep_index.Plan) -> None:
    print(f"sweep {sw.dir}: {len(sw.members)} member(s) over {', '.join(sw.keys)}")
    for m in sw.members:
        what = (
            "new"
            if m.name in plan.new
            else "resume"
            if m.name in plan.resume
            else f"skip ({plan.skip[m.name]})"
        )
        print(f"  {m.name:<40} {what}")


def _prepare(members: list[sweep.Member]) -> list[Any]:
    """Each member's run dir checked and its config written (or resumed); its code frozen."""
    configs = []
    for m in members:
        cfg, resumed = saved_config.resolve(m.config)
        frozen_code.take(rundir.RunPaths(cfg.run.dir), cfg.task.target, cfg.run.snapshot_code)
        configs.append(cfg)
    return configs


def _submit_array(
    sw: sweep.Sweep,
    names: list[str],
    configs: list[Any],
    max_parallel: int | None,
    dependency: str | None,
) -> dict[str, str]:
    """One sbatch for the members; returns member name -> job id (``A_T``, or ``A`` for one
    member)."""
    sbatch.require_sbatch("run the sweep here")
    plan = sbatch.array_plan(_folder(sw), configs, names, max_parallel)
    params = sbatch.with_dependency(plan.parameters, dependency)
    ids = sbatch.submit_array(plan.folder, params, [jobs.job_for(cfg) for cfg in plan.configs])
    return dict(zip(plan.names, ids))


def _folder(sw: sweep.Sweep) -> str:
    """submitit's folder for the sweep's job array (task T's output: SWEEP_DIR/logs/slurm/A_T)."""
    return sbatch.job_folder(rundir.RunPaths(sw.dir).slurm_logs)


def _check_task_params(sw: sweep.Sweep) -> None:
    """Every member's ``task.params`` against its task class, before anything is written or
    submitted (``--dry-run`` too): a parameter the task does not take fails every member at
    once, not each job. A task whose module does not import here (a login node without its
    packages) is left to the job's own check."""
    failures = []
    for m in sw.members:
        c = m.config
        try:
            tasks.task_class(c.task.target, c.run.seed, dict(c.task.params))
        except UserError as exc:
            failures.append((m.name, str(exc)))
        except Exception:  # noqa: BLE001 - the task's module needs what only the job has
            return
    if failures:
        sweep.report_invalid(failures, len(sw.members))


def _run_local(configs: list[Any]) -> int:
    """``--local``: the members one after another on this machine; a member cancelled meanwhile
    (``clusterflow cancel`` of the sweep or of the member) is skipped."""
    worst = EXIT_OK
    for cfg in configs:
        paths = rundir.RunPaths(cfg.run.dir)
        if cancel_marker.is_cancelled(paths):
            print(f"== sweep member {cfg.run.dir}: cancelled by the user; not started")
            continue
        print(f"== sweep member {cfg.run.dir}")
        code = local.submit_local(cfg, paths)
        if code == EXIT_INTERRUPTED:
            return code
        worst = max(worst, code)
    return worst


def submit_sweep(args: argparse.Namespace, dependency: str | None) -> int:
    """The ``--sweep`` branch of ``submit.main``."""
    sw = sweep.expand(args.config, args.overrides, args.sweep)
    for m in sw.members:
        preflight.check_paths(m.config)
        trackers.check(m.config.trackers)
    _check_task_params(sw)
    if args.dry_run:
        index, changes, plan = _plan(sw)
        _show_plan(sw, plan)
        for c in changes:
            print(f"# note: changed since the last submission: {c}")
        todo = [m for m in sw.members if m.name in plan.to_submit]
        if todo and not args.local:
            ap = sbatch.array_plan(
                _folder(sw), [m.config for m in todo], [m.name for m in todo], args.max_parallel
            )
            params = sbatch.with_dependency(ap.parameters, dependency)
            print(sbatch.script(ap.folder, params, array_size=ap.size))
        return EXIT_OK
    with sweep_index.locked(sw.dir):
        index, changes, plan = _plan(sw)
        if changes:
            print(
                "note: resources changed since the last submission: "
                f"{'; '.join(map(str, changes))}",
                file=sys.stderr,
            )
        _show_plan(sw, plan)
        sweep_index.write_index(sw.dir, index)
        todo = [m for m in sw.members if m.name in plan.to_submit]
        if not todo:
            print("nothing to submit: every member is completed, still queued or cancelled")
            print(f"status: python -m clusterflow.status {sw.dir}")
            return EXIT_OK
        configs = _prepare(todo)
        if args.local:
            return _run_local(configs)
        names = [m.name for m in todo]
        jobs = _submit_array(sw, names, configs, args.max_parallel, dependency)
        for cfg, name in zip(configs, names):
            paths = rundir.RunPaths(cfg.run.dir)
            submissions.record_submission(paths, jobs[name])
            transitions.mark_submitted(paths, job_id=jobs[name])
            # A cancelled member is only here when its marker was deleted.
            cancel_marker.clear(paths)
        sweep_index.write_index(
            sw.dir, sweep_index.record_submission(index, jobs[names[0]].split("_")[0], jobs)
        )
    print(
        f"submitted job array {jobs[names[0]].split('_')[0]}: {len(names)} member(s)"
        + (f", at most {args.max_parallel} at once" if args.max_parallel else "")
    )
    print(f"sweep dir: {sw.dir}")
    print(f"status: python -m clusterflow.status {sw.dir}")
    print(f"cancel: python -m clusterflow.cancel {sw.dir}")
    return wait_for(sw.dir, jobs[names[0]].split("_")[0]) if args.wait else EXIT_OK


def wait_for(sweep_dir: str, array_id: str, poll_s: float = 3.0) -> int:
    """``--wait``: block until the array left the queue (requeues included); exit 0 when every
    member completed, else 1."""
    slurm_commands.wait_until_gone(array_id, poll_s)
    rows = sweep_status.collect(sweep_dir, status.collect)
    print(sweep_status.render(rows, sweep_status.keys_of(sweep_dir)))
    return (
        EXIT_OK
        if all(r["state"] in (State.COMPLETED, State.CANCELLED) for r in rows)
        else EXIT_JOB_FAILED
    )
