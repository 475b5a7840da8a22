"""The job every task runs, whoever launched it (submitit on Slurm, submitit locally, srun,
torchrun).

``Job`` is what submitit pickles; ``run_job`` is what ``python -m clusterflow.run`` calls. Both
end in :func:`run_job`: read the environment, join the process group, agree on rank 0's config,
record the attempt, train, and hand the outcome to ``requeue.after_stop`` (exit, requeue, or fail).
Requeue carries no state: ``checkpoint()`` returns a fresh Job and the store holds the rest.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from clusterflow import rundir
from clusterflow.config.job_config import Config, from_dict
from clusterflow.distributed import comm as dist
from clusterflow.distributed.env import DistEnv
from clusterflow.errors import EXIT_JOB_FAILED, RunFailed, UserError
from clusterflow.job import failure, node_fault, restarts
from clusterflow.job.requeue import after_stop
from clusterflow.observe import observer as observe
from clusterflow.observe import timeline
from clusterflow.rundir import (
    cancel_marker,
    first_error,
    frozen_code,
    lease,
    saved_config,
    states,
    transitions,
)
from clusterflow.rundir.states import StopReason
from clusterflow.tasks import Stopped, Task, load_task
from clusterflow.train.preemption import REASONS, Preemption
from clusterflow.train.trainer import Trainer

if TYPE_CHECKING:
    import submitit

log = logging.getLogger("clusterflow")


class Job:
    """Picklable entry point for submitit. Holds only the resolved config."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = dict(config)

    def __call__(self) -> str:
        outcome = run_job(self.config)
        if outcome == states.FAILED:
            raise RuntimeError(
                "clusterflow job failed; see the rank logs and `python -m clusterflow.status`"
            )
        return outcome

    def checkpoint(self, *args: object, **kwargs: object) -> submitit.helpers.DelayedSubmission:
        """submitit's requeue hook: state is on disk, so a fresh Job is all a requeue needs."""
        import submitit

        return submitit.helpers.DelayedSubmission(Job(self.config))


def setup_logging(paths: rundir.RunPaths, rank: int, attempt: int) -> None:
    fmt = logging.Formatter(
        f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S"
    )
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
    _warnings_to(paths.warnings_file(rank, attempt))


# What torch appends to a warning raised in its C++ code: where, in torch's own sources.
_TORCH_WHERE = " (Triggered internally at "
_warned = logging.getLogger("clusterflow.warnings")


def _warnings_to(whole_file: str) -> None:
    """Python warnings (torch's included, whose text can run to many lines of its internals):
    one line in the log (and so on rank 0's console), the whole warning with where it was raised
    in ``whole_file``."""

    def show(
        message: Warning | str, category: type[Warning], filename: str, lineno: int, *_: object
    ) -> None:
        text = str(message).strip()
        first = (text.splitlines() or [""])[0].split(_TORCH_WHERE)[0]
        try:
            os.makedirs(os.path.dirname(whole_file), exist_ok=True)
            with open(whole_file, "a") as f:
                f.write(f"{category.__name__} at {filename}:{lineno}:\n{text}\n\n")
        except OSError as exc:  # a full disk must not turn a warning into a failure
            first += f" (not kept whole: {exc.strerror})"
        _warned.warning(
            "%s: %s (the whole warning: %s)", category.__name__, first[:300], whole_file
        )

    warnings.showwarning = show


def _threads(env: DistEnv, environ: Mapping[str, str]) -> None:
    """Keep processes sharing a node from oversubscribing its cores."""
    if "OMP_NUM_THREADS" not in environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, env.local_world_size)))


