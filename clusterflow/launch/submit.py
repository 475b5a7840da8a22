"""python -m clusterflow.submit CONFIG.yaml [KEY=VALUE ...] [--sweep KEY=V1,V2 ...]
[--after RUN_DIR ...] [--local] [--dry-run] [--wait]
python -m clusterflow.submit --script train.py [CONFIG.yaml] [KEY=VALUE ...] [...] [-- ARGS]

Runs on the login node: resolve and validate the config, check the run dir and checkpoint dir
(``preflight``), create the run directory and write ``config.yaml``, then hand the job to
submitit (Slurm) or to submitit's local executor (``--local``: this machine,
cluster.tasks_per_node processes, gloo on CPU). With ``--script``, the job runs a training script
of the user's own that calls ``clusterflow.start()`` (docs/own-loop.md), with the words after
``--`` as its arguments. Importing this module loads neither torch nor faiss.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from clusterflow import rundir, tasks
from clusterflow.config.job_config import Config
from clusterflow.errors import EXIT_OK, UserError, cli
from clusterflow.launch import gpus, jobs, local, stages, sweep
from clusterflow.manage import status as run_status
from clusterflow.observe import trackers
from clusterflow.rundir import (
    cancel_marker,
    first_error,
    frozen_code,
    lease,
    preflight,
    saved_config,
    states,
    submissions,
    transitions,
)
from clusterflow.slurm import commands as slurm_commands
from clusterflow.slurm import sbatch

EXAMPLES = (
    "examples:\n"
    "  python -m clusterflow.submit configs/demo.yaml --local"
    "                 # demo on this machine, 2 processes\n"
    "  python -m clusterflow.submit configs/demo.yaml cluster.nodes=2 --dry-run"
    "  # print the sbatch script\n"
    "  python -m clusterflow.submit configs/demo.yaml run.dir=runs/exp1 cluster.partition=gpu"
    " --wait\n"
    "  python -m clusterflow.submit configs/demo.yaml run.dir=runs/sweep1"
    " --sweep train.lr=0.001,0.003 --sweep mining.k=5,10\n"
    "                                                                       "
    " # 4 members, one job array (again: resumes it)\n"
    "  python -m clusterflow.submit configs/two_stage_2_classifier.yaml --after runs/two_stage_1\n"
    "                                                                       "
    " # starts when stage 1 has completed\n"
    "  python -m clusterflow.submit --script train.py cluster.nodes=2 -- --lr 0.1"
    "   # your own training script\n"
    "  python -m clusterflow.submit --script train.py --sweep arg:--lr=0.1,0.3 -- --epochs 5\n"
    "                                                                       "
    " # one member per value of the script's --lr\n"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``script_args``: the words after ``--`` (None: no ``--``)."""
    words, script_args = saved_config.split_script_args(
        list(sys.argv[1:] if argv is None else argv)
    )
    p = argparse.ArgumentParser(
        prog="python -m clusterflow.submit",
        description=__doc__.split("\n\n")[1],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="YAML config file (optional with --script)")
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.epochs=3"
    )
    p.add_argument(
        "--script",
        metavar="PATH",
        help="run this training script of your own (it calls clusterflow.start(); "
        "docs/own-loop.md); the words after -- are its arguments, passed untouched",
    )
    p.add_argument("--local", action="store_true", help="run here without Slurm (implies --wait)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the sbatch script and the resolved config; submit nothing",
    )
    p.add_argument(
        "--wait", action="store_true", help="block until the job ends; exit 1 when it failed"
    )
    p.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="sweep KEY over the values (repeatable: the cartesian product); one job array, "
        "one run dir per member under run.dir (docs/workflows.md); arg:NAME=V1,V2 sweeps a "
        "script's own argument NAME (--lr, or lr for key=value arguments)",
    )
    p.add_argument(
        "--max-parallel", type=int, metavar="N", help="with --sweep: at most N members run at once"
    )
    p.add_argument(
        "--after",
        action="append",
        default=[],
        metavar="RUN_DIR",
        help="start only after that run completed (Slurm afterok; repeatable); "
        "with --local it must be completed",
    )
    args = p.parse_intermixed_args(words)  # flags may come after the overrides too
    args.script_args = script_args
    return args


# -- Slurm ---------------------------------------------------------------------------------------


