"""Where the run is, and what it has learned besides its weights.

:class:`TrainState` holds every counter the loop advances, the current pseudo-labels, the mining
history and the sample ledger. It is registered with the checkpointer like the optimizer is
(``state_dict`` / ``load_state_dict``), so the list of what a checkpoint holds lives in one place.

The position in an epoch is ``sample_in_epoch``: how many samples of the epoch's order the
committed steps trained (``distributed/sampler.py``), so a resume on another world size or batch
size continues the same order. The :class:`SampleLedger` says which ranges of each epoch's order
which attempt trained; being part of the checkpointed state, it describes the committed history
only: what a killed attempt trained after its last checkpoint is not in it, and is trained again.
``data`` is the identity of the data trained on (``data_identity.py``), which a resume compares
with the data it is given; the ledger records it for each epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from clusterflow.checkpoint.data_identity import DataIdentity

LEDGER_FORMAT = 1


@dataclass
class SampleLedger:
    """Per epoch, the data it trained (its number of samples and digest: ``DataIdentity``) and
    the ranges of its order that the committed steps trained: ``{"epoch": E, "samples": N,
    "digest": D, "ranges": [{"start", "end", "attempt", "world_size", "batch_size"}, ...]}``;
    steps of one attempt at one world size and batch size that follow each other make one
    range."""

    epochs: list[dict[str, Any]] = field(default_factory=list)
    # A loop without a loader (run.steps(max_steps)) has no samples to name: the steps its
    # attempts trained, {"start", "end", "attempt", "world_size"} (steps start + 1 .. end).
    steps: list[dict[str, Any]] = field(default_factory=list)

    def record_step(self, step: int, attempt: int, world: int) -> None:
        """Global step ``step`` trained (a loop without a loader)."""
        last = self.steps[-1] if self.steps else None
        follows = last and last["end"] == step - 1
        if follows and (last["attempt"], last["world_size"]) == (attempt, world):
            last["end"] = step
            return
        self.steps.append({"start": step - 1, "end": step, "attempt": attempt, "world_size": world})

    def record(
        self,
        epoch: int,
        data: DataIdentity,
        start: int,
        end: int,
        *,
        attempt: int,
        world: int,
        batch: int,
    ) -> None:
        """Samples ``[start, end)`` of epoch ``epoch``'s order of ``data``, trained by one
        step."""
        if not self.epochs or self.epochs[-1]["epoch"] != epoch:
            self.epochs.append({"epoch": epoch, **data.record(), "ranges": []})
        ranges = self.epochs[-1]["ranges"]
        last = ranges[-1] if ranges else None
        if last and (last["end"], last["attempt"], last["world_size"], last["batch_size"]) == (
            start,
            attempt,
            world,
            batch,
        ):
            last["end"] = end
            return
        ranges.append(
            {
                "start": start,
                "end": end,
                "attempt": attempt,
                "world_size": world,
                "batch_size": batch,
            }
        )

    def state_dict(self) -> list[dict[str, Any]]:
        return [{**e, "ranges": [dict(r) for r in e["ranges"]]} for e in self.epochs]

    def load_state_dict(self, epochs: list[dict[str, Any]]) -> None:
        self.epochs = [{**e, "ranges": [dict(r) for r in e["ranges"]]} for e in epochs]

    def record_file(self, global_step: int) -> dict[str, Any]:
        """What ``RUN_DIR/sample_ledger.json`` holds (docs/data.md): the ledger as of the
        committed checkpoint of ``global_step``."""
        return {
            "format": LEDGER_FORMAT,
            "global_step": global_step,
            "epochs": self.state_dict(),
            **({"steps": [dict(r) for r in self.steps]} if self.steps else {}),
        }


@dataclass
class TrainState:
    epoch: int = 0  # epochs finished
    step_in_epoch: int = 0  # optimizer steps done in the current epoch
    global_step: int = 0  # optimizer steps done in all
    # Samples of the current epoch's order trained; None until set from an older checkpoint
    # that counted steps only (the trainer derives it from step_in_epoch then).
    sample_in_epoch: int | None = 0
    # The current epoch's batch segments ([first sample, batch size],
    # distributed/sampler.EpochPlan); empty: one segment of train.batch_size.
    plan: list[list[int]] = field(default_factory=list)
    ledger: SampleLedger = field(default_factory=SampleLedger)
    labels: np.ndarray | None = None  # pseudo-labels of the last mining round, by sample index
    mining_history: list[dict[str, Any]] = field(default_factory=list)  # one stats entry per round
    data: DataIdentity | None = None  # the data trained on; None in a checkpoint of before

    @property
    def position(self) -> tuple[int, int]:
        """Orders two states at the same global step: the one after the end-of-epoch work is
        later."""
        return (self.epoch, self.step_in_epoch)

    def save_due(self, every: int, steps_per_epoch: int) -> bool:
        """Whether a save every ``every`` steps (a checkpoint on disk, a snapshot in memory) falls
        on the step just done: a multiple of ``every``, but for an epoch's last step, which the
        end-of-epoch checkpoint saves after the epoch's end (eval, mining) instead."""
        return self.global_step % every == 0 and self.step_in_epoch < steps_per_epoch

    def step_done(self, samples: int = 0) -> None:
        self.step_in_epoch += 1
        self.global_step += 1
        self.sample_in_epoch = (self.sample_in_epoch or 0) + samples

    def epoch_done(self) -> None:
        self.epoch += 1
        self.step_in_epoch = 0
        self.sample_in_epoch = 0
        self.plan = []

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "global_step": self.global_step,
            "sample_in_epoch": self.sample_in_epoch,
            "plan": [list(s) for s in self.plan],
            "ledger": self.ledger.state_dict(),
            **({"ledger_steps": [dict(r) for r in self.ledger.steps]} if self.ledger.steps else {}),
            "labels": torch.from_numpy(self.labels) if self.labels is not None else None,
            "mining_history": self.mining_history,
            "data": self.data.record() if self.data is not None else None,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.step_in_epoch, self.global_step = (
            sd["epoch"],
            sd["step_in_epoch"],
            sd["global_step"],
        )
        # A checkpoint of an older version: no sample position, plan or ledger.
        self.sample_in_epoch = sd.get("sample_in_epoch")
        self.plan = [list(s) for s in sd.get("plan") or []]
        self.ledger.load_state_dict(sd.get("ledger") or [])
        self.ledger.steps = [dict(r) for r in sd.get("ledger_steps") or []]
        self.labels = sd["labels"].numpy() if sd["labels"] is not None else None
        self.mining_history = list(sd["mining_history"])
        self.data = DataIdentity.from_record(sd.get("data"))
