"""python -m clusterflow.run CONFIG.yaml [KEY=VALUE ...]

The in-allocation entry point: run this process's share of the job, reading rank and world from
Slurm (``srun``), torchrun, or nothing (a single process). The sbatch template calls it under
``srun``. The config is resolved once: the first attempt writes RUN_DIR/config.yaml, and every
later attempt (a requeue) and every rank uses that file as rank 0 read it, never the YAML you
may have edited since.
"""

from __future__ import annotations

import argparse
import os
import sys

from clusterflow import config as cfgmod
from clusterflow import rundir
from clusterflow.errors import EXIT_JOB_FAILED, EXIT_OK, cli

EXAMPLES = """examples:
  python -m clusterflow.run configs/demo.yaml                        # one process, here
  torchrun --nproc-per-node 2 -m clusterflow.run configs/demo.yaml   # two processes with torchrun
  srun python -m clusterflow.run configs/demo.yaml run.dir=runs/x    # inside an allocation
"""


@cli
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clusterflow.run", description=__doc__.split("\n\n")[1],
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = p.parse_intermixed_args(argv)
    cfg = cfgmod.load(args.config, args.overrides)
    from clusterflow.dist import DistEnv

    env = DistEnv.from_env(os.environ)
    saved = rundir.path(cfg.run.dir, rundir.CONFIG)
    if env.is_main:
        if os.path.exists(saved):
            first = cfgmod.load(saved)
            if first.fingerprint() != cfg.fingerprint():
                print(f"note: {saved} (from the first attempt) differs from {args.config}; using the saved one", file=sys.stderr)
            cfg = first
        else:
            os.makedirs(cfg.run.dir, exist_ok=True)
            rundir.write_atomic(saved, cfg.to_yaml())
    from clusterflow.job import run_job

    outcome = run_job(cfg)  # broadcasts rank 0's config to every rank before anything else
    return EXIT_OK if outcome in ("completed", "preempted", "requeued") else EXIT_JOB_FAILED


def _exit(code: int) -> None:
    """Flush everything, then leave without interpreter teardown: once the job has finished,
    C++ threads of the communication library can abort the process while Python unwinds
    ("terminate called without an active exception"), turning a completed run into exit -6."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    _exit(code)
