"""The mining stage as a run's loop calls it (``run.mine``, the task trainer's epoch end): when a
round is due, a script's embedding function as the stage asks for a task's, whether the script
mines at all (which decides what its epoch's last step saves), and a round's logs.

A script is taken to mine until an epoch whose end was due to mine ends without ``run.mine``:
until then the last step of an epoch whose end mines is saved as the loop ended it
(``LOOP_END``), so a stop inside the round never saves states the script's own code after the
loop has changed (docs/own-loop.md, "Between the loop and the epoch's end").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from clusterflow.errors import UserError
from clusterflow.mining import figure
from clusterflow.mining.stage import Miner, Round, StopVote, for_status
from clusterflow.observe.context import JobContext
from clusterflow.observe.reporter import Reporter
from clusterflow.tasks import Task

log = logging.getLogger("clusterflow.trainer")


def to_device(batch: object, device: torch.device) -> object:
    """Every tensor of a (nested) batch on ``device``."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


class _Indexed(Dataset):
    """A script's dataset as the mining stage reads it: each item with its index."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> dict[str, object]:
        return {"index": i, "item": self.dataset[i]}


class Embedding(Task):
    """A script's embedding function as the mining stage asks for a task's."""

    def __init__(
        self,
        embed: Callable[[Any], torch.Tensor],
        dataset: Dataset,
        truth: np.ndarray | None,
        device: torch.device,
    ) -> None:
        self.fn, self.dataset, self.truth, self.device = embed, _Indexed(dataset), truth, device

    def embed(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return self.fn(to_device(batch["item"], self.device))

    def embed_dataset(self) -> Dataset:
        return self.dataset

    def ground_truth(self) -> np.ndarray | None:
        return self.truth


class LoopMining:
    """The mining rounds of one attempt's loop on this rank."""

    def __init__(
        self, ctx: JobContext, device: torch.device, amp: torch.dtype | None, stop: StopVote
    ) -> None:
        self.device = device
        self.miner = Miner(ctx, device, amp, stop)
        # Whether the script calls run.mine after its loop: True from its first call (or a
        # round in the state restored), False once an epoch due to mine ended without one, None
        # until then.
        self.mines: bool | None = None
        self.mined = -1  # the epoch whose round ran in this attempt

    def due(self, finished: int, total_epochs: int, can_embed: bool = True) -> bool:
        """Whether the end of epoch ``finished`` (1-based) runs a round (``mining.*``)."""
        return self.miner.due(finished, total_epochs, can_embed)

    def resumed(self, rounds: int) -> None:
        """The state restored holds ``rounds`` rounds: the script mines."""
        if rounds:
            self.mines = True

    def epoch_ended(self, was_due: bool) -> None:
        if self.mines is None and was_due:
            self.mines = False  # a round was due, and the script did not call run.mine

    def keeps_loop_end(self, was_due: bool) -> bool:
        """Whether an epoch's last step is saved as the loop ended it: a script that mines (or
        may), before a round."""
        return self.mines is not False and was_due

    def source(
        self,
        embed: Callable[[Any], torch.Tensor] | Task,
        dataset: Dataset | None,
        truth: np.ndarray | None,
        finished: int,
    ) -> Task:
        """What the round embeds: a task, or a script's function over ``dataset`` (the loader's,
        unless the script names one). Marks the script as one that mines."""
        self.mines = True
        if self.mined == finished:
            raise UserError(
                f"run.mine(...) was called twice in epoch {finished}; its labels are run.labels"
            )
        if isinstance(embed, Task):
            return embed
        if dataset is None:
            raise UserError("run.mine(embed, dataset=...): name the dataset to embed")
        return Embedding(embed, dataset, truth, self.device)

    def run(self, source: Task, module: torch.nn.Module, finished: int) -> Round | None:
        """The round after epoch ``finished``, collective; None when a stop cut it short."""
        self.mined = finished
        return self.miner.run(source, module, finished)

    def forget(self, committed_epoch: int) -> None:
        """Delete the files of the rounds whose labels a committed checkpoint holds (one rank)."""
        self.miner.forget_rounds(committed_epoch)

    def report(
        self,
        s: dict[str, Any],
        labels: np.ndarray | None,
        history: list[dict[str, Any]],
        reporter: Reporter,
        step: int,
    ) -> None:
        """A finished round's scalars, cluster sizes and curve, its log line, and status.json's
        rounds."""
        scalars = {
            f"mining/{k}": float(v)
            for k, v in s.items()
            if isinstance(v, (int, float)) and k != "epoch"
        }
        scalars.update({f"mining/seconds_{k}": float(v) for k, v in s["seconds"].items()})
        scalars["mining/embed_per_s_total"] = s["embed_per_s_total"]
        scalars.update(
            {f"mining/embed_per_s_rank{r}": v for r, v in enumerate(s.get("embed_per_s_rank", []))}
        )
        reporter.log(scalars)
        if labels is not None:
            sizes = np.bincount(labels[labels >= 0])
            if len(sizes):
                reporter.writer.histogram("mining/cluster_sizes", sizes, step)
        if "curve" in s:
            reporter.writer.image("mining/curve", lambda: figure.render(s), step)
        if reporter.rank == 0:
            q = "".join(
                f" {k} {s[k]:.3f}" for k in ("nmi", "ari", "pairwise_f", "bcubed_f") if k in s
            )
            log.info(
                "mining after epoch %d: %d clusters, %d singletons, largest %d, %.2f s;%s",
                s["epoch"],
                s["num_clusters"],
                s["num_singletons"],
                s["largest_cluster"],
                s["seconds"]["total"],
                q,
            )
        reporter.report(mining=for_status(history))