def slurm_folder(paths: rundir.RunPaths) -> str:
    return os.path.abspath(paths.slurm_logs)


def job_parameters(
    cfg: Config,
    paths: rundir.RunPaths,
    python: str | None = None,
    dependency: str | None = None,
) -> tuple[str, dict[str, Any], str]:
    """(submitit's folder, the sbatch parameters, the command prefix) of this run's one job: its
    batch step runs the restart driver (``sbatch.restarting``) around the srun step."""
    folder = sbatch.job_folder(slurm_folder(paths))
    params = sbatch.with_dependency(sbatch.parameters(cfg), dependency)
    config_file = os.path.abspath(paths.config)
    params, prefix = sbatch.restarting(folder, params, cfg, config_file, python)
    return folder, params, prefix


def sbatch_script(cfg: Config, python: str | None = None, dependency: str | None = None) -> str:
    """The exact script submitit would submit (rendered without needing srun on this host)."""
    folder, params, prefix = job_parameters(cfg, rundir.RunPaths(cfg.run.dir), python, dependency)
    return sbatch.script(folder, params, python=prefix)


def check_cluster(cfg: Config) -> None:
    """Checks that need Slurm to answer; skipped (not failed) when sinfo does not answer in time."""
    c = cfg.cluster
    rows = slurm_commands.partitions(timeout_s=10)
    if rows is None:
        print(
            "warning: sinfo did not answer within 10 s; partition and node counts are not checked",
            file=sys.stderr,
        )
        return
    parts = {r[0].rstrip("*"): r for r in rows}
    default = next((r[0].rstrip("*") for r in rows if r[0].endswith("*")), None)
    name = c.partition or default
    if c.partition and c.partition not in parts:
        raise UserError(
            f"cluster.partition = {c.partition!r} does not exist; "
            f"partitions here: {', '.join(parts)}"
        )
    if name in parts:
        nodes = int(parts[name][1])
        if c.nodes > nodes:
            raise UserError(
                f"cluster.nodes = {c.nodes} but partition {name!r} has {nodes} node(s); "
                "lower cluster.nodes"
            )
        if c.nodes + c.spare_nodes > nodes:
            raise UserError(
                f"cluster.spare_nodes = {c.spare_nodes}: with cluster.nodes = {c.nodes} the job "
                f"asks for {c.nodes + c.spare_nodes} node(s) but partition {name!r} has "
                f"{nodes}; lower cluster.spare_nodes"
            )


# -- the run directory -------------------------------------------------------------------------


def prepare_run_dir(cfg: Config, paths: rundir.RunPaths, hold: bool = False) -> tuple[Config, str]:
    """Refuse a run dir that a live job holds (before writing anything), then create RUN_DIR and
    write config.yaml once. Returns the config to run, and how it is configured when resuming an
    existing run, "" otherwise (a different config is refused: saved_config.resolve). The job
    takes the lease when it starts; with ``hold`` (``--local``) this process takes it first, so
    that of two submissions at once the later one is refused before it writes anything, and
    hands it to its job."""
    if hold:
        lease.hold_for_launch(paths, lambda note: print(f"note: {note}", file=sys.stderr))
    else:
        note = lease.check(paths, lease.identity())
        if note:
            print(f"note: {note}", file=sys.stderr)
    try:
        return saved_config.resolve(cfg)
    except BaseException:
        lease.release(paths)
        raise


# -- launching ---------------------------------------------------------------------------------


def submit_slurm(
    cfg: Config, paths: rundir.RunPaths, wait: bool, dependency: str | None = None
) -> int:
    sbatch.require_sbatch("run here")
    check_cluster(cfg)
    folder, params, prefix = job_parameters(cfg, paths, dependency=dependency)
    job_id = sbatch.submit(folder, params, jobs.job_for(cfg), python=prefix)
    # status asks squeue about it from now on
    transitions.mark_submitted(paths, job_id=job_id)
    submissions.record_submission(paths, job_id)
    print(f"submitted job {job_id}")
    print(f"run dir: {cfg.run.dir}")
    print(f"logs: {paths.logs} (rank<R>.attempt<A>.log) and {slurm_folder(paths)}/{job_id}/")
    print(f"status: python -m clusterflow.status {cfg.run.dir}")
    print(f"tensorboard: tensorboard --logdir {paths.tb}")
    if not wait:
        return EXIT_OK
    return wait_for(paths, job_id)


