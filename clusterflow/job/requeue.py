"""What a job does after the trainer stopped: the decision is a pure function, its execution thin.

:func:`decide` maps (outcome, launcher, Slurm's view of the job, time-limit stops so far, limit)
to an :class:`Action`; it is tested as a table, without a cluster. :func:`after_stop` (rank 0)
records the stop, asks Slurm only what the decision needs, and carries the action out.

Time-limit requeues are counted in one place: the ``timeout`` lines of ``RUN_DIR/stops.jsonl``
(``cluster.max_timeout_requeues`` bounds them; preemptions are not counted).
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from clusterflow import rundir
from clusterflow.distributed.env import DistEnv
from clusterflow.errors import EXIT_REQUEUE_OUTSIDE
from clusterflow.rundir import cancel_marker, saved_config, transitions
from clusterflow.rundir.states import State, StopHow, StopReason
from clusterflow.slurm import commands as slurm_commands
from clusterflow.slurm import jobids

log = logging.getLogger("clusterflow")

# The outcome of a job that leaves its requeue to the batch script outside (no scontrol here).
REQUEUE_OUTSIDE = "requeue-outside"

# Slurm's view of the job when this environment has no scontrol (a container): unknown, and the job
# cannot requeue itself; the batch script outside can (EXIT_REQUEUE_OUTSIDE).
NO_SCONTROL = "no scontrol here"
# Set by the batch templates: a file rank 0 creates when it asks for a requeue from outside. The
# step's exit status alone can lose that request: srun --kill-on-bad-exit kills the ranks still
# exiting, and srun then returns 128+9, not 75.
REQUEUE_MARKER_ENV = "CLUSTERFLOW_REQUEUE_MARKER"


@dataclass(frozen=True)
class Action:
    # what the job reports: completed, requeued, preempted, timeout, interrupted or cancelled
    outcome: str
    state: State  # what status.json says
    requeue: bool = False  # run `scontrol requeue` (on success: outcome and state "requeued")
    why: str = ""  # for the log line of a requeue
    error: str | None = None


def decide(
    outcome: str,
    source: str,
    slurm_state: str | None,
    timeouts: int,
    limit: int,
    *,
    interactive: bool = False,
    ends: str | None = None,
) -> Action:
    """``outcome``: completed, preempted, timeout, interrupted (SIGINT) or cancelled (the user's
    marker) (from the trainer); ``source``: the launcher
    (slurm, torchrun, submitit-local, single); ``slurm_state``: JobState of this job (None outside
    a Slurm job, "" when scontrol did not answer or was not asked, :data:`NO_SCONTROL` when this
    environment has no scontrol); ``timeouts``: time-limit stops
    so far, this one included; ``limit``: cluster.max_timeout_requeues; ``interactive``: the job
    is an allocation made by ``salloc`` (Slurm requeues batch jobs only); ``ends``: Slurm's words
    that it ends the job without a requeue (``slurm.commands.not_requeued``), None when it
    counted one or did not say."""
    if outcome == State.COMPLETED:
        return Action(State.COMPLETED, State.COMPLETED)
    if outcome == StopReason.CANCELLED:
        return Action(StopReason.CANCELLED, State.CANCELLED)
    if outcome == StopReason.INTERRUPTED:  # the user stopped it here: nothing brings it back
        return Action(StopReason.INTERRUPTED, State.STOPPED)
    if slurm_state is None:  # not a Slurm job: nothing brings it back; the same command resumes
        return Action(outcome, State.STOPPED)
    if interactive:  # saved; the user runs the same command again
        return Action(State.STOPPED, State.STOPPED)
    if outcome == StopReason.TIMEOUT:
        if timeouts > limit:
            return Action(
                StopReason.TIMEOUT,
                State.STOPPED,
                error=f"time limit reached {timeouts} times (cluster.max_timeout_requeues="
                f"{limit}); resume by submitting the same config again",
            )
        return Action(StopReason.TIMEOUT, State.REQUEUED, requeue=True, why="the time-limit signal")
    # Slurm requeues a preempted job only if it is still running when the grace time ends; one that
    # saved and exited early is recorded as COMPLETED and never comes back. So while the job still
    # runs (preemption, or a bare SIGTERM) it requeues itself. COMPLETING means a requeue is already
    # under way (scontrol requeue); CANCELLED means the user ended it with scancel (after_stop
    # tells a cancel from the COMPLETING it shows its own ranks: slurm.commands.cancelled).
    # Without scontrol the job cannot tell whether Slurm will bring it back: ask the batch script
    # outside to requeue it (an early exit after the save would otherwise end the job for good).
    if slurm_state in ("RUNNING", NO_SCONTROL):
        return Action(outcome, State.REQUEUED, requeue=True, why="the preemption signal (SIGTERM)")
    if slurm_state == "CANCELLED":  # saved; submitting the same config resumes it
        return Action(StopReason.CANCELLED, State.CANCELLED)
    # The SIGTERM was the job's end, not a preemption: its batch step died (the OOM killer on the
    # batch node, a kill of the batch script) and nothing runs the job again.
    if ends is not None:
        return Action(
            State.FAILED,
            State.FAILED,
            error=f"{ends}: the SIGTERM was the job's end, not a preemption",
        )
    return Action(outcome, State.REQUEUED)


def after_stop(
    paths: rundir.RunPaths,
    outcome: str,
    env: DistEnv,
    environ: Mapping[str, str],
    limit: int,
    stop: Mapping[str, object] | None = None,
) -> str:
    """Rank 0: record the outcome and carry out :func:`decide`'s action; returns the job's outcome.
    ``env``: this job's; ``environ``: the environment it was read from; ``stop``: what the stop's
    line in stops.jsonl says of how it came about (``Preemption.stop_record``: ``signal_at``, and
    for a time-limit stop ``how``, ``end_at``, ``save_s``, ``due_at``; the attempt and the step
    reached)."""
    # An array task is requeued as A_T: the bare array id would requeue every task of the array.
    job_id = (jobids.requeue_target(environ) or "") if env.source in ("slurm", "torchrun") else ""
    slurm_state, interactive, ends = None, False, None
    if job_id:  # Slurm is asked only what the decision needs
        slurm_state = ""
        if outcome == StopReason.PREEMPTED:
            fields = slurm_commands.job_fields(job_id)
            slurm_state = fields.get("JobState", "")
            if slurm_commands.cancelled(fields, env.attempt):
                slurm_state = "CANCELLED"
            ends = slurm_commands.not_requeued(job_id, fields, env.attempt)
        if outcome == StopReason.PREEMPTED and not slurm_commands.available("scontrol"):
            slurm_state = NO_SCONTROL
        if outcome in (StopReason.PREEMPTED, StopReason.TIMEOUT):
            interactive = slurm_commands.is_batch(job_id) is False
    timeouts = 0
    if outcome != State.COMPLETED:
        # Slurm's JobState tells a preemption (still RUNNING: the job requeues itself) from
        # Slurm's own requeue (COMPLETING) in the run's fault records (rundir/faults.py).
        said = {"slurm_state": slurm_state} if slurm_state not in (None, "", NO_SCONTROL) else {}
        rundir.record_stop(paths, reason=outcome, job_id=env.job_id, **dict(stop or {}), **said)
        timeouts = rundir.count_stops(paths, StopReason.TIMEOUT)
    action = decide(
        outcome, env.source, slurm_state, timeouts, limit, interactive=interactive, ends=ends
    )
    # The user's cancel wins over any requeue.
    if outcome != State.COMPLETED and cancel_marker.is_cancelled(paths):
        transitions.mark_cancelled(paths)
        log.info("run cancelled by the user (%s): not requeued", paths.cancelled)
        return action.outcome
    if action.requeue:
        why = action.why
        if outcome == StopReason.TIMEOUT and (stop or {}).get("how") == StopHow.END:
            why = "the job's end came closer than a save"
        return requeue(job_id, paths, why) or action.outcome
    if interactive:
        transitions.mark_stopped(paths)
        log.warning(
            "stopped (%s) inside an interactive allocation (salloc), which Slurm does not "
            "requeue; the checkpoint is saved: run the same command again to resume: %s",
            outcome,
            resume_command(),
        )
        return action.outcome
    if action.state == State.FAILED:
        error = f"{action.error}; {saved_config.how_to_resume(paths)}"
        log.error("%s", error)
        transitions.mark_failed(paths, error=error)
        return action.outcome
    if action.state == State.CANCELLED:
        log.info("job %s was cancelled (scancel); %s", job_id, saved_config.how_to_resume(paths))
    elif outcome == StopReason.PREEMPTED and slurm_state is not None:
        log.info(
            "job %s is %s; leaving its fate to Slurm", job_id, slurm_state or "in an unknown state"
        )
    transitions.mark_ended(paths, action.state, error=action.error or None)
    if outcome == State.COMPLETED:
        log.info("run completed; final weights in %s", paths.model)
    return action.outcome


def _mark_requeue_outside() -> None:
    """Create the batch script's requeue marker (:data:`REQUEUE_MARKER_ENV`), when it set one."""
    marker = os.environ.get(REQUEUE_MARKER_ENV, "")
    if not marker:
        return
    try:
        with open(marker, "w") as f:
            f.write(f"{EXIT_REQUEUE_OUTSIDE}\n")
    except OSError as exc:  # the exit status still asks for the requeue
        log.warning("could not write the requeue marker %s: %s", marker, exc)


