"""python -m clusterflow.run CONFIG.yaml [KEY=VALUE ...]
python -m clusterflow.run --script train.py [CONFIG.yaml] [KEY=VALUE ...] [-- SCRIPT_ARGS]

The in-allocation entry point: run this process's share of the job, reading rank and world from
Slurm (``srun``), torchrun, or nothing (a single process). With ``--script``, the job's program
is a script of the user's own that calls ``clusterflow.start()`` (docs/own-loop.md), run with the
words after ``--`` as its arguments, untouched. The sbatch template calls it under
``srun``. The config is resolved once: the first attempt writes RUN_DIR/config.yaml, and every
rank of every later attempt runs on that file as rank 0 read it. A later launch into the same run
dir must ask for the same config (``config.job_config.check_resume``), except a requeue of the
same job, which runs on the saved config even if the YAML was edited since, and a launch into a
run dir that holds no committed checkpoint yet, whose config it replaces
(``rundir.saved_config.resolve``). ``--check`` stops before the process group and training:
everything else is checked as a run checks it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from clusterflow.config.job_config import Config
from clusterflow.distributed.env import DistEnv
from clusterflow.distributed.sampler import check_fits
from clusterflow.errors import EXIT_OK, UserError, cli
from clusterflow.job import failure
from clusterflow.job.attempt import exit_code
from clusterflow.job.job import run_job
from clusterflow.observe import trackers
from clusterflow.rundir import preflight, saved_config
from clusterflow.tasks import load_task

EXAMPLES = (
    "examples:\n"
    "  python -m clusterflow.run configs/demo.yaml                        # one process, here\n"
    "  torchrun --nproc-per-node 2 -m clusterflow.run configs/demo.yaml"
    "   # two processes with torchrun\n"
    "  srun python -m clusterflow.run configs/demo.yaml run.dir=runs/x    # inside an allocation\n"
    "  python -m clusterflow.run configs/demo.yaml --check"
    "                # validate everything, train nothing\n"
    "  torchrun --nproc-per-node 2 -m clusterflow.run --script train.py -- --lr 0.1"
    "   # your own script\n"
)


def _check_trackers(cfg: Config, env: DistEnv) -> None:
    """A tracker that cannot work refuses a fresh start (exit 2, before anything is written); a
    requeued attempt goes on with a warning, since a tracker down at that moment must never cost
    the training run (the tracker's pump retries, and sends what it missed once it is back)."""
    try:
        trackers.check(cfg.trackers, reach=env.rank == 0)
    except UserError as exc:
        if env.attempt == 0 and env.restart_in_job == 0:
            raise
        print(f"clusterflow: warning: {exc}; this requeued attempt trains on", file=sys.stderr)


@cli
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m clusterflow.run",
        description=__doc__.split("\n\n")[1],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="YAML config file (optional with --script)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument(
        "--script",
        metavar="PATH",
        help="run this training script (it calls clusterflow.start()); the words after -- are "
        "its arguments",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="check the config, the run dir and the task (import, parameters, dataset size), "
        "then exit without training or writing anything: 0 when the run would start, 2 with the "
        "reason otherwise",
    )
    words, script_args = saved_config.split_script_args(
        list(sys.argv[1:] if argv is None else argv)
    )
    args = p.parse_intermixed_args(words)
    cfg = saved_config.load_command(args.config, args.overrides, args.script, script_args)
    preflight.check_paths(cfg)
    _check_trackers(cfg, DistEnv.from_env(os.environ))
    if args.check:
        env = DistEnv.from_env(os.environ)
        cfg, _ = saved_config.resolve(cfg, relaunch=env.attempt > 0, write=False)
        if cfg.script.path:
            print(f"ok: {cfg.script.path} on {env.world_size} process(es); run dir {cfg.run.dir}")
            return EXIT_OK
        return _check_task(cfg, env.world_size)

    # Rank 0 takes the run dir's lease, then resumes with the saved config (a requeued job re-runs
    # this command with the YAML as it is now: it keeps the saved config) or writes it, and
    # broadcasts it to every rank before anything else.
    return exit_code(run_job(cfg))


def _check_task(cfg: Config, world: int) -> int:
    """What ``run_job`` checks before training, without a process group: the task imports and
    takes its parameters, and its training set holds a full batch."""

    try:
        task = load_task(cfg.task.target, cfg.run.seed, cfg.task.params)
        n = len(task.train_dataset())
    except UserError:
        raise
    except Exception as exc:
        f = failure.describe(exc, cfg.task.target)
        if not f.named:
            raise
        print(f"error: {f.message}\n{f.trace}", file=sys.stderr)
        return f.code
    check_fits(n, cfg.train.batch_size, world * cfg.train.grad_accum, cfg.task.target)
    cfg.check_profile_reaches(n)
    print(
        f"ok: {cfg.task.target} with {n} training samples, "
        f"{n // cfg.train.batch_size} steps per epoch, "
        f"{cfg.train.epochs} epoch(s) on {world} process(es); run dir {cfg.run.dir}"
    )
    return EXIT_OK


def _exit(code: int) -> None:
    """Flush everything, then leave without interpreter teardown: once the job has finished,
    C++ threads of the communication library can abort the process while Python unwinds
    ("terminate called without an active exception"), turning a completed run into exit -6."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def entry() -> None:
    """``python -m clusterflow.run``: :func:`main`, then :func:`_exit` with its status."""
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    _exit(code)
