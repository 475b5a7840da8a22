"""The experiment trackers fed from the run's metrics (``trackers.*``).

Read by ``observe/trackers/`` (``mlflow_run.py``, ``wandb_run.py``, ``state.py``) through
``observe/metrics.py``, and ``launch/submit.py`` (the preflight of a tracker's URI). Every key
applies to a task and to a script.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Any

from clusterflow.config.sections.fields import RESOURCE, check, choice, doc

MLFLOW_KEYS = {
    "uri": "tracking URI: a directory (file store), sqlite:///PATH, or http(s)://HOST:PORT",
    "experiment": "experiment name (created when missing); empty: run.name",
}
WANDB_KEYS = {
    "project": "W&B project",
    "mode": "online (default) or offline (files under RUN_DIR/wandb/; wandb sync uploads them)",
    "entity": "W&B entity (user or team); empty: the account's default",
}


@dataclass
class TrackersConfig:
    """Experiment trackers that receive the same scalars as TensorBoard (docs/trackers.md)."""

    mlflow: dict[str, Any] = doc(
        factory=dict,
        help="MLflow, on when uri is set. "
        + "; ".join(f"trackers.mlflow.{k}: {v}" for k, v in MLFLOW_KEYS.items())
        + ". Needs pip install 'clusterflow[mlflow]'.",
        kind=RESOURCE,
        why="where the scalars are also sent; not what they are",
    )
    wandb: dict[str, Any] = doc(
        factory=dict,
        help="Weights & Biases, on when project is set. "
        + "; ".join(f"trackers.wandb.{k}: {v}" for k, v in WANDB_KEYS.items())
        + ". Needs pip install 'clusterflow[wandb]'.",
        kind=RESOURCE,
        why="where the scalars are also sent; not what they are",
    )

    def __post_init__(self) -> None:
        for name, known in (("mlflow", MLFLOW_KEYS), ("wandb", WANDB_KEYS)):
            for key, value in getattr(self, name).items():
                check(
                    key in known,
                    f"trackers.{name}.{key}",
                    value,
                    f"unknown key; keys of trackers.{name}: {', '.join(known)}",
                )
                check(
                    isinstance(value, str),
                    f"trackers.{name}.{key}",
                    value,
                    "must be text, e.g. " + ("sqlite:///mlflow.db" if key == "uri" else "demo"),
                )
        mode = self.wandb.get("mode", "online")
        choice("trackers.wandb.mode", mode, ("online", "offline"))
        if self.wandb and not self.wandb.get("project"):
            check(False, "trackers.wandb.project", "", "must be set to use W&B")
        if self.mlflow and not self.mlflow.get("uri"):
            check(False, "trackers.mlflow.uri", "", "must be set to use MLflow")
        if self.mlflow:
            _check_mlflow_uri(self.mlflow["uri"])


# The tracking-URI schemes MLflow's client opens (databases by their SQLAlchemy dialect).
_MLFLOW_SCHEMES = ("", "file", "http", "https", "sqlite", "postgresql", "mysql", "mssql")


def _check_mlflow_uri(uri: str) -> None:
    """A tracking URI MLflow can open; anything else would track nothing, silently."""
    parts = urllib.parse.urlsplit(uri)
    scheme = parts.scheme.split("+")[0]  # postgresql+psycopg2://...
    fix = "e.g. a directory, sqlite:///PATH/mlflow.db or http://HOST:5000"
    if len(parts.scheme) == 1:  # a Windows drive letter: a directory
        return
    check(
        scheme in _MLFLOW_SCHEMES or scheme == "databricks",
        "trackers.mlflow.uri",
        uri,
        f"scheme {parts.scheme!r} is not one MLflow tracks to "
        f"({', '.join(s for s in _MLFLOW_SCHEMES if s)}, databricks); {fix}",
    )
    if scheme in ("http", "https"):
        check(bool(parts.hostname), "trackers.mlflow.uri", uri, f"names no host; {fix}")
    if scheme == "sqlite":
        check(
            uri.startswith("sqlite:///") and len(uri) > len("sqlite:///"),
            "trackers.mlflow.uri",
            uri,
            f"a SQLite URI is sqlite:///RELATIVE/PATH or sqlite:////ABSOLUTE/PATH; {fix}",
        )
