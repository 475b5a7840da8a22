"""MLflow: one MLflow run per clusterflow run, through ``MlflowClient`` (no global active run).

The run id is kept in ``trackers.json``; the steps MLflow already holds are read back from the
server's metric histories when an attempt reopens the run, so no point is sent twice.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from clusterflow.observe.trackers.state import StateFile
from clusterflow.rundir.states import State

# MLflow's own retries take minutes per request; the pump retries instead, without blocking.
_HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
_STATUS = {State.COMPLETED: "FINISHED", State.FAILED: "FAILED", State.CANCELLED: "KILLED"}
_PARAM_CHARS = 6000  # MLflow's limit on a parameter value
_BATCH = 1000  # MLflow's limit on metrics per log_batch


class MlflowBackend:
    name = "mlflow"

    def __init__(self, cfg: Mapping[str, str], run_name: str) -> None:
        self.uri = cfg["uri"]
        self.experiment = cfg.get("experiment") or run_name
        self.run_name = run_name
        self.run_id = ""
        self._client: Any = None
        # Each step's timestamp, kept until its points are delivered: a send retried after a
        # partial failure or a timeout repeats identical points, which MLflow's store drops,
        # instead of the same step again under a new timestamp.
        self._stamps: dict[int, int] = {}

    def open(self, state: StateFile, params: Mapping[str, str]) -> dict[str, int]:
        for key, value in _HTTP_ENV.items():
            os.environ.setdefault(key, value)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient(tracking_uri=self.uri)
        mine = state.section(self.name)
        if not (mine.get("run_id") and mine.get("uri") == self.uri):
            exp = client.get_experiment_by_name(self.experiment)
            exp_id = exp.experiment_id if exp else client.create_experiment(self.experiment)
            run = client.create_run(exp_id, run_name=self.run_name)
            mine.clear()
            mine.update(run_id=run.info.run_id, uri=self.uri, experiment=self.experiment)
            state.save()
        self.run_id = mine["run_id"]
        if not mine.get("params_logged"):
            items = [Param(k, v[:_PARAM_CHARS]) for k, v in params.items()]
            for i in range(0, len(items), 100):  # MLflow's limit on params per request
                client.log_batch(self.run_id, params=items[i : i + 100])
            mine["params_logged"] = True
            state.save()
        client.update_run(self.run_id, status="RUNNING")
        return self._held()

    def _held(self) -> dict[str, int]:
        """The last step of each metric the run holds."""
        run = self._client.get_run(self.run_id)
        held = {}
        for key in run.data.metrics:
            history = self._client.get_metric_history(self.run_id, key)
            held[key] = max((m.step for m in history), default=-1)
        return held

    def log(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(k, v, self._stamps.setdefault(step, now), step)
            for step, values in rows
            for k, v in values.items()
        ]
        for i in range(0, len(metrics), _BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + _BATCH])
        for step, _ in rows:
            self._stamps.pop(step, None)

    def tag(self, key: str, value: str) -> None:
        self._client.set_tag(self.run_id, key, value)

    def finish(self, state: str) -> None:
        if state in _STATUS:  # otherwise stopped: the run stays RUNNING until it is resumed
            self._client.set_terminated(self.run_id, status=_STATUS[state])
