"""``run.loader``: a DataLoader over the epoch plan (``distributed/sampler.py``), and the checks of
what a script passes it.

Each global batch (the samples of one optimizer step on every rank) is cut from the epoch's
order by :class:`GlobalBatchSampler` from the position the run reached, split into
``accumulate`` micro-batches and each of those into the ranks' slices: every sample once per
epoch at any world size, a resume continuing the same order. The DataLoader's workers outlive
the job's stop signals (``distributed/workers.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from clusterflow.checkpoint.data_identity import identify
from clusterflow.checkpoint.rng import rank_seed
from clusterflow.distributed import workers
from clusterflow.distributed.sampler import (
    RANK_BATCH,
    Batching,
    BatchKey,
    EpochItems,
    GlobalBatchSampler,
    WithEpoch,
    check_fits,
    epoch_order,
)
from clusterflow.errors import UserError

# DataLoader arguments the epoch plan owns.
_PLAN_OWNS = ("shuffle", "sampler", "batch_sampler", "drop_last", "generator")


class Loader:
    """What ``run.loader`` returns for a map-style dataset: iterate it once in each epoch of
    ``run.epochs``; it yields this rank's slice of each global micro-batch, from the position
    the run reached. ``iterate(loader)`` is the run's iteration (which counts what each step
    takes), ``left()`` the batches left in the epoch.

    ``batch_size`` is each rank's batch, as ``DataLoader(dataset, batch_size)`` has it (the value
    ``run.loader`` was given, or ``global_batch_size / (world size x accumulate)``);
    ``global_batch_size`` the samples of one optimizer step on all ranks. An epoch's last step
    also takes the samples left over (``distributed/sampler.py``): its batches hold more."""

    stream = False

    def __init__(
        self,
        dataset: Dataset,
        batching: Batching,
        key: BatchKey,
        *,
        set_epoch: Callable[[int], None] | None,
        kwargs: dict[str, Any],
        iterate: Callable[[Loader], Iterator[Any]],
        left: Callable[[], int | None],
    ) -> None:
        b = batching
        self.dataset, self.global_batch_size, self.accumulate = (
            dataset,
            b.global_batch,
            b.accumulate,
        )
        self.batch_size = b.rank_batch
        self.rank, self.seed, self.set_epoch, self.kwargs = b.rank, b.seed, set_epoch, kwargs
        self._iterate, self._left = iterate, left
        self.n = len(dataset)  # type: ignore[arg-type]
        # What a checkpoint records of the data, and a resume compares with it.
        self.data = identify(dataset)  # type: ignore[arg-type]
        self.sampler = GlobalBatchSampler(
            self.n,
            b.global_batch,
            b.rank,
            b.world,
            b.seed,
            grad_accum=b.accumulate,
            order=lambda seed, epoch: epoch_order(dataset, seed, epoch),
            key=key,
        )
        self._persistent: DataLoader | None = None
        self._live: Iterator[Any] | None = None  # the epoch's batches, its workers behind them

    def __len__(self) -> int:
        """The batches left in this epoch (all of them at its start), from where the run is: a
        resumed epoch's, before the loop too."""
        left = self._left()
        return len(self.sampler) if left is None else left

    def __iter__(self) -> Iterator[Any]:
        return self._iterate(self)

    def batches(self, epoch: int) -> Iterator[Any]:
        """This rank's micro-batches of ``epoch`` from the position reached."""
        self._live = workers.started(self.dataloader(epoch))
        return self._live

    def shutdown(self) -> None:
        """The DataLoader's worker processes stopped (``run.finish``: a loop that left in
        mid-epoch, or persistent workers, keeps them)."""
        if self._live is not None:
            workers.shut_down(self._live)
        self._live = self._persistent = None

    def dataloader(self, epoch: int) -> DataLoader:
        """This epoch's DataLoader; with persistent workers, one per attempt."""
        kw = dict(self.kwargs)
        persistent = bool(kw.pop("persistent_workers", False)) and kw.get("num_workers", 0) > 0
        if persistent and self._persistent is not None:
            return self._persistent
        # Its own generator: worker seeds depend on (seed, rank, epoch) only, and the global
        # random stream (dropout) is not drawn from, so a resume in mid-epoch continues that
        # stream exactly.
        g = torch.Generator().manual_seed(rank_seed(self.seed, self.rank) + epoch)
        data, batches = (
            (EpochItems(self.dataset, self.set_epoch), WithEpoch(self.sampler))
            if persistent
            else (self.dataset, self.sampler)
        )
        if kw.get("num_workers", 0) > 0:
            # The job's stop signals reach the workers too: the rank stops, they outlive them.
            kw["worker_init_fn"] = workers.quiet(kw.get("worker_init_fn"))
        loader = DataLoader(
            data, batch_sampler=batches, generator=g, persistent_workers=persistent, **kw
        )
        if persistent:
            self._persistent = loader
        return loader


