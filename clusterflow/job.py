"""The job every task runs, whoever launched it (submitit on Slurm, submitit locally, srun, torchrun).

``Job`` is what submitit pickles; ``run_job`` is what ``python -m clusterflow.run`` calls. Both
end in :func:`run_job`: read the environment, join the process group, agree on rank 0's config,
record the attempt, train, and hand the outcome to ``requeue.after_stop`` (exit, requeue, or fail).
Requeue carries no state: ``checkpoint()`` returns a fresh Job and the store holds the rest.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any, Mapping

from clusterflow import failure, rundir
from clusterflow.config import Config, from_dict
from clusterflow.dist import DistEnv
from clusterflow.errors import EXIT_JOB_FAILED, RunError

log = logging.getLogger("clusterflow")


class Job:
    """Picklable entry point for submitit. Holds only the resolved config."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = dict(config)

    def __call__(self) -> str:
        outcome = run_job(self.config)
        if outcome == "failed":
            raise RuntimeError("clusterflow job failed; see the rank logs and `python -m clusterflow.status`")
        return outcome

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's requeue hook: state is on disk, so a fresh Job is all a requeue needs."""
        import submitit

        return submitit.helpers.DelayedSubmission(Job(self.config))


def setup_logging(paths: rundir.RunPaths, rank: int, attempt: int) -> None:
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    root = logging.getLogger("clusterflow")
    root.setLevel(logging.INFO)
    for h in list(root.handlers):
        root.removeHandler(h)
    os.makedirs(paths.logs, exist_ok=True)
    fh = logging.FileHandler(paths.log_file(rank, attempt), mode="a")
    fh.setFormatter(fmt)
    root.addHandler(fh)
    if rank == 0:
        sh = logging.StreamHandler(sys.stdout)
        sh.setFormatter(fmt)
        root.addHandler(sh)
    root.propagate = False


def _threads(env: DistEnv, environ: Mapping[str, str]) -> None:
    """Keep processes sharing a node from oversubscribing its cores."""
    import torch

    if "OMP_NUM_THREADS" not in environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, env.local_world_size)))


def _start(env: DistEnv, cfg: Config, device: Any) -> int:
    """Record this attempt (rank 0) and set up logging everywhere; returns the attempt number."""
    from clusterflow import dist

    paths = rundir.RunPaths(cfg.run.dir)
    attempt = 0
    if env.is_main:
        os.makedirs(cfg.run.dir, exist_ok=True)
        attempt = rundir.record_attempt(paths, job_id=env.job_id, restart_count=env.attempt, hosts=list(env.hosts),
                                        world_size=env.world_size, source=env.source, host=socket.gethostname())
    attempt = int(dist.broadcast_object(attempt))
    hosts = dist.gather_object(socket.gethostname())
    setup_logging(paths, env.rank, attempt)
    if env.is_main:
        rundir.write_status(paths, state="running", job_id=env.job_id, world_size=env.world_size,
                            hosts=sorted(set(hosts or [])), attempt=attempt, error=None)
    log.info("rank %d/%d on %s (%s, local rank %d, device %s), job %s attempt %d, master %s:%d",
             env.rank, env.world_size, socket.gethostname(), env.source, env.local_rank, device, env.job_id,
             attempt, env.master_addr, env.master_port)
    return attempt


def run_job(config: Mapping[str, Any] | Config, environ: Mapping[str, str] | None = None) -> str:
    """Run this task's share of the job. Returns completed, preempted, timeout, requeued or failed."""
    from clusterflow import dist

    environ = os.environ if environ is None else environ
    env = DistEnv.from_env(environ)
    cfg = config if isinstance(config, Config) else from_dict(dict(config))
    try:
        device = dist.init(env, cfg.dist.backend, cfg.dist.timeout_s)
        # Every rank runs on rank 0's resolved config, never on a file re-read later.
        cfg = from_dict(dist.broadcast_object(cfg.to_dict()))
        attempt = _start(env, cfg, device)
        _threads(env, environ)
        from clusterflow.preemption import Preemption
        from clusterflow.requeue import after_stop
        from clusterflow.tasks import load_task
        from clusterflow.trainer import Trainer

        preemption = Preemption().install()
        task = load_task(cfg.task.target, cfg.run.seed, cfg.task.params)
        outcome = Trainer(cfg, task, device, attempt, preemption).fit()
        if env.is_main:
            outcome = after_stop(rundir.RunPaths(cfg.run.dir), outcome, env, environ, cfg.cluster.max_timeout_requeues,
                                 preemption.received_at)
        outcome = dist.broadcast_object(outcome)
        dist.barrier()  # nobody tears the group down while a peer still talks to it
        dist.shutdown()
        return outcome
    except BaseException as exc:  # noqa: BLE001 - record who failed, then fail the job
        _record_failure(exc, cfg, env.rank)
        raise


def _record_failure(exc: BaseException, cfg: Config, rank: int) -> None:
    """Write who failed and why, with the exit status (``failure.describe``): bad input is one line
    and exit 2; a full disk one line and exit 1; the task's own code its traceback and exit 1."""
    if isinstance(exc, SystemExit) and exc.code in (0, None):
        return
    f = failure.describe(exc, cfg.task.target)
    paths = rundir.RunPaths(cfg.run.dir)
    try:
        rundir.write_error(paths, rank, socket.gethostname(), f.message, f.trace)
        rundir.write_status(paths, state="failed", error=f"rank {rank}: {f.message}", exit_code=f.code)
    except (OSError, RunError):  # a full disk or a vanished run dir: the message below still reaches the user
        pass
    shown = f.trace if f.named and f.trace else ""  # the task's traceback, in the rank log (echoed by --local)
    log.error("rank %d failed: %s%s", rank, f.message, f"\n{shown}" if shown else "")
    if f.named:
        later = f"; its traceback is in {paths.log_file(rank, _attempt_of(paths))}" if shown else ""
        print(f"error: {f.message}{later}", file=sys.stderr)
        raise SystemExit(f.code) from None


def _attempt_of(paths: rundir.RunPaths) -> int:
    return max(0, len(rundir.read_jsonl(paths.attempts)) - 1)


__all__ = ["Job", "run_job", "EXIT_JOB_FAILED"]
