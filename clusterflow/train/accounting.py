"""Where the run is in its epochs and steps, counted once for scripts and tasks alike: the
current epoch's plan of global batches, the step each batch of ``run.loader`` belongs to, and
what ``run.step`` counts (the train state's counters and its sample ledger). A loop of
``run.steps(max_steps)`` has no loader: its unit is the step, one epoch that holds the run's
steps, and the ledger records which attempt trained which steps.

The counters themselves live in the checkpointed :class:`TrainState`
(``checkpoint/train_state.py``); this object is the arithmetic between them and the loader: the
epoch's :class:`EpochPlan` (with a new segment where a resume changed the batch size), the global
batch being fetched (first sample, size) and the micro-batches of it that came.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from clusterflow.checkpoint.train_state import TrainState
from clusterflow.distributed.sampler import EpochPlan, shard_range, split
from clusterflow.train.loader import Loader
from clusterflow.train.stream import StreamLoader

log = logging.getLogger("clusterflow.trainer")


class Accounting:
    def __init__(self, state: TrainState, rank: int, world: int) -> None:
        self.state, self.rank, self.world = state, rank, world
        self.loader: Loader | StreamLoader | None = None
        self.plan: EpochPlan | None = None
        self.steps_per_epoch = 0
        self.global_batch: tuple[int, int] | None = None  # (first sample, size) of this step
        self.micro = 0  # micro-batches of the step being fetched that came
        self._steps: Iterator[tuple[int, int]] = iter(())
        self.max_steps: int | None = None  # run.steps(max_steps): the steps of a loaderless run

    def counts_batches_of(self, loader: Loader | StreamLoader) -> None:
        """``run.loader``'s loader, whose epochs this plans and whose batches it counts."""
        self.loader = loader

    def count_to(self, max_steps: int) -> None:
        """A loop of ``run.steps(max_steps)``, without a loader: one epoch of the run's steps."""
        self.max_steps = max_steps
        self.steps_per_epoch = max(max_steps, self.state.global_step)

    def plan_epoch(self) -> None:
        """The current epoch's global batches from the state: its saved plan (a checkpoint's),
        with a new segment where a resume changed the batch size."""
        loader = self.loader
        if loader is None:
            return
        s = self.state
        old, self.plan = self._plans()
        if self.plan is not old and self.rank == 0:
            log.warning(
                "batch size %d from sample %d of epoch %d on (the epoch started with %d)",
                loader.global_batch_size,
                s.sample_in_epoch,
                s.epoch + 1,
                old.segments[-1][1],
            )
        s.plan = self.plan.as_list()
        self.steps_per_epoch = self.plan.steps()

    def epoch_plan(self) -> EpochPlan:
        """The current epoch's plan from the state, which it leaves as it is."""
        return self._plans()[1]

    def _plans(self) -> tuple[EpochPlan, EpochPlan]:
        """(the plan the state holds, the plan with the loader's batch from the sample
        reached)."""
        loader = self.loader
        assert loader is not None
        s = self.state
        if s.sample_in_epoch is None:  # a checkpoint that counted steps of the batch size
            s.sample_in_epoch = s.step_in_epoch * loader.global_batch_size
        old = EpochPlan.of(loader.n, loader.global_batch_size, s.plan)
        return old, old.with_batch(s.sample_in_epoch, loader.global_batch_size)

    def epochs_for(self, max_steps: int) -> int:
        """The epochs a run of ``max_steps`` optimizer steps in all reaches (its last maybe in
        part), from the current epoch's plan and full epochs of the batch size after it."""
        left = max_steps - self.state.global_step - self.steps_left()
        if left <= 0 or self.loader is None:
            return self.state.epoch + 1
        per = EpochPlan.of(self.loader.n, self.loader.global_batch_size).steps()
        return self.state.epoch + 1 + -(-left // per)

    def steps_left(self) -> int:
        """Optimizer steps left in the current epoch (a loop without a loader: in the run)."""
        if self.max_steps is not None:
            return max(0, self.max_steps - self.state.global_step)
        if self.loader is None or self.plan is None:
            return 0
        return len(self.plan.batches_from(self.state.sample_in_epoch or 0))

    def batches_left(self) -> int | None:
        """The loader's batches left in the epoch (None before the epochs loop)."""
        if self.plan is None or self.loader is None:
            return None
        return self.steps_left() * self.loader.accumulate

    def epoch_begins(self) -> None:
        self.global_batch, self.micro = None, 0

    def batches_begin(self, loader: Loader | StreamLoader) -> None:
        """The loader's iteration starts: from the epoch's position on."""
        s = self.state
        if not loader.stream:
            loader.sampler.set_epoch(s.epoch, s.sample_in_epoch or 0, self.plan)  # type: ignore[union-attr]
        self._steps = iter(self.plan.batches_from(s.sample_in_epoch or 0))  # type: ignore[union-attr]

    def is_last_micro(self) -> bool:
        """Whether the batch coming is its step's last."""
        return self.micro + 1 == (self.loader.accumulate if self.loader is not None else 1)

    def retake(self) -> None:
        """The batches of a step that no ``run.step`` counted come again (a peek's)."""
        self.global_batch, self.micro = None, 0

    def batch_came(self) -> bool:
        """A micro-batch came; True when it is its step's first."""
        first = self.micro == 0
        if first:
            self.global_batch = next(self._steps)
        self.micro += 1
        if self.micro == self.loader.accumulate:  # type: ignore[union-attr]
            self.micro = 0
        return first

    def count_step(self, attempt: int) -> int:
        """``run.step``: the step counted in the state and its samples in the ledger. Returns
        this rank's samples in it (none in a loop without a loader, whose ledger counts steps)."""
        s = self.state
        if self.max_steps is not None:
            s.step_done()
            s.ledger.record_step(s.global_step, attempt, self.world)
            return 0
        start, size = self.global_batch  # type: ignore[misc]
        self.global_batch = None
        loader = self.loader
        assert loader is not None
        mine = sum(
            len(shard_range(m, self.rank, self.world)) for m in split(size, loader.accumulate)
        )
        s.step_done(size)
        s.ledger.record(
            s.epoch,
            loader.data,
            start,
            start + size,
            attempt=attempt,
            world=self.world,
            batch=loader.global_batch_size,
        )
        return mine

    def last_step(self) -> bool:
        """Whether the step just counted was its epoch's last."""
        return self.state.step_in_epoch == self.steps_per_epoch

    def samples_trained(self) -> int:
        """Samples of the run's epochs trained, the step being taken included."""
        n = self.loader.n if self.loader is not None else 0
        at = (
            self.global_batch[0] + self.global_batch[1]
            if self.global_batch is not None
            else self.state.sample_in_epoch or 0
        )
        return self.state.epoch * n + at