def _start(env: DistEnv, cfg: Config, paths: rundir.RunPaths, device: torch.device) -> int:
    """Record this attempt (rank 0) and set up logging everywhere; returns the attempt number."""

    # Every rank's process, so that `status` can tell a live run from one whose processes are all
    # gone; and when the first of them started, where the attempt's start-up began (the goodput
    # ledger's, also for an attempt that dies before its first step).
    mine = [socket.gethostname(), os.getpid(), lease.process_start(os.getpid())]
    gathered = dist.gather_object([mine, timeline.process_started_at()])
    attempt = 0
    if env.is_main:
        os.makedirs(paths.root, exist_ok=True)
        procs = [p for p, _ in gathered]
        starts = [t for _, t in gathered if t is not None]
        attempt = rundir.record_attempt(
            paths,
            job_id=env.job_id,
            restart_count=env.attempt,
            restart_in_job=env.restart_in_job,
            hosts=list(env.hosts),
            world_size=env.world_size,
            source=env.source,
            host=socket.gethostname(),
            procs=procs,
            process_started_at=min(starts) if starts else None,
        )
    attempt = int(dist.broadcast_object(attempt))
    setup_logging(paths, env.rank, attempt)
    if env.is_main:
        transitions.mark_started(
            paths,
            job_id=env.job_id,
            world_size=env.world_size,
            hosts=sorted({p[0] for p, _ in gathered or []}),
            attempt=attempt,
        )
    log.info(
        "rank %d/%d on %s (%s, local rank %d, device %s), job %s attempt %d, master %s:%d",
        env.rank,
        env.world_size,
        socket.gethostname(),
        env.source,
        env.local_rank,
        device,
        env.job_id,
        attempt,
        env.master_addr,
        env.master_port,
    )
    return attempt


def run_job(config: Mapping[str, Any] | Config, environ: Mapping[str, str] | None = None) -> str:
    """Run this task's share of the job. Returns completed, preempted, timeout, interrupted,
    cancelled, requeued or failed."""

    environ = os.environ if environ is None else environ
    env = DistEnv.from_env(environ)
    cfg = config if isinstance(config, Config) else from_dict(dict(config))
    paths = rundir.RunPaths(cfg.run.dir)  # built once here, passed down
    held = False  # until this job holds the run dir, nothing is written there (not even an error)
    try:
        # The flight recorder reads its variables when the group starts.
        observe.before_init(paths, environ)
        device = dist.init(env, cfg.dist.backend, cfg.dist.timeout_s)
        # Every rank runs on rank 0's resolved config, never on a file re-read later.
        cfg = from_dict(_take_run_dir(env, cfg, paths, environ))
        held = True
        if _cancelled_before_start(env, paths):
            return _end_cancelled(paths, env, environ)
        attempt = _start(env, cfg, paths, device)
        _threads(env, environ)

        # Rank 0 looks for the user's cancel while training; the agreement tells the others.
        preemption = Preemption(
            (lambda: cancel_marker.is_cancelled(paths)) if env.is_main else None
        ).install()

        # The code frozen at submission, on every rank of every attempt.
        frozen_code.activate(paths)
        task = _build_task(cfg, preemption)
        if task is None:
            outcome = _stopped_while_building(preemption)
        else:
            trainer = Trainer(cfg, paths, task, device, attempt, preemption)
            # Heartbeats, stall watchdog.
            stalled = functools.partial(
                _requeue_after_stall, cfg=cfg, paths=paths, env=env, environ=environ
            )
            observer = observe.Observer(cfg, paths, env.rank, attempt, device, after_stall=stalled)
            with observer.watching(trainer.phases):
                outcome = trainer.fit()
        if env.is_main:
            outcome = after_stop(
                paths,
                outcome,
                env,
                environ,
                cfg.cluster.max_timeout_requeues,
                preemption.received_at,
            )
            _let_go(paths, environ, outcome)
        outcome = dist.broadcast_object(outcome)
        dist.barrier()  # nobody tears the group down while a peer still talks to it
        dist.shutdown()
        return outcome
    except BaseException as exc:
        if held and env.is_main:
            _let_go(paths, environ, states.FAILED)
        _record_failure(exc, cfg, paths, env.rank, environ, write=held)
        raise