def wait_for(paths: rundir.RunPaths, job_id: str, poll_s: float = 3.0) -> int:
    """Block until the Slurm job has left the queue; the run's state as ``status`` decides it
    (the records weighed against Slurm's: a job recorded requeued that Slurm did not requeue
    failed) gives the exit code. A requeued job stays in the queue, so waiting spans all its
    attempts."""
    slurm_commands.wait_until_gone(job_id, poll_s)
    status, _ = rundir.read_object(paths.status)
    seen = run_status.collect(paths) if status.get("state") else {}
    state = seen.get("state")
    print(f"job {job_id} ended: {state or 'unknown (no status written; see the Slurm logs)'}")
    if state == states.COMPLETED:
        return EXIT_OK
    if seen.get("error"):
        print(f"cause: {seen['error']}")
    return local.failed_exit_code(status, first_error.read(paths, rundir.current_attempt(paths)))


def check_task(cfg: Config) -> None:
    """What the job would refuse about its task fails here, before anything is written: a
    target that is not a task, ``task.params`` of the wrong name, type or declared range
    (``tasks.Range``), ``train.parallel=fsdp`` with a task that cannot be sharded, and a
    ``train.profile`` window past the run's last step (the training set's size gives the step
    count: the task is built only then). A task whose module does not import here (a login
    node without its packages or data) is left to the job's own checks."""
    try:
        cls, params = tasks.task_class(cfg.task.target, cfg.run.seed, dict(cfg.task.params))
    except UserError:
        raise
    except Exception:  # noqa: BLE001 - the task's module needs what only the job has
        return
    if cfg.train.parallel == "fsdp":
        tasks.check_can_shard(cfg.task.target, cls)
    if not cfg.train.profile:
        return
    try:
        samples = len(tasks.load_task(cfg.task.target, cfg.run.seed, params).train_dataset())
    except UserError:
        raise
    except Exception:  # noqa: BLE001 - the job reports a task whose data does not load here
        return
    cfg.check_profile_reaches(samples)


@cli
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.max_parallel is not None and args.max_parallel < 1:
        raise UserError(
            f"--max-parallel {args.max_parallel}: must be >= 1 (how many members run at once)"
        )
    dependency = stages.dependency(args.after, args.local, args.dry_run)
    if args.sweep:
        return sweep.submit_sweep(args, dependency)
    if args.max_parallel is not None:
        raise UserError(
            "--max-parallel limits the members of a sweep running at once; "
            "it needs --sweep KEY=V1,V2"
        )
    cfg = saved_config.load_command(args.config, args.overrides, args.script, args.script_args)
    preflight.check_paths(cfg)
    if not cfg.script.path:
        check_task(cfg)
    trackers.check(cfg.trackers)
    if args.dry_run:
        saved_config.resolve(cfg, write=False)  # would the run dir take this config?
        if args.local:
            print(
                f"# would run {cfg.cluster.tasks_per_node} local process(es) "
                f"with gloo in {cfg.run.dir}"
            )
        else:
            print(sbatch_script(cfg, dependency=dependency))
        print("# resolved config")
        print(cfg.to_yaml())
        return EXIT_OK
    # the free GPUs, chosen (or a busy one refused) before anything is written
    chosen = (
        gpus.for_local(
            cfg.cluster.gpus_per_node,
            cfg.cluster.gpus,
            os.environ,
            need=lambda: jobs.memory_need(cfg),
        )
        if args.local
        else None
    )
    paths = rundir.RunPaths(cfg.run.dir)
    done = saved_config.nothing_to_train(cfg)
    cfg, resumed = prepare_run_dir(cfg, paths, hold=args.local)
    if done is not None:  # a completed run that this submission asks nothing more of
        lease.release(paths)
        print(saved_config.nothing_to_train_said(cfg.run.dir, done))
        return EXIT_OK
    if resumed:
        print(f"run dir {cfg.run.dir} exists with {resumed}: resuming from its newest checkpoint")
    # Submitting a run again is the explicit way back from a cancel.
    cancel_marker.clear(paths)
    frozen_code.take(paths, cfg.task.target, cfg.run.snapshot_code, script=cfg.script.path)
    if args.local:
        return local.submit_local(cfg, paths, chosen)
    return submit_slurm(cfg, paths, args.wait, dependency)
