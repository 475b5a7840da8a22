"""Where the run is, and what it has learned besides its weights.

:class:`TrainState` holds every counter the loop advances, the current pseudo-labels and the
mining history. It is registered with the checkpointer like the optimizer is (``state_dict`` /
``load_state_dict``), so the list of what a checkpoint holds lives in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class TrainState:
    epoch: int = 0  # epochs finished
    step_in_epoch: int = 0  # optimizer steps done in the current epoch
    global_step: int = 0  # optimizer steps done in all
    labels: np.ndarray | None = None  # pseudo-labels of the last mining round, by sample index
    mining_history: list[dict[str, Any]] = field(default_factory=list)  # one stats entry per round

    @property
    def position(self) -> tuple[int, int]:
        """Orders two states at the same global step: the one after the end-of-epoch work is
        later."""
        return (self.epoch, self.step_in_epoch)

    def step_done(self) -> None:
        self.step_in_epoch += 1
        self.global_step += 1

    def epoch_done(self) -> None:
        self.epoch += 1
        self.step_in_epoch = 0

    def state_dict(self) -> dict[str, Any]:
        import torch

        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "global_step": self.global_step,
            "labels": torch.from_numpy(self.labels) if self.labels is not None else None,
            "mining_history": self.mining_history,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.step_in_epoch, self.global_step = (
            sd["epoch"],
            sd["step_in_epoch"],
            sd["global_step"],
        )
        self.labels = sd["labels"].numpy() if sd["labels"] is not None else None
        self.mining_history = list(sd["mining_history"])
