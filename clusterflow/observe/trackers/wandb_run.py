"""Weights & Biases: one W&B run per clusterflow run, online or offline.

The run id is chosen once and kept in ``trackers.json``; each attempt reopens it
(``resume="allow"``), so an offline run's attempts are folders of the same run id under
``RUN_DIR/wandb/`` that ``wandb sync`` uploads as one run. W&B cannot be asked which steps it
holds offline, so the last step sent of each tag is kept in ``trackers.json`` too.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from clusterflow.observe.trackers.state import StateFile
from clusterflow.rundir.paths import RunPaths

_EXIT = {"completed": 0, "failed": 1, "cancelled": 1}


class WandbBackend:
    name = "wandb"

    def __init__(self, cfg: Mapping[str, str], run_name: str, paths: RunPaths) -> None:
        self.cfg, self.run_name, self.dir = cfg, run_name, paths.wandb
        self._run: Any = None
        self._state: StateFile | None = None

    def open(self, state: StateFile, params: Mapping[str, str]) -> dict[str, int]:
        import wandb

        self._state = state
        mine = state.section(self.name)
        if not mine.get("run_id"):
            mine.update(run_id=wandb.util.generate_id(), held={})
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
        return dict(mine.get("held", {}))

    def log(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        assert self._state is not None
        held = self._state.section(self.name).setdefault("held", {})
        for step, values in rows:
            self._run.log(values, step=step)
            held.update(dict.fromkeys(values, step))
        self._state.save(fsync=False)

    def tag(self, key: str, value: str) -> None:
        self._run.summary[key] = value

    def finish(self, state: str) -> None:
        if state not in _EXIT:
            self._run.mark_preempting()  # resumed later: not a failure
        self._run.finish(exit_code=_EXIT.get(state, 0))
