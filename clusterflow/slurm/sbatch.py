"""sbatch, through submitit: a config's Slurm parameters, the script submitit renders from them,
and the submission of one job or of one job array.

submitit renders the ``#SBATCH`` script (with ``_make_sbatch_string``, private to submitit: this
module is its only user, for ``--dry-run``) and starts ``sbatch`` on it. Its ``folder`` ends in
``%j``, which becomes the job id (``<array id>_<task>`` for a task), one folder per job for the
pickled callable and Slurm's output (:func:`job_folder`).

A sweep's members run as one job array: the submissions made inside ``executor.batch()`` become
one ``sbatch`` with ``#SBATCH --array=0-<N-1>%<array_parallelism>``, and task ``i`` runs the
``i``-th callable (``<array id>_<i>``). A batch of one is a plain job (submitit makes no array of
one). The callables (clusterflow's ``Job``) come from the caller. Login-node module: no torch.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import submitit
from submitit.slurm.slurm import _make_sbatch_string

from clusterflow.config.job_config import Config
from clusterflow.errors import UserError


def parameters(cfg: Config) -> dict[str, Any]:
    """The submitit SlurmExecutor parameters for this config (also what --dry-run renders)."""
    c = cfg.cluster
    params: dict[str, Any] = {
        "job_name": cfg.run.name,
        "nodes": c.nodes,
        "ntasks_per_node": c.tasks_per_node,
        "cpus_per_task": c.cpus_per_task,
        "time": c.time_min,
        "signal_delay_s": c.signal_delay_s,
        "setup": list(c.setup),
        # requeue: preempted or time-limited jobs come back; kill-on-bad-exit: one crashed rank
        # ends the step
        "additional_parameters": {"requeue": True, **c.sbatch_extra},
        "srun_args": ["--kill-on-bad-exit=1", *c.srun_args],
        "stderr_to_stdout": False,
    }
    if c.gpus_per_node:
        params["gpus_per_node"] = c.gpus_per_node
    if c.mem_gb:
        whole = c.mem_gb == int(c.mem_gb)
        params["mem"] = f"{int(c.mem_gb)}GB" if whole else f"{int(c.mem_gb * 1024)}MB"
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(c, key):
            params[key] = getattr(c, key)
    if c.exclusive:
        params["exclusive"] = True
    return params


def restarting(
    folder: str,
    params: dict[str, Any],
    cfg: Config,
    config_file: str,
    python: str | None = None,
) -> tuple[dict[str, Any], str]:
    """One job's parameters and command prefix for the restart driver (``python -m
    clusterflow.job.restarts``): the job allocates ``cluster.spare_nodes`` more nodes, and its
    batch step runs the driver, which starts the srun step itself (on ``cluster.nodes`` of them)
    and starts it again after a failure a restart can cure. Returns (parameters, the ``python``
    for submitit's executor): submitit appends ``-u -m submitit.core._submit FOLDER`` to that
    prefix, so the driver's srun runs submitit's entry with submitit's own output files. A job
    array keeps submitit's plain srun (a driver there would need each member's run dir)."""
    python = python or shlex.quote(sys.executable)
    paths = submitit.core.utils.JobPaths(folder=folder)
    srun = ["srun", "--unbuffered", "--output", str(paths.stdout)]
    if not params.get("stderr_to_stdout"):
        srun += ["--error", str(paths.stderr)]
    srun += list(params.get("srun_args", []))
    driver = [python, "-u -m clusterflow.job.restarts", shlex.quote(config_file), "--"]
    plain = {k: v for k, v in params.items() if k != "srun_args"}
    nodes = cfg.cluster.nodes + cfg.cluster.spare_nodes
    return dict(plain, nodes=nodes, use_srun=False), " ".join([*driver, shlex.join(srun), python])


def with_dependency(params: dict[str, Any], dep: str | None) -> dict[str, Any]:
    """The parameters with ``#SBATCH --dependency`` added (unchanged without one)."""
    if not dep:
        return params
    extra = {**params.get("additional_parameters", {}), "dependency": dep}
    return dict(params, additional_parameters=extra)


def job_folder(logs_dir: str) -> str:
    """submitit's folder for jobs whose Slurm output goes under ``logs_dir`` (absolute)."""
    return os.path.join(os.path.abspath(logs_dir), "%j")