def resume_command() -> str:
    """The command line this process runs (``srun`` and its flags not included)."""
    return shlex.join(["python", "-m", "clusterflow.run", *sys.argv[1:]])


def requeue(job_id: str, paths: rundir.RunPaths, why: str) -> str:
    """``scontrol requeue`` this job: "requeued"; "requeue-outside" when this environment has no
    ``scontrol`` (a container: the batch script outside requeues on the exit status
    ``EXIT_REQUEUE_OUTSIDE``); "" when Slurm refuses (the run is recorded as stopped)."""
    out = slurm_commands.requeue(job_id)
    if out.missing:
        _mark_requeue_outside()
        transitions.mark_requeued(paths)
        log.warning(
            "scontrol is not in this job's PATH (a container?): exiting with status %d after %s "
            "so that the batch script outside requeues job %s (slurm_templates/train.sbatch does)",
            EXIT_REQUEUE_OUTSIDE,
            why,
            job_id,
        )
        return REQUEUE_OUTSIDE
    if not out.ok:
        said = out.error if out.returncode is None else out.stderr.strip()
        if out.returncode is None:
            log.error("could not run scontrol requeue %s: %s", job_id, said)
        else:
            log.error("scontrol requeue %s failed: %s", job_id, said)
        transitions.mark_stopped(paths, error=f"scontrol requeue failed: {said}")
        return ""
    transitions.mark_requeued(paths)
    log.info("requeued job %s after %s", job_id, why)
    return State.REQUEUED
