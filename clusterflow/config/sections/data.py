"""The training data's loading, and what a resume on other data does (``data.*``).

Read by ``train/trainer.py`` (the task's DataLoader), ``mining/stage.py`` (the mining round's
embedding DataLoader: ``num_workers``, ``pin_memory``, for a script's round too) and
``checkpoint/restore.py`` (``allow_change``). A script's own loader takes its DataLoader
arguments from ``run.loader``.
"""

from __future__ import annotations

from dataclasses import dataclass

from clusterflow.config.sections.fields import RESOURCE, TASK, check, doc


@dataclass
class DataConfig:
    """Data loading."""

    num_workers: int = doc(
        0,
        "DataLoader worker processes per rank, for training and for the mining embed.",
        kind=RESOURCE,
        why=(
            "items depend only on (seed, epoch, index), as the Task protocol asks; a task "
            "that draws from the global random stream in __getitem__ breaks this"
        ),
    )
    pin_memory: bool = doc(
        True,
        "Pin host memory when training on GPU (faster, non-blocking copies to the device).",
        kind=RESOURCE,
        why="transfer speed",
    )
    persistent_workers: bool = doc(
        False,
        "Keep the training DataLoader's workers from one epoch to the next (with "
        "num_workers > 0) instead of starting new ones each epoch. Each index travels with its "
        "epoch, so augmentations stay exactly those of fresh workers.",
        kind=RESOURCE,
        why="each index travels with its epoch, so persistent workers fetch the same items",
        applies=TASK,
    )
    prefetch_factor: int = doc(
        2,
        "Batches each worker prepares ahead (with num_workers > 0).",
        kind=RESOURCE,
        why="how far ahead workers fetch; not what they fetch",
        applies=TASK,
    )
    allow_change: bool = doc(
        False,
        "Let this launch resume a run whose data changed since its checkpoint (another number "
        "of samples, or another digest: a shard folder packed again, an image folder with other "
        "files); refused otherwise. Taken only at an epoch boundary: the run trains its next "
        "epoch on the new data, without the pseudo-labels mined on the old (docs/data.md).",
        kind=RESOURCE,
        why="whether a resume may take other data; by itself it changes nothing",
    )

    def __post_init__(self) -> None:
        check(
            0 <= self.num_workers <= 256,
            "data.num_workers",
            self.num_workers,
            "must be between 0 and 256 (processes per rank)",
        )
        check(
            1 <= self.prefetch_factor <= 1024,
            "data.prefetch_factor",
            self.prefetch_factor,
            "must be between 1 and 1024",
        )