def _build_task(cfg: Config, preemption: Preemption) -> Task | None:
    """Collective. The task, or None on every rank when any rank was asked to stop while building
    it (a long dataset scan ends at the signal instead of after the scan)."""
    try:
        task = load_task(
            cfg.task.target, cfg.run.seed, cfg.task.params, stop=lambda: preemption.requested
        )
    except Stopped as exc:
        log.warning("%s (%s): stopping before the first step", exc, preemption.reason())
        task = None
    return None if dist.any_rank(task is None) else task


def _stopped_while_building(preemption: Preemption) -> str:
    """Collective. The stop reason all ranks agree on when a stop came while the task was built:
    the strongest any rank received ("preempted" where a rank stopped only because a peer did)."""
    strongest = dist.all_reduce_dict({"r": REASONS.index(preemption.reason())}, op="max")["r"]
    reason = REASONS[int(strongest)] or StopReason.PREEMPTED
    log.warning("signal received (%s) while building the task: stopping, nothing trained", reason)
    return reason


def _take_run_dir(
    env: DistEnv, cfg: Config, paths: rundir.RunPaths, environ: Mapping[str, str]
) -> dict[str, Any]:
    """Collective. Rank 0 takes the run dir's lease (one job per run dir), then resolves the
    config against the saved one (writing it on a first start); every rank gets that config, or
    the reason this job may not run there."""

    answer: Any = None
    if env.is_main:
        try:
            lease.hold(paths, env, cfg.run.lease_s, dict(environ))
            relaunch = env.attempt > 0 or env.restart_in_job > 0
            answer, _ = saved_config.resolve(cfg, relaunch=relaunch)
            answer = answer.to_dict()
        except (UserError, OSError) as exc:
            # Every rank must hear it, or the others wait for rank 0.
            lease.release(paths)
            answer = (
                str(exc)
                if isinstance(exc, UserError)
                else f"run dir {paths.root!r} cannot be used: {exc}"
            )
    answer = dist.broadcast_object(answer)
    if isinstance(answer, str):
        raise UserError(answer)
    return answer


def _cancelled_before_start(env: DistEnv, paths: rundir.RunPaths) -> bool:
    """Collective. Whether the user cancelled the run before this job started (a job that was
    queued, or requeued, when ``clusterflow cancel`` ran): rank 0 reads the marker, every rank
    hears its answer."""
    seen = cancel_marker.is_cancelled(paths) if env.is_main else None
    return bool(dist.broadcast_object(seen))


def _end_cancelled(paths: rundir.RunPaths, env: DistEnv, environ: Mapping[str, str]) -> str:
    """End a cancelled run's job before anything is trained or recorded: state ``cancelled``,
    the run dir released, outcome ``cancelled`` (the process exits 0)."""
    if env.is_main:
        transitions.mark_cancelled(paths, job_id=env.job_id)
        print(
            f"run {paths.root} was cancelled by the user ({paths.cancelled}): not training. "
            "Submitting the run again resumes it.",
            flush=True,
        )
        _let_go(paths, environ, states.CANCELLED)
    dist.barrier()
    dist.shutdown()
    return states.CANCELLED


def _let_go(paths: rundir.RunPaths, environ: Mapping[str, str], outcome: str) -> None:
    """Rank 0 at the end: release the run dir, except for a Slurm job that may come back (its
    requeued attempt takes its own lease; anyone else finds the job gone from squeue)."""

    ended = (states.COMPLETED, states.FAILED, states.CANCELLED)
    if outcome in ended or not environ.get("SLURM_JOB_ID"):
        lease.release(paths)


