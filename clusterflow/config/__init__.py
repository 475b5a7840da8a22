"""Typed configuration (no torch: it runs on the login node).

- ``job_config.py``: the :class:`Config` of sections, YAML + ``a.b=c`` overrides, ``check_resume``;
- ``sections/``: one dataclass per section, each in a module that names the code reading it, each
  field documented where it is declared (its help, kind, and whom it applies to: a task, a script);
- ``yaml_file.py``: reading a config file defensively;
- ``values.py``: from YAML values to typed fields;
- ``fingerprint.py``: every key classed result / numerics / resource, for resuming.

``python -m clusterflow.config`` prints the reference that docs/configuration.md holds.
"""

from clusterflow.config.job_config import (
    SECTIONS,
    TRAIN_ON,
    Config,
    build,
    check_resume,
    checkpoint_root,
    differences,
    from_dict,
    join,
    load,
    read_yaml,
    reference_markdown,
    resume_config,
)
from clusterflow.config.sections import (
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    DistConfig,
    MiningConfig,
    ObserveConfig,
    RunConfig,
    ScriptConfig,
    TaskConfig,
    TrackersConfig,
    TrainConfig,
    keys,
)

__all__ = [
    "SECTIONS",
    "TRAIN_ON",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "DataConfig",
    "DistConfig",
    "MiningConfig",
    "ObserveConfig",
    "RunConfig",
    "ScriptConfig",
    "TaskConfig",
    "TrackersConfig",
    "TrainConfig",
    "build",
    "check_resume",
    "checkpoint_root",
    "differences",
    "from_dict",
    "join",
    "keys",
    "load",
    "read_yaml",
    "reference_markdown",
    "resume_config",
]