def check_arguments(dataset: Dataset, accumulate: object, kwargs: dict[str, object]) -> None:
    """Refuse, in one line naming the argument, what ``run.loader`` cannot plan: a DataLoader or
    a dataset without ``len``, a sampler or shuffle of the script's own, a bad ``accumulate``.
    Drops the plan's own arguments passed as None or False from ``kwargs``."""
    if isinstance(dataset, DataLoader):
        raise UserError(
            "run.loader(dataset, ...) takes a dataset, not a DataLoader: pass the DataLoader's "
            "dataset and its batch size (run.loader builds the DataLoader over the epoch plan)"
        )
    if not isinstance(dataset, IterableDataset) and not hasattr(dataset, "__len__"):
        raise UserError(
            f"run.loader needs a map-style dataset (len() and dataset[i]) or an IterableDataset, "
            f"got a {type(dataset).__name__}: the epoch plan orders the samples by index"
        )
    for name in _PLAN_OWNS:
        if kwargs.get(name) not in (None, False):
            raise UserError(
                f"run.loader(..., {name}=...): the epoch plan shuffles, shards and batches "
                "the samples itself (each sample once per epoch, at any world size, resumed "
                "where it stopped); a sampler, shuffle, drop_last or generator of your own "
                f"would bypass it: remove {name}="
            )
        kwargs.pop(name, None)
    init = kwargs.get("worker_init_fn")
    if init is not None and not callable(init):
        raise UserError(
            f"run.loader(..., worker_init_fn={init!r}): give a function of the worker's id, or none"
        )
    if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
        raise UserError(f"run.loader(..., accumulate={accumulate!r}): must be an int >= 1")


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def step_samples(
    n: int,
    batch_size: object,
    global_batch_size: object,
    accumulate: int,
    world: int,
    *,
    what: str,
    key: BatchKey,
) -> tuple[int, BatchKey]:
    """The samples of one optimizer step on all ranks, from exactly one of ``batch_size`` (each
    rank's micro-batch, as ``DataLoader``'s: times world size x ``accumulate``) and
    ``global_batch_size``, and the key the messages about it name (``key`` names the global
    one: a script's argument, or a task's config key). UserError naming the argument given when
    it does not fit the world size or the dataset."""
    if (batch_size is None) == (global_batch_size is None):
        given = "both" if batch_size is not None else "neither"
        raise UserError(
            f"run.loader(dataset, ...) got {given} of batch_size and global_batch_size: give "
            "batch_size=B (each rank's batch, as DataLoader's) or global_batch_size=G (the "
            "samples of one optimizer step on all ranks together), one of the two"
        )
    per_step = world * accumulate
    if batch_size is not None:
        if not _count(batch_size):
            raise UserError(
                f"{RANK_BATCH.seen(repr(batch_size))}: must be an int >= 1, each rank's samples "
                "of one batch (as DataLoader's batch_size)"
            )
        total = batch_size * per_step  # type: ignore[operator]
        if total > n:
            fit = n // per_step
            fix = (
                f"lower batch_size to at most {fit}"
                if fit
                else "use fewer processes or a larger dataset"
            )
            raise UserError(
                f"{RANK_BATCH.seen(batch_size)} takes {total} samples a step (world size x "
                f"accumulate = {world} x {accumulate} batches of {batch_size}), more than the "
                f"training set of {what} holds ({n} samples), so an epoch has no full step; {fix}"
            )
        return total, RANK_BATCH
    if not _count(global_batch_size):
        raise UserError(
            f"{key.seen(repr(global_batch_size))}: must be an int >= 1, the samples of one "
            f"optimizer step on all ranks together (a multiple of world size x {key.accumulate} "
            f"= {world} x {accumulate})"
        )
    check_fits(n, global_batch_size, per_step, what, key)  # type: ignore[arg-type]
    return global_batch_size, key  # type: ignore[return-value]