def _record_failure(
    exc: BaseException,
    cfg: Config,
    paths: rundir.RunPaths,
    rank: int,
    environ: Mapping[str, str],
    write: bool = True,
) -> None:
    """Write who failed and why, with the exit status (``failure.describe``; only into a run dir
    this job holds): bad input is one line and exit 2; a full disk or a diverged loss one line and
    exit 1; the task's own code its traceback and exit 1. A node's fault that is the attempt's
    first cause requeues the job without that node (``node_fault``)."""
    if isinstance(exc, SystemExit) and exc.code in (0, None):
        return
    f = failure.describe(exc, cfg.task.target)
    host = socket.gethostname()
    device_error = node_fault.device_error(f.message) if cfg.cluster.exclude_failed_nodes else None
    requeued = False
    try:
        if write:
            rundir.write_error(paths, rank, host, f.message, f.trace)
            # The first rank to fail names the cause; a peer's later "connection closed" does not
            # replace it. Two ranks' read-modify-writes of status.json at once may lose the
            # winner's error: status then reads the cause from the first-error record, which no
            # later write replaces.
            # Its exit status too: a bad image (2) on rank 0 stays 2 when rank 1 then fails on
            # the closed connection (1), whatever the world size.
            attempt = _attempt_of(paths)
            first = first_error.record(paths, attempt, rank, f.message, exit_code=f.code)
            requeued = (
                first
                and device_error is not None
                and not _restarted_here(host, environ)
                and node_fault.requeue_without(
                    paths,
                    environ,
                    node_fault.Fault(rank, host, f.message),
                    cfg.cluster.max_node_failures,
                )
            )
            if not requeued and (first or not _requeued_already(paths)):
                _write_failed(paths, rank, f, first)
    except (OSError, RunFailed):
        pass  # a full disk or a vanished run dir: the message below still reaches the user
    # The task's traceback, in the rank log (echoed by --local).
    shown = f.trace if f.named and f.trace else ""
    log.error("rank %d failed: %s%s", rank, f.message, f"\n{shown}" if shown else "")
    if f.named or requeued:
        later = (
            f"; its traceback is in {paths.log_file(rank, _attempt_of(paths))}"
            if shown and write
            else ""
        )
        left_out = f"; node {host} left out and the job requeued" if requeued else ""
        print(f"error: {f.message}{left_out}{later}", file=sys.stderr)
        raise SystemExit(f.code) from None


def _write_failed(paths: rundir.RunPaths, rank: int, f: failure.Failure, first: bool) -> None:
    """status.json says failed; the first cause also gives its error and exit status."""
    cause = {"error": f"rank {rank}: {f.message}", "exit_code": f.code} if first else {}
    transitions.mark_failed(paths, **cause)


def _requeued_already(paths: rundir.RunPaths) -> bool:
    """Whether the rank that failed first requeued the job (a node's fault): a peer's later error,
    a consequence of that, must not turn the state into failed."""
    recorded, _ = rundir.read_object(paths.status)
    return recorded.get("state") == states.REQUEUED


def _requeue_after_stall(
    rec: dict[str, Any],
    cfg: Config,
    paths: rundir.RunPaths,
    env: DistEnv,
    environ: Mapping[str, str],
) -> None:
    """The watchdog ended this rank: when it is the attempt's first cause and was not waiting for
    its peers (then it is more likely their victim), its node is the suspect."""
    if not (cfg.cluster.exclude_failed_nodes and rec.get("won") and not rec.get("waiting")):
        return
    if _restarted_here(rec["host"], environ):
        return
    # "rank R on HOST stalled N s at step S in PHASE (where)": the fault names rank and host
    cause = str(rec["error"]).removeprefix(f"rank {env.rank} on {rec['host']} ")
    node_fault.requeue_without(
        paths,
        environ,
        node_fault.Fault(env.rank, rec["host"], cause),
        cfg.cluster.max_node_failures,
    )


def _restarted_here(host: str, environ: Mapping[str, str]) -> bool:
    """Whether the batch step's driver restarts this job inside its allocation without ``host``
    after a node fault (``job/restarts.py``): then the failing rank does not requeue the job."""
    if environ.get(restarts.NODE_FAULT_RESTARTS_ENV) != "1":
        return False
    log.error("node %s failed; the job restarts inside its allocation without it", host)
    return True


def _attempt_of(paths: rundir.RunPaths) -> int:
    return rundir.current_attempt(paths)


__all__ = ["EXIT_JOB_FAILED", "Job", "run_job"]
