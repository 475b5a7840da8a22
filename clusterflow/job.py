"""The job every task runs, whoever launched it (submitit on Slurm, submitit locally, srun, torchrun).

``Job`` is what submitit pickles; ``run_job`` is what ``python -m clusterflow.run`` calls. Both
end in :func:`run_job`: read the environment, join the process group, agree on rank 0's config,
record the attempt, train, and turn the outcome into what Slurm needs (exit, requeue, or fail).
Requeue carries no state: ``checkpoint()`` returns a fresh Job and the store holds the rest.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import traceback
from typing import Any, Mapping

from clusterflow import rundir
from clusterflow.config import Config, from_dict
from clusterflow.dist import DistEnv
from clusterflow.errors import EXIT_BAD_INPUT, EXIT_JOB_FAILED, UserError

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


def setup_logging(run_dir: str, rank: int, attempt: int) -> None:
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    root = logging.getLogger("clusterflow")
    root.setLevel(logging.INFO)
    for h in list(root.handlers):
        root.removeHandler(h)
    os.makedirs(rundir.path(run_dir, "logs"), exist_ok=True)
    fh = logging.FileHandler(rundir.log_file(run_dir, rank, attempt), mode="a")
    fh.setFormatter(fmt)
    root.addHandler(fh)
    if rank == 0:
        sh = logging.StreamHandler(sys.stdout)
        sh.setFormatter(fmt)
        root.addHandler(sh)
    root.propagate = False


def _threads(env: DistEnv, cfg: Config) -> None:
    """Keep processes sharing a node from oversubscribing its cores."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, env.local_world_size)))


def run_job(config: Mapping[str, Any] | Config, environ: Mapping[str, str] | None = None) -> str:
    """Run this task's share of the job. Returns completed, preempted, timeout, requeued or failed."""
    from clusterflow import dist

    environ = os.environ if environ is None else environ
    env = DistEnv.from_env(environ)
    cfg = config if isinstance(config, Config) else from_dict(dict(config))
    rank_for_errors, attempt = env.rank, 0
    try:
        device = dist.init(env, cfg.dist.backend, cfg.dist.timeout_s)
        # Every rank runs on rank 0's resolved config, never on a file re-read later.
        cfg = from_dict(dist.broadcast_object(cfg.to_dict()))
        if env.is_main:
            os.makedirs(cfg.run.dir, exist_ok=True)
            attempt = rundir.record_attempt(cfg.run.dir, job_id=env.job_id, restart_count=env.attempt, hosts=list(env.hosts),
                                            world_size=env.world_size, source=env.source, host=socket.gethostname())
        attempt = int(dist.broadcast_object(attempt))
        hosts = dist.gather_object(socket.gethostname())
        setup_logging(cfg.run.dir, env.rank, attempt)
        if env.is_main:
            rundir.write_status(cfg.run.dir, state="running", job_id=env.job_id, world_size=env.world_size,
                                hosts=sorted(set(hosts or [])), attempt=attempt, error=None)
        log.info("rank %d/%d on %s (%s, local rank %d, device %s), job %s attempt %d, master %s:%d",
                 env.rank, env.world_size, socket.gethostname(), env.source, env.local_rank, device, env.job_id,
                 attempt, env.master_addr, env.master_port)
        _threads(env, cfg)
        from clusterflow.preemption import Preemption
        from clusterflow.tasks import load_task
        from clusterflow.trainer import Trainer

        preemption = Preemption().install()
        task = load_task(cfg.task.target, cfg.run.seed, cfg.task.params)
        trainer = Trainer(cfg, task, device, attempt, preemption)
        outcome = trainer.fit()
        if env.is_main:
            outcome = _after_stop(cfg, env, outcome, preemption)
        outcome = dist.broadcast_object(outcome)
        dist.barrier()  # nobody tears the group down while a peer still talks to it
        dist.shutdown()
        return outcome
    except BaseException as exc:  # noqa: BLE001 - record who failed, then fail the job
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        user = isinstance(exc, UserError)
        message = str(exc) if user else f"{type(exc).__name__}: {exc}"
        trace = "" if user else traceback.format_exc()
        try:
            rundir.write_error(cfg.run.dir, rank_for_errors, socket.gethostname(), message, trace)
            rundir.write_status(cfg.run.dir, state="failed", error=f"rank {rank_for_errors}: {message}")
        except OSError:
            pass
        log.error("rank %d failed: %s", rank_for_errors, message)
        if user:
            print(f"error: {message}", file=sys.stderr)
            raise SystemExit(EXIT_BAD_INPUT) from None
        raise


