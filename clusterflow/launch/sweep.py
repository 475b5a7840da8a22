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
from clusterflow.config import Config, fingerprint
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


def member_state(paths: rundir.RunPaths) -> str | None:
    """What a resubmission decides on: None for a member that never ran (no config.yaml, or
    written by a submission whose sbatch failed), else the state status reports."""
    if not os.path.exists(paths.config):
        return None
    try:
        s = status.collect(paths)
    except UserError:
        return "unknown"
    if s["state"] == State.PENDING and not s["job_id"] and not s["attempts"]:
        return None
    return s["state"]


def _plan(
    sw: sweep.Sweep, dirs: dict[str, rundir.RunPaths]
) -> tuple[dict[str, Any], list[fingerprint.Change], sweep_index.Plan]:
    """``dirs``: each member's run dir, by name."""
    index, changes = sweep_index.merge(sweep_index.read_index(sw.paths), sw)
    names = [m.name for m in sw.members]
    return index, changes, sweep_index.plan(names, {n: member_state(dirs[n]) for n in names})


def _show_plan(sw: sweep.Sweep, plan: sweep_index.Plan) -> None:
    print(f"sweep {sw.paths.root}: {len(sw.members)} member(s) over {', '.join(sw.keys)}")
    for m in sw.members:
        what = (
            "new"
            if m.name in plan.new
            else "resume"
            if m.name in plan.resume
            else f"skip ({plan.skip[m.name]})"
        )
        print(f"  {m.name:<40} {what}")


def _prepare(
    members: list[sweep.Member], dirs: dict[str, rundir.RunPaths]
) -> list[tuple[Config, rundir.RunPaths]]:
    """Each member's run dir checked and its config written (or resumed); its code frozen."""
    prepared = []
    for m in members:
        cfg, _resumed = saved_config.resolve(m.config)
        frozen_code.take(
            dirs[m.name], cfg.task.target, cfg.run.snapshot_code, script=cfg.script.path
        )
        prepared.append((cfg, dirs[m.name]))
    return prepared


def _submit_array(
    sw: sweep.Sweep,
    names: list[str],
    configs: list[Config],
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
    return sbatch.job_folder(sw.paths.slurm_logs)


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


def _run_local(prepared: list[tuple[Config, rundir.RunPaths]]) -> int:
    """``--local``: the members one after another on this machine; a member cancelled meanwhile
    (``clusterflow cancel`` of the sweep or of the member) is skipped."""
    worst = EXIT_OK
    for cfg, paths in prepared:
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
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not os.path.isfile(config):
        config, overrides = None, [config, *overrides]  # --script PATH KEY=VALUE ...
    if args.script is None and args.script_args is not None:
        saved_config.load_command(config, overrides, None, args.script_args)  # refuses
    sw = sweep.expand(
        config,
        overrides,
        args.sweep,
        args.script,
        args.script_args or [],
        taken=sweep_index.names,
    )
    for m in sw.members:
        preflight.check_paths(m.config)
        trackers.check(m.config.trackers)
    if not args.script:
        _check_task_params(sw)
    # Each member's run dir, built once here and handed to every step below.
    dirs = {m.name: rundir.RunPaths(m.run_dir) for m in sw.members}
    if args.dry_run:
        index, changes, plan = _plan(sw, dirs)
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
    with sweep_index.locked(sw.paths):
        index, changes, plan = _plan(sw, dirs)
        if changes:
            print(
                "note: resources changed since the last submission: "
                f"{'; '.join(map(str, changes))}",
                file=sys.stderr,
            )
        _show_plan(sw, plan)
        sweep_index.write_index(sw.paths, index)
        todo = [m for m in sw.members if m.name in plan.to_submit]
        if not todo:
            print("nothing to submit: every member is completed, still queued or cancelled")
            print(f"status: python -m clusterflow.status {sw.paths.root}")
            return EXIT_OK
        prepared = _prepare(todo, dirs)
        if args.local:
            return _run_local(prepared)
        names = [m.name for m in todo]
        configs = [cfg for cfg, _ in prepared]
        jobs = _submit_array(sw, names, configs, args.max_parallel, dependency)
        for (_, paths), name in zip(prepared, names):
            submissions.record_submission(paths, jobs[name])
            transitions.mark_submitted(paths, job_id=jobs[name])
            # A cancelled member is only here when its marker was deleted.
            cancel_marker.clear(paths)
        sweep_index.write_index(
            sw.paths, sweep_index.record_submission(index, jobs[names[0]].split("_")[0], jobs)
        )
    print(
        f"submitted job array {jobs[names[0]].split('_')[0]}: {len(names)} member(s)"
        + (f", at most {args.max_parallel} at once" if args.max_parallel else "")
    )
    print(f"sweep dir: {sw.paths.root}")
    print(f"status: python -m clusterflow.status {sw.paths.root}")
    print(f"cancel: python -m clusterflow.cancel {sw.paths.root}")
    return wait_for(sw.paths, jobs[names[0]].split("_")[0]) if args.wait else EXIT_OK


def wait_for(paths: rundir.RunPaths, array_id: str, poll_s: float = 3.0) -> int:
    """``--wait``: block until the array left the queue (requeues included); exit 0 when every
    member completed, else 1."""
    slurm_commands.wait_until_gone(array_id, poll_s)
    rows = sweep_status.collect(paths, status.collect)
    print(sweep_status.render(rows, sweep_status.keys_of(paths)))
    return (
        EXIT_OK
        if all(r["state"] in (State.COMPLETED, State.CANCELLED) for r in rows)
        else EXIT_JOB_FAILED
    )
