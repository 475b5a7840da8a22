"""Exact sharding of a dataset over ranks.

Training: :class:`GlobalBatchSampler` shuffles all indices once per epoch from (seed, epoch), cuts
the permutation into global batches (the incomplete tail is dropped so every rank runs the same
number of steps), and gives each rank a contiguous slice of every global batch. The global batch
is therefore the same whatever the world size, and a resume at batch ``b`` of an epoch sees
exactly the batches the uninterrupted run would have seen.

Mining: :func:`shard_range` gives each rank a contiguous, exact block of indices, with no padding
by repetition (DistributedSampler pads with repeats and strides its slices).

Persistent DataLoader workers keep the copy of the task they were started with, so the epoch
that ``Task.set_epoch`` sets in the main process never reaches them: :class:`WithEpoch` sends
each index with its epoch, and :class:`EpochItems` sets the epoch in whichever process fetches
the item before fetching it.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import Dataset, Sampler

from clusterflow.errors import UserError


def shard_range(n: int, rank: int, world: int) -> range:
    """Contiguous block of ``range(n)`` for ``rank``; sizes differ by at most one."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def check_fits(n: int, batch_size: int, per_step: int, target: str) -> None:
    """An epoch needs at least one global batch (``train.batch_size`` samples; the incomplete tail
    is dropped); ``per_step`` (world size x grad_accum) must divide the batch."""
    # The config checks cluster.*; torchrun may start another number of processes.
    if batch_size % per_step:
        raise UserError(
            f"train.batch_size = {batch_size} must be divisible by world size "
            f"x grad_accum = {per_step} (the processes this job runs); try "
            f"train.batch_size={max(per_step, batch_size // per_step * per_step)}"
        )
    if n >= batch_size:
        return
    fit = n // per_step * per_step
    fix = (
        f"lower train.batch_size to at most {fit} (a "
        f"multiple of world size x grad_accum = {per_step})"
        if fit
        else (
            f"the dataset is smaller than world size x grad_accum = {per_step}: "
            "use fewer processes or a larger dataset"
        )
    )
    raise UserError(
        f"train.batch_size = {batch_size} is larger than the training set "
        f"of {target} ({n} samples), so an epoch has no full batch; {fix}"
    )


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's part of each global micro-batch."""

    def __init__(self, n: int, global_batch: int, rank: int, world: int, seed: int) -> None:
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} not divisible by world size {world}")
        if n < global_batch:
            raise ValueError(
                f"dataset of {n} samples is smaller than one global batch of {global_batch}"
            )
        self.n, self.global_batch, self.rank, self.world, self.seed = (
            n,
            global_batch,
            rank,
            world,
            seed,
        )
        self.local = global_batch // world
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start = epoch, start_batch

    def batches_per_epoch(self) -> int:
        return self.n // self.global_batch

    def __len__(self) -> int:
        return self.batches_per_epoch() - self.start

    def __iter__(self) -> Iterator[list[int]]:
        # Once per epoch, not once per batch.
        perm = epoch_permutation(self.n, self.seed, self.epoch).tolist()
        for b in range(self.start, self.batches_per_epoch()):
            lo = b * self.global_batch + self.rank * self.local
            yield perm[lo : lo + self.local]


class WithEpoch(Sampler[list[tuple[int, int]]]):
    """A batch sampler's batches as lists of (epoch, index), the epoch read when iteration
    starts."""

    def __init__(self, batches: GlobalBatchSampler) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.batches.epoch
        return ([(epoch, i) for i in batch] for batch in self.batches)


class EpochItems(Dataset):
    """The task's train dataset, fetched by (epoch, index): ``task.set_epoch`` runs in the fetching
    process (a persistent worker holds its own copy of the task) whenever the epoch changes."""

    def __init__(self, task: Any) -> None:
        self.task, self.dataset, self.epoch = task, task.train_dataset(), None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        if epoch != self.epoch:
            self.task.set_epoch(epoch)
            self.epoch = epoch
        return self.dataset[index]