def _after_stop(cfg: Config, env: DistEnv, outcome: str, preemption: Any) -> str:
    """Rank 0: record the outcome; after a time-limit signal, requeue the job (bounded)."""
    run_dir = cfg.run.dir
    if outcome == "completed":
        rundir.write_status(run_dir, state="completed")
        log.info("run completed; final weights in %s", rundir.path(run_dir, "model.pt"))
        return outcome
    rundir.append_jsonl(rundir.path(run_dir, "stops.jsonl"), {"reason": outcome, "job_id": env.job_id,
                                                               "signal_at": preemption.received_at})
    if outcome == "timeout" and env.source in ("slurm", "torchrun") and os.environ.get("SLURM_JOB_ID"):
        timeouts = sum(1 for r in rundir.read_jsonl(rundir.path(run_dir, "stops.jsonl")) if r.get("reason") == "timeout")
        if timeouts > cfg.cluster.max_timeout_requeues:
            rundir.write_status(run_dir, state="stopped", error=f"time limit reached {timeouts} times (cluster.max_timeout_requeues="
                                f"{cfg.cluster.max_timeout_requeues}); resume by submitting the same config again")
            return "timeout"
        return "requeued" if requeue(os.environ["SLURM_JOB_ID"], run_dir, why="the time-limit signal") else "timeout"
    if outcome == "preempted" and env.source in ("slurm", "torchrun") and os.environ.get("SLURM_JOB_ID"):
        job_id = os.environ["SLURM_JOB_ID"]
        state = slurm_job_state(job_id)
        # Slurm requeues a preempted job only if it is still running when the grace time ends; one that
        # saved and exited early is recorded as COMPLETED and never comes back. So while the job still
        # runs (preemption, or a bare SIGTERM) it requeues itself. COMPLETING means a requeue is already
        # under way (scontrol requeue); CANCELLED means the user ended it with scancel.
        if state == "RUNNING":
            return "requeued" if requeue(job_id, run_dir, why="the preemption signal (SIGTERM)") else outcome
        log.info("job %s is %s; leaving its fate to Slurm", job_id, state or "in an unknown state")
        rundir.write_status(run_dir, state="stopped" if state == "CANCELLED" else "requeued")
        return outcome
    rundir.write_status(run_dir, state="requeued" if env.source != "submitit-local" else "stopped")
    return outcome


def slurm_job_state(job_id: str) -> str:
    """JobState from `scontrol show job`, or "" when Slurm does not answer."""
    try:
        proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    for field in proc.stdout.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return ""


def requeue(job_id: str, run_dir: str, why: str) -> bool:
    try:
        proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.error("could not run scontrol requeue %s: %s", job_id, exc)
        rundir.write_status(run_dir, state="stopped", error=f"scontrol requeue failed: {exc}")
        return False
    if proc.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job_id, proc.stderr.strip())
        rundir.write_status(run_dir, state="stopped", error=f"scontrol requeue failed: {proc.stderr.strip()}")
        return False
    rundir.write_status(run_dir, state="requeued")
    log.info("requeued job %s after %s", job_id, why)
    return True


__all__ = ["Job", "run_job", "EXIT_JOB_FAILED"]
