"""Exact sharding of a dataset over ranks.

Training: an epoch is one order of all ``n`` indices, a deterministic function of (seed, epoch)
(:func:`epoch_permutation`, or the train dataset's own ``epoch_order(seed, epoch)``, e.g. one
that keeps shards together). :class:`EpochPlan` cuts that order into ``n // global_batch`` global
batches without dropping or repeating a sample: each of ``global_batch`` samples, but the epoch's
last, which also takes the ``n % global_batch`` left over. A step's batch is split into
``grad_accum`` micro-batches and each micro-batch into ``world`` contiguous slices of sizes that
differ by at most one: with ``global_batch`` a multiple of world x grad_accum and no batch smaller
than ``global_batch``, every rank gets at least one sample of every micro-batch, so every rank runs
the same forwards, backwards and collectives, whatever ``n`` is. Only the epoch's last step can
have uneven slices.

The position in an epoch is a count of samples of that order consumed, not a per-rank step: the
global batches do not depend on the world size, so a resume on any world size continues the same
order, and a resume on the same world size sees exactly the batches of the uninterrupted run. A
resume with another ``train.batch_size`` (``train.allow_batch_size_change``) starts a new segment
of the plan at the position reached; the batches before it are the ones trained.

Mining: :func:`shard_range` gives each rank a contiguous, exact block of indices, with no padding
by repetition (DistributedSampler pads with repeats and strides its slices).

Persistent DataLoader workers keep the copy of the dataset (and task) they were started with, so
the epoch that ``Task.set_epoch`` (or a dataset's ``set_epoch``) sets in the main process never
reaches them: :class:`WithEpoch` sends each index with its epoch, and :class:`EpochItems` sets the
epoch in whichever process fetches the item before fetching it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from clusterflow.errors import UserError

# An epoch's order of the indices: a permutation of range(n), as a tensor, an array or a list.
Order = torch.Tensor | np.ndarray | Sequence[int]


def shard_range(n: int, rank: int, world: int) -> range:
    """Contiguous block of ``range(n)`` for ``rank``; sizes differ by at most one."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def split(total: int, parts: int) -> list[int]:
    """The sizes of ``parts`` contiguous pieces of ``total``, differing by at most one (the first
    ones larger)."""
    return [len(shard_range(total, i, parts)) for i in range(parts)]


@dataclass(frozen=True)
class BatchKey:
    """Where the user sets the batch, as the messages about it name it: a task's
    ``train.batch_size`` and ``train.grad_accum``, a script's ``run.loader(...,
    global_batch_size=...)`` or its per-rank ``batch_size``, and its ``accumulate``."""

    name: str  # the setting, to lower or keep
    accumulate: str  # the micro-batches of a step
    said: str  # the value seen ("{}": the value)
    form: str  # the value to set instead

    def seen(self, value: object) -> str:
        return self.said.format(value)

    def set_to(self, value: int) -> str:
        return self.form.format(value)


TASK_BATCH = BatchKey(
    "train.batch_size", "grad_accum", "train.batch_size = {}", "train.batch_size={}"
)
LOADER_BATCH = BatchKey(
    "global_batch_size",
    "accumulate",
    "run.loader(..., global_batch_size={})",
    "run.loader(..., global_batch_size={})",
)
RANK_BATCH = BatchKey(
    "batch_size", "accumulate", "run.loader(..., batch_size={})", "run.loader(..., batch_size={})"
)


def check_fits(
    n: int, global_batch: int, per_step: int, target: str, key: BatchKey = TASK_BATCH
) -> None:
    """An epoch needs at least one global batch (``global_batch`` samples); ``per_step``
    (world size x grad_accum) must divide the batch."""
    # The config checks cluster.*; torchrun may start another number of processes.
    seen = key.seen(global_batch)
    if global_batch % per_step:
        raise UserError(
            f"{seen} must be divisible by world size x {key.accumulate} = {per_step} (the "
            f"processes this job runs); try "
            f"{key.set_to(max(per_step, global_batch // per_step * per_step))}"
        )
    if n >= global_batch:
        return
    fit = n // per_step * per_step
    fix = (
        f"lower {key.name} to at most {fit} (a multiple of world size x {key.accumulate} = "
        f"{per_step})"
        if fit
        else (
            f"the dataset is smaller than world size x {key.accumulate} = {per_step}: "
            "use fewer processes or a larger dataset"
        )
    )
    raise UserError(
        f"{seen} is larger than the training set of {target} ({n} samples), so an epoch has no "
        f"full batch; {fix}"
    )


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


