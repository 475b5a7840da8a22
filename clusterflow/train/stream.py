"""``run.loader`` over an ``IterableDataset``: a stream (webdataset, Hugging Face ``datasets``
streaming, a generator of the script's own) that each rank reads its own part of, as a
``DataLoader`` would give it, through torchdata's ``StatefulDataLoader``.

A stream has no index, so no epoch plan: it trains in ``run.steps(loader, max_steps)``, each
rank taking ``batch_size`` items per micro-batch from its own stream, starting the stream's next
pass at once when one ends (so every rank always has a batch, and the ranks never have to agree
on where a stream ends). Each rank's position (the loader's ``state_dict()``, which holds the
dataset's own when it has ``state_dict()``/``load_state_dict()``, torchdata's convention) is saved
with every checkpoint beside that rank's random streams, and restored on that rank: a resume at
the same world size continues each rank's stream exactly. A position belongs to the rank that
read it, so a resume on another world size is refused. A dataset without a state of its own is
taken with one warning: torchdata replays its pass from the start and skips what was trained,
which is exact only when the stream yields the same items in the same order every time.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from clusterflow.checkpoint.data_identity import DataIdentity
from clusterflow.checkpoint.rng import rank_seed
from clusterflow.distributed import workers
from clusterflow.distributed.sampler import Batching
from clusterflow.errors import UserError

log = logging.getLogger("clusterflow.trainer")

# The name each rank's stream position is saved under, beside its random streams.
POSITION = "run.loader"


def has_state(dataset: IterableDataset) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(
        getattr(dataset, "load_state_dict", None)
    )


class StreamLoader:
    """What ``run.loader`` returns for an ``IterableDataset``. ``global_batch_size``: the samples
    of one optimizer step on all ranks; ``batch_size`` each rank's micro-batch, ``global_batch_size
    / (world x accumulate)`` (as ``DataLoader``'s)."""

    stream = True
    set_epoch = None

    def __init__(
        self,
        dataset: IterableDataset,
        batching: Batching,
        attempt: int,
        *,
        kwargs: dict[str, Any],
        iterate: Callable[[StreamLoader], Iterator[Any]],
    ) -> None:
        b = batching
        rank, world, seed = b.rank, b.world, b.seed
        self.dataset, self.global_batch_size, self.accumulate = (
            dataset,
            b.global_batch,
            b.accumulate,
        )
        self.batch_size = b.rank_batch
        self.rank, self.world, self.attempt, self._iterate = rank, world, attempt, iterate
        digest = getattr(dataset, "data_digest", None)
        # A stream's identity: no length (0), and its own digest when it offers one.
        self.data = DataIdentity(0, digest() if callable(digest) else None)
        self.n = b.global_batch  # the samples the run's steps take: set by run.steps
        self.passes = 0  # this rank's passes over its stream finished
        self.resumed_at: int | None = None  # the attempt whose position a resume restored
        self._live: Iterator[Any] | None = None  # the pass being read, its workers behind it
        if kwargs.get("num_workers", 0) > 0:
            # The job's stop signals reach the workers too: the rank stops, they outlive them.
            kwargs["worker_init_fn"] = workers.quiet(kwargs.get("worker_init_fn"))
        with warnings.catch_warnings():  # torchdata's "set_vital is deprecated"
            warnings.simplefilter("ignore", UserWarning)
            self.loader = StatefulDataLoader(
                dataset,
                batch_size=self.batch_size,
                generator=torch.Generator().manual_seed(rank_seed(seed, rank)),
                **kwargs,
            )
        if not has_state(dataset) and rank == 0:
            log.warning(
                "run.loader(%s): the stream has no state_dict()/load_state_dict(), so a resume "
                "replays each rank's pass from its start and skips the batches trained: exact "
                "only if it yields the same items in the same order every time",
                type(dataset).__name__,
            )

    def __len__(self) -> int:
        raise TypeError(f"a stream ({type(self.dataset).__name__}) has no length")

    def __iter__(self) -> Iterator[Any]:
        return self._iterate(self)

    def batches(self, epoch: int) -> Iterator[Any]:
        """This rank's micro-batches, pass after pass."""
        while True:
            got = False
            self._live = workers.started(self.loader)
            for items in self._live:
                got = True
                yield items
            if not got:
                raise UserError(
                    f"run.loader({type(self.dataset).__name__}): rank {self.rank}'s stream "
                    "yielded no batch in a whole pass; give each rank a part of the stream of at "
                    "least one batch"
                )
            self.passes += 1

    def shutdown(self) -> None:
        """The loader's worker processes stopped (``run.finish``: a loop of ``run.steps`` ends in
        mid-pass, and the loader keeps the pass's iterator for its ``state_dict``)."""
        if self._live is not None:
            workers.shut_down(self._live)
        self._live = None

    def position(self) -> dict[str, Any]:
        """This rank's place in its stream, as a checkpoint keeps it."""
        return {
            "passes": self.passes,
            "world_size": self.world,
            "attempt": self.attempt,
            "loader": self.loader.state_dict(),
        }

    def go_to(self, state: object) -> None:
        """Back to a saved place (this rank's, at the same world size)."""
        assert isinstance(state, dict)
        self.passes = int(state["passes"])
        self.loader.load_state_dict(state["loader"])
        if state["attempt"] != self.attempt:  # a checkpoint's, not this attempt's own undo
            self.resumed_at = int(state["attempt"])
