"""The callable that submitit pickles for a config: what every task of the job runs.

It is loaded only when a job is handed to submitit: ``clusterflow.job.job`` imports the trainer,
and with it torch, which the login node's commands never need (``import clusterflow.submit``
stays light).
"""

from __future__ import annotations

from typing import Any

from clusterflow.config import Config


def job_for(cfg: Config) -> Any:
    """A ``clusterflow.job.job.Job`` holding ``cfg``, resolved."""
    from clusterflow.job.job import Job  # torch: only once a job is submitted

    return Job(cfg.to_dict())