def epoch_order(dataset: Dataset, seed: int, epoch: int) -> Order:
    """The epoch's order of every index of ``dataset`` (a tensor, array or list): its
    ``epoch_order(seed, epoch)`` when it has one (a permutation of ``range(len(dataset))``), else
    :func:`epoch_permutation`."""
    own = getattr(dataset, "epoch_order", None)
    return own(seed, epoch) if own is not None else epoch_permutation(len(dataset), seed, epoch)


@dataclass(frozen=True)
class EpochPlan:
    """The global batches of one epoch of ``n`` samples: ``segments`` of (first sample, batch
    size); each segment cuts ``[first, n)`` into ``(n - first) // batch size`` batches (at least
    one) of that size, the last of them taking what is left over, and ends where the next segment
    starts (a batch boundary of its own: a resume with another batch size starts one there)."""

    n: int
    segments: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, n: int, global_batch: int, segments: Sequence[Sequence[int]] = ()) -> EpochPlan:
        """The plan saved as ``segments`` (a checkpoint's), or one segment of ``global_batch``."""
        return cls(n, tuple((int(a), int(b)) for a, b in segments) or ((0, global_batch),))

    def _segment(self, i: int) -> list[int]:
        start, batch = self.segments[i]
        end = self.segments[i + 1][0] if i + 1 < len(self.segments) else self.n
        # Batches of ``batch`` samples from ``start``; the epoch's last takes what is left over.
        count = max(1, (self.n - start) // batch)
        bounds = [start + k * batch for k in range(count)] + [self.n]
        if end not in bounds:
            raise ValueError(f"segment {self.segments[i + 1]} does not start at a batch boundary")
        return bounds[: bounds.index(end) + 1]

    def boundaries(self) -> list[int]:
        """Where each global batch starts, and ``n``."""
        out = [0]
        for i in range(len(self.segments)):
            out += self._segment(i)[1:]
        return out

    def steps(self) -> int:
        return len(self.boundaries()) - 1

    def batches_from(self, position: int) -> list[tuple[int, int]]:
        """(first sample, size) of each global batch from ``position`` (a batch boundary) on."""
        bounds = self.boundaries()
        if position not in bounds:
            raise ValueError(f"sample {position} is not where a batch of this epoch starts")
        i = bounds.index(position)
        return [(a, b - a) for a, b in zip(bounds[i:-1], bounds[i + 1 :])]

    def with_batch(self, position: int, global_batch: int) -> EpochPlan:
        """The plan from ``position`` on with another batch size: a new segment there, unless
        fewer than ``global_batch`` samples remain (the epoch ends with the batches planned)."""
        if global_batch == self.segments[-1][1] or self.n - position < global_batch:
            return self
        self.batches_from(position)  # a batch boundary, or ValueError
        kept = tuple(s for s in self.segments if s[0] < position)
        return EpochPlan(self.n, (*kept, (position, global_batch)))

    def as_list(self) -> list[list[int]]:
        return [list(s) for s in self.segments]


def share(count: int, world: int, grad_accum: int, step_samples: int) -> float:
    """The weight of a micro-batch of ``count`` samples in a step of ``step_samples``: its loss
    (a mean over its samples) times this, averaged over ranks (DDP, FSDP) and summed over
    micro-batches divided by ``grad_accum``, gives the mean over the step's samples. 1.0 when the
    step splits evenly."""
    return count * world * grad_accum / step_samples


@dataclass(frozen=True)
class Batching:
    """One optimizer step's samples and how they split: ``global_batch`` samples on all ranks
    together, in ``accumulate`` micro-batches on each of ``world`` ranks; ``rank``: this one;
    ``seed``: the run's (the epoch order and the loader's worker seeds)."""

    global_batch: int
    accumulate: int
    rank: int
    world: int
    seed: int

    @property
    def rank_batch(self) -> int:
        """Each rank's micro-batch, as ``DataLoader``'s ``batch_size``."""
        return self.global_batch // (self.world * self.accumulate)


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's slice of each global micro-batch, from the epoch's position on."""

    def __init__(
        self,
        n: int,
        global_batch: int,
        rank: int,
        world: int,
        seed: int,
        *,
        grad_accum: int = 1,
        order: Callable[[int, int], Order] | None = None,
        key: BatchKey = TASK_BATCH,
    ) -> None:
        if global_batch % (world * grad_accum):
            raise ValueError(
                f"batch {global_batch} not divisible by world size x grad_accum "
                f"{world} x {grad_accum}"
            )
        if n < global_batch:
            raise ValueError(f"dataset of {n} samples is smaller than one batch of {global_batch}")
        self.n, self.rank, self.world, self.seed, self.grad_accum = n, rank, world, seed, grad_accum
        self.key = key  # for messages
        self.order = order or (lambda seed, epoch: epoch_permutation(n, seed, epoch))
        self.plan = EpochPlan.of(n, global_batch)
        self.epoch = 0
        self.position = 0
        self._order: tuple[int, list[int]] | None = None  # (epoch, its order), once per epoch
        # (epoch, position, plan) and the global batches from there, for slice_at
        self._batches: tuple[tuple[int, int, EpochPlan], list[tuple[int, int]]] | None = None

    def set_epoch(self, epoch: int, position: int = 0, plan: EpochPlan | None = None) -> None:
        """Iterate ``epoch`` from sample ``position`` of its order (a batch boundary of
        ``plan``)."""
        self.epoch, self.position = epoch, position
        if plan is not None:
            self.plan = plan
        self.plan.batches_from(position)  # ValueError now, not in a DataLoader worker
        smallest = min((size for _, size in self.plan.batches_from(0)), default=0)
        if smallest < self.world * self.grad_accum:
            raise UserError(
                f"epoch {epoch + 1} has a global batch of {smallest} samples, fewer than world "
                f"size x {self.key.accumulate} = {self.world} x {self.grad_accum}: some rank would "
                f"have no sample; resume with fewer processes, or with the {self.key.name} it "
                "started with"
            )

    def __len__(self) -> int:
        return len(self.plan.batches_from(self.position)) * self.grad_accum

    def _epoch_order(self) -> list[int]:
        """The epoch's order as a list, computed once per epoch (the iteration and
        :meth:`slice_at` share it)."""
        if self._order is None or self._order[0] != self.epoch:
            order = self.order(self.seed, self.epoch)
            self._order = (
                self.epoch,
                order.tolist() if hasattr(order, "tolist") else list(order),
            )
        return self._order[1]

    def _slices(self) -> Iterator[tuple[int, int]]:
        """(start, stop) in the epoch's order of this rank's slice of each micro-batch, from the
        position on."""
        for start, size in self.plan.batches_from(self.position):
            for micro in split(size, self.grad_accum):
                part = shard_range(micro, self.rank, self.world)
                yield start + part.start, start + part.stop
                start += micro

    def __iter__(self) -> Iterator[list[int]]:
        order = self._epoch_order()
        for a, b in self._slices():
            yield order[a:b]

    def slice_at(self, k: int) -> list[int] | None:
        """The indices of this rank's ``k``-th micro-batch (from 0) of the iteration from the
        position, as :meth:`__iter__` yields it; None past the epoch's end. What a rank records
        before it fetches a batch (``rundir/inflight.py``): the samples a crash in that batch
        died on. The global batches from the position are listed once per iteration."""
        key = (self.epoch, self.position, self.plan)
        if self._batches is None or self._batches[0] != key:
            self._batches = (key, self.plan.batches_from(self.position))
        batches = self._batches[1]
        step, micro = divmod(k, self.grad_accum)
        if not 0 <= step < len(batches):
            return None
        start, size = batches[step]
        sizes = split(size, self.grad_accum)
        start += sum(sizes[:micro])
        part = shard_range(sizes[micro], self.rank, self.world)
        return self._epoch_order()[start + part.start : start + part.stop]


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
    """A train dataset fetched by (epoch, index): ``set_epoch`` (a task's, or the dataset's own)
    runs in the fetching process (a persistent worker holds its own copy of the dataset)
    whenever the epoch changes."""

    def __init__(self, dataset: Dataset, set_epoch: Callable[[int], None] | None) -> None:
        self.dataset, self.set_epoch, self.epoch = dataset, set_epoch, None

    def __len__(self) -> int:
        return len(self.dataset)

    def _at(self, epoch: int) -> None:
        if epoch != self.epoch:
            if self.set_epoch is not None:
                self.set_epoch(epoch)
            self.epoch = epoch

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        self._at(epoch)
        return self.dataset[index]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        """A whole batch (one epoch), through the dataset's own ``__getitems__`` when it has one
        (a dataset that reads a batch at once, e.g. sorted by where its samples lie)."""
        if not keys:
            return []
        self._at(keys[0][0])
        batch = getattr(self.dataset, "__getitems__", None)
        indices = [index for _, index in keys]
        return batch(indices) if batch is not None else [self.dataset[i] for i in indices]
