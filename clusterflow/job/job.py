"""The job every task runs, whoever launched it (submitit on Slurm, submitit locally, srun,
torchrun).

``Job`` is what submitit pickles; ``run_job`` is what ``python -m clusterflow.run`` calls. Both
end in :func:`run_job`: an :class:`~clusterflow.job.attempt.Attempt` (the process group, the run
dir, the attempt's record, the end: exit, requeue, or fail) around the task's trainer, or around
a script of the user's own (``script.path``: ``job/script.py``). Requeue carries no state:
``checkpoint()`` returns a fresh Job and the store holds the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from clusterflow.config.job_config import Config, from_dict
from clusterflow.distributed import comm as dist
from clusterflow.errors import EXIT_JOB_FAILED
from clusterflow.job.attempt import Attempt
from clusterflow.job.script import run_script
from clusterflow.observe.timeline import TASK_DATA
from clusterflow.rundir import frozen_code, states
from clusterflow.rundir.states import StopReason
from clusterflow.tasks import Stopped, Task, load_task
from clusterflow.train import builders
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


def run_job(config: Mapping[str, Any] | Config, environ: Mapping[str, str] | None = None) -> str:
    """Run this task's share of the job. Returns completed, preempted, timeout, interrupted,
    cancelled, requeued or failed."""
    cfg = config if isinstance(config, Config) else from_dict(dict(config))
    if cfg.script.path:
        return run_script(cfg, environ)
    job = Attempt(cfg, environ)
    try:
        if not job.begin():
            return job.outcome or states.CANCELLED
        cfg = job.cfg
        # The code frozen at submission, on every rank of every attempt.
        frozen_code.activate(job.paths)
        task = _build_task(cfg, job.preemption)
        job.startup.mark(TASK_DATA)
        if task is None:
            outcome, _ = job.end(_stopped_while_building(job.preemption))
            return outcome
        run, internals = job.open_run(
            builders.amp_dtype(cfg.train.amp, job.device), cfg.task.target
        )
        return Trainer(run, internals, task).fit()
    except BaseException as exc:
        job.fail(exc)
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


__all__ = ["EXIT_JOB_FAILED", "Job", "run_job"]
