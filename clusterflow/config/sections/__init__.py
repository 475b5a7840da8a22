"""The config sections: one dataclass per section, each in a module of its own that names the
code reading it, each field documented where it is declared (``fields.doc``): its help text (the
configuration reference, ``docs/configuration.md``, is generated from it by ``python -m
clusterflow.config``), its ``kind`` and ``why`` (what changing it does to a run's result:
``fingerprint.py`` builds its table from them), and whom it ``applies`` to (a task's job, a
script's, or both). ``__post_init__`` checks say what is wrong and how to fix it.
``job_config.py`` assembles the sections and reads YAML and overrides; ``clusterflow.config``
re-exports these classes. No torch here: this runs on the login node.

- ``run.py``, ``cluster.py``, ``dist.py``, ``checkpoint.py``, ``mining.py``, ``trackers.py``,
  ``observe.py``: keys of every job, a task's or a script's;
- ``train.py``: the task trainer's keys, and the few a script's loop shares (``applies``);
- ``task.py``, ``data.py``: a task's; ``script.py``: a script's;
- ``fields.py``: ``doc(...)`` and the checks every section calls.
"""

from clusterflow.config.sections.checkpoint import CheckpointConfig
from clusterflow.config.sections.cluster import ClusterConfig
from clusterflow.config.sections.data import DataConfig
from clusterflow.config.sections.dist import DistConfig
from clusterflow.config.sections.fields import (
    APPLIES,
    BOTH,
    KINDS,
    NUMERICS,
    RESOURCE,
    RESULT,
    SCRIPT,
    SEED_LIMIT,
    TASK,
    check,
    choice,
    doc,
    is_url,
    keys,
)
from clusterflow.config.sections.mining import MiningConfig
from clusterflow.config.sections.observe import ObserveConfig
from clusterflow.config.sections.run import RunConfig
from clusterflow.config.sections.script import ScriptConfig
from clusterflow.config.sections.task import TaskConfig
from clusterflow.config.sections.trackers import TrackersConfig
from clusterflow.config.sections.train import TrainConfig

# Section name -> its dataclass, in the order of the config reference.
SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "cluster": ClusterConfig,
    "dist": DistConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "mining": MiningConfig,
    "task": TaskConfig,
    "data": DataConfig,
    "trackers": TrackersConfig,
    "observe": ObserveConfig,
    "script": ScriptConfig,
}

__all__ = [
    "APPLIES",
    "BOTH",
    "KINDS",
    "NUMERICS",
    "RESOURCE",
    "RESULT",
    "SCRIPT",
    "SECTIONS",
    "SEED_LIMIT",
    "TASK",
    "CheckpointConfig",
    "ClusterConfig",
    "DataConfig",
    "DistConfig",
    "MiningConfig",
    "ObserveConfig",
    "RunConfig",
    "ScriptConfig",
    "TaskConfig",
    "TrackersConfig",
    "TrainConfig",
    "check",
    "choice",
    "doc",
    "is_url",
    "keys",
]