def script(
    folder: str, params: dict[str, Any], python: str | None = None, array_size: int = 1
) -> str:
    """The exact script submitit submits for these parameters, rendered here without sbatch or
    srun (for --dry-run); ``array_size``: the tasks of a job array (1: a plain job)."""
    python = python or shlex.quote(sys.executable)
    command = " ".join([python, "-u -m submitit.core._submit", shlex.quote(folder)])
    return _make_sbatch_string(
        command=command, folder=folder, map_count=array_size if array_size > 1 else None, **params
    )


# -- job arrays --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArrayPlan:
    names: list[str]  # member names, in array order (task i runs names[i])
    configs: list[Config]  # their validated configs, same order
    parameters: dict[str, Any]  # for SlurmExecutor.update_parameters, array_parallelism included
    folder: str  # submitit's folder ("%j" becomes "<array id>_<task>")
    max_num_timeout: int

    @property
    def size(self) -> int:
        return len(self.names)


def array_plan(
    folder: str, configs: list[Config], names: list[str], max_parallel: int | None = None
) -> ArrayPlan:
    """One job array for these members (all must ask Slurm for the same resources)."""
    if not configs or len(configs) != len(names):
        # a programming error
        raise ValueError("array_plan needs one name per config, and at least one")
    if max_parallel is not None and max_parallel < 1:
        raise UserError(
            f"--max-parallel {max_parallel}: must be >= 1 (how many members run at once)"
        )
    params = [parameters(c) for c in configs]
    timeouts = {c.cluster.max_timeout_requeues for c in configs}
    for name, p in zip(names[1:], params[1:]):
        diff = sorted(k for k in set(p) | set(params[0]) if p.get(k) != params[0].get(k))
        if diff:
            raise UserError(
                f"sweep members {names[0]!r} and {name!r} ask Slurm for different "
                f"{', '.join(diff)}; one job array has one set of resources: "
                f"submit one sweep per value"
            )
    if len(timeouts) > 1:
        raise UserError(
            f"sweep members differ in cluster.max_timeout_requeues "
            f"({sorted(timeouts)}); give it once"
        )
    array = dict(params[0], array_parallelism=min(max_parallel or len(configs), len(configs)))
    return ArrayPlan(list(names), list(configs), array, folder, timeouts.pop())


# -- submission --------------------------------------------------------------------------------


def require_sbatch(local: str) -> None:
    """UserError unless sbatch is on PATH; ``local``: what ``--local`` would do instead."""
    if shutil.which("sbatch") is None:
        raise UserError(
            f"sbatch is not on PATH: this is not a Slurm login node; use --local to "
            f"{local} or --dry-run to see the script"
        )


def submit(
    folder: str, params: dict[str, Any], job: Callable[[], Any], python: str | None = None
) -> str:
    """sbatch one job that runs ``job()``; returns its job id. ``python``: the command prefix
    submitit puts before its entry (:func:`restarting`)."""
    ex = _executor(folder, params, python)
    dry_run = "python -m clusterflow.submit ... --dry-run"
    return _sbatch(lambda: [ex.submit(job)], "the job", dry_run)[0]


def submit_array(folder: str, params: dict[str, Any], jobs: list[Callable[[], Any]]) -> list[str]:
    """sbatch one job array whose task i runs ``jobs[i]()``; returns the task ids, in order
    (``<array id>_<i>``, or the plain job's id for a single job)."""
    ex = _executor(folder, params)

    def batch() -> list[Any]:
        with ex.batch():
            submitted = [ex.submit(job) for job in jobs]
        return submitted

    return _sbatch(batch, "the sweep's job array", "--dry-run")


def _executor(
    folder: str, params: dict[str, Any], python: str | None = None
) -> submitit.SlurmExecutor:
    # No max_num_timeout: clusterflow handles the time-limit signal and counts those requeues
    # itself (job/requeue.py, from stops.jsonl); submitit's own counter would be a second one.
    ex = submitit.SlurmExecutor(folder=folder, python=python)
    ex.update_parameters(**params)
    return ex


def _sbatch(submit_all: Callable[[], list[Any]], what: str, dry_run: str) -> list[str]:
    """The job ids of what ``submit_all`` submitted; sbatch's refusal becomes one UserError."""
    said = io.StringIO()  # submitit prints sbatch's complaint itself; it goes into our one line
    try:
        with contextlib.redirect_stderr(said):
            jobs = submit_all()
    except submitit.core.utils.FailedJobError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        why = "; ".join(lines) or "no reason given"
        raise UserError(
            f"sbatch refused {what} ({why}); fix the cluster.* keys it names "
            f"(see {dry_run} for the script)"
        ) from None
    sys.stderr.write(said.getvalue())
    return [str(j.job_id) for j in jobs]
