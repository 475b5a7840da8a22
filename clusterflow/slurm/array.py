"""One Slurm job array for the members of a sweep, the way submitit submits one.

submitit turns the submissions made inside ``with executor.batch():`` into one ``sbatch`` with
``#SBATCH --array=0-<N-1>%<array_parallelism>`` and pickles each submission into the folder of its
task (``<folder>/<array id>_<task>``), so task ``i`` runs the ``i``-th callable. The integration:

    plan = slurm_array.array_plan(sweep.dir, [m.config for m in to_run], [m.name for m in to_run], max_parallel)
    ex = submitit.SlurmExecutor(folder=plan.folder, max_num_timeout=plan.max_num_timeout)
    ex.update_parameters(**plan.parameters)
    with ex.batch():
        jobs = [ex.submit(job) for job in plan.jobs]   # jobs[i].job_id == f"{array}_{i}"

A batch of one is a plain job (submitit does not make an array of one). Login-node module: the
Job objects are built lazily, and nothing here imports torch.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from typing import Any

from clusterflow import rundir
from clusterflow.config.job_config import Config
from clusterflow.errors import UserError


@dataclass(frozen=True)
class ArrayPlan:
    names: list[str]  # member names, in array order (task i runs names[i])
    configs: list[Config]  # their validated configs, same order
    parameters: dict[str, Any]  # SlurmExecutor.update_parameters(**parameters), array_parallelism included
    folder: str  # submitit's folder ("%j" becomes "<array id>_<task>")
    max_num_timeout: int

    @property
    def jobs(self) -> list[Any]:
        """The callables submitit pickles, one per array task, in array order."""
        from clusterflow.job.job import Job

        return [Job(cfg.to_dict()) for cfg in self.configs]


def array_plan(sweep_dir: str, configs: list[Config], names: list[str], max_parallel: int | None = None) -> ArrayPlan:
    """What the submit integration hands to submitit for these members (all must share resources)."""
    from clusterflow.launch.submit import slurm_parameters  # late: submit imports this module

    if not configs or len(configs) != len(names):
        raise ValueError("array_plan needs one name per config, and at least one")  # a programming error
    if max_parallel is not None and max_parallel < 1:
        raise UserError(f"--max-parallel {max_parallel}: must be >= 1 (how many members run at once)")
    params = [slurm_parameters(c) for c in configs]
    timeouts = {c.cluster.max_timeout_requeues for c in configs}
    for name, p in zip(names[1:], params[1:]):
        diff = sorted(k for k in set(p) | set(params[0]) if p.get(k) != params[0].get(k))
        if diff:
            raise UserError(f"sweep members {names[0]!r} and {name!r} ask Slurm for different {', '.join(diff)}; "
                            f"one job array has one set of resources: submit one sweep per value")
    if len(timeouts) > 1:
        raise UserError(f"sweep members differ in cluster.max_timeout_requeues ({sorted(timeouts)}); give it once")
    parameters = dict(params[0], array_parallelism=min(max_parallel or len(configs), len(configs)))
    folder = os.path.abspath(os.path.join(rundir.RunPaths(sweep_dir).slurm_logs, "%j"))
    return ArrayPlan(list(names), list(configs), parameters, folder, timeouts.pop())


def sbatch_script(plan: ArrayPlan, python: str | None = None) -> str:
    """The script submitit would submit for the array (rendered without sbatch; for --dry-run)."""
    from submitit.slurm.slurm import _make_sbatch_string

    python = python or shlex.quote(sys.executable)
    command = " ".join([python, "-u -m submitit.core._submit", shlex.quote(plan.folder)])
    count = len(plan.configs)
    return _make_sbatch_string(command=command, folder=plan.folder, map_count=count if count > 1 else None, **plan.parameters)
