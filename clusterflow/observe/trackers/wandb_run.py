"""Weights & Biases: one W&B run per clusterflow run, online or offline.

The run id is chosen once and kept in ``trackers.json``; each attempt reopens it
(``resume="allow"``), so an offline run's attempts are folders of the same run id under
``RUN_DIR/wandb/`` that ``wandb sync`` uploads as one run.

W&B cannot be asked which steps it holds offline, and ``run.log`` only hands points to W&B's own
process, which a SIGKILL may take down before they are written. So ``trackers.json`` records the
last step of each tag only once ``run.finish`` has written them; after a kill the next attempt
sends again from there, and W&B keeps the first point of a step (its steps only increase).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import Any

from clusterflow.observe.trackers.state import StateFile
from clusterflow.rundir.paths import RunPaths
from clusterflow.rundir.states import State

_EXIT = {State.COMPLETED: 0, State.FAILED: 1, State.CANCELLED: 1}


class WandbBackend:
    name = "wandb"

    def __init__(self, cfg: Mapping[str, str], run_name: str, paths: RunPaths) -> None:
        self.cfg, self.run_name, self.dir = cfg, run_name, paths.wandb
        self._run: Any = None
        self._state: StateFile | None = None
        self._sent: dict[str, int] = {}

    def open(self, state: StateFile, params: Mapping[str, str]) -> dict[str, int]:
        import wandb

        self._state = state
        mine = state.section(self.name)
        if not mine.get("run_id"):
            mine.update(run_id=uuid.uuid4().hex[:12], held={})
            state.save()
        os.makedirs(self.dir, exist_ok=True)
        self._run = wandb.init(
            project=self.cfg["project"],
            entity=self.cfg.get("entity") or None,
            mode=self.cfg.get("mode", "online"),
            id=mine["run_id"],
            resume="allow",
            name=self.run_name,
            dir=self.dir,
            config=dict(params),
            settings=wandb.Settings(console="off", silent=True),
        )
        self._sent = dict(mine.get("held", {}))
        return dict(self._sent)

    def log(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in rows:
            self._run.log(values, step=step)
            self._sent.update(dict.fromkeys(values, step))

    def tag(self, key: str, value: str) -> None:
        self._run.summary[key] = value

    def finish(self, state: str) -> None:
        if state not in _EXIT:
            self._run.mark_preempting()  # resumed later: not a failure
        self._run.finish(exit_code=_EXIT.get(state, 0))
        if self._state is not None:
            self._state.section(self.name)["held"] = dict(self._sent)
            self._state.save()
