"""The callable that submitit pickles for a config: what every task of the job runs; and, for
``submit --local`` on GPUs, the memory one of its processes will need.

Both are loaded only at that moment: ``clusterflow.job.job`` imports the trainer, and
``clusterflow.train.memory_estimate`` builds the task's model, each with torch, which the login
node's commands never need (``import clusterflow.submit`` stays light). A local job imports
torch in this process a moment later anyway (submitit pickles the job here).
"""

from __future__ import annotations

from typing import Any

from clusterflow.config import Config
from clusterflow.launch.gpus import Need


def job_for(cfg: Config) -> Any:
    """A ``clusterflow.job.job.Job`` holding ``cfg``, resolved."""
    from clusterflow.job.job import Job  # torch: only once a job is submitted

    return Job(cfg.to_dict())


def memory_need(cfg: Config) -> Need | None:
    """What one process of ``cfg``'s run needs on its GPU (``train/memory_estimate.py``); None for a
    script of the user's own (``submit --script``), whose model is unknown before it runs (its
    task.target is only the default task, which it never trains)."""
    if cfg.script.path:
        return None
    from clusterflow.train import memory_estimate  # torch: only for a --local run on GPUs

    return Need(memory_estimate.estimate(cfg))
