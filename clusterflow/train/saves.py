"""When the loop's events commit a checkpoint, and how an agreed stop ends the job: the run's
side of ``checkpoint/checkpointer.py`` (which decides whether a save is due and writes it) and of
``train/preemption.py`` (which says when every rank agreed to stop).

- :meth:`Saves.save`: an event (``STEP``, ``LOOP_END``, ``EPOCH_END``, ``STOP``) to the
  checkpointer; a save's scalars to the reporter; where the saved state is (:meth:`saved_now`).
- :meth:`Saves.stop`: an agreed stop saves the step (unless a save holds it already), ends the
  job and raises :class:`RunStopped`; :meth:`stop_in_round` is the same inside a mining round.
- :meth:`Saves.finish`: the last write committed, ``RUN_DIR/model.pt``, the job ended.
- before each commit (collective): the metrics flushed, no non-finite state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import NoReturn, Protocol

import torch

from clusterflow.checkpoint import checkpointer, rng
from clusterflow.checkpoint.checkpointer import Checkpointer, Stateful
from clusterflow.checkpoint.data_identity import DataIdentity
from clusterflow.checkpoint.registered import Stream
from clusterflow.checkpoint.rng import RngState, capture_rng, restore_rng
from clusterflow.checkpoint.train_state import TrainState
from clusterflow.distributed import comm as dist
from clusterflow.distributed import sharding
from clusterflow.observe.context import JobContext
from clusterflow.observe.reporter import Reporter
from clusterflow.storage import durable
from clusterflow.storage.tensors import TORCH
from clusterflow.train import parallel
from clusterflow.train.call_order import CallOrder
from clusterflow.train.finite import FiniteGuard
from clusterflow.train.preemption import StopAgreement

log = logging.getLogger("clusterflow.trainer")


class RunStopped(SystemExit):
    """Every rank agreed to stop (a signal, a cancel): the stop checkpoint is committed and the job
    has ended (requeued, stopped or cancelled). A ``SystemExit``, so an ``except Exception`` of the
    training loop does not swallow it; its code is the process's exit status."""

    def __init__(self, outcome: str, code: int) -> None:
        super().__init__(code)
        self.outcome = outcome


class Ending(Protocol):
    """The job's end (``job/attempt.py``): requeue or not, status, the run dir let go, the process
    group shut down. Returns the job's outcome and the process's exit status."""

    def __call__(self, outcome: str) -> tuple[str, int]: ...


class Saves:
    """The checkpoints and the end of one attempt on this rank."""

    def __init__(
        self,
        ctx: JobContext,
        state: TrainState,
        *,
        stop: StopAgreement,
        ending: Ending,
        reporter: Reporter,
        guard: FiniteGuard,
        order: CallOrder,
    ) -> None:
        self.ctx = ctx
        self.cfg, self.paths, self.attempt = ctx.cfg, ctx.paths, ctx.attempt
        self.phases = ctx.phases
        self.state, self.stop_agreement, self._ending = state, stop, ending
        self.reporter, self.guard, self.order = reporter, guard, order
        self.checkpointer: Checkpointer | None = None
        self.module: torch.nn.Module | None = None  # the one saved as model.pt
        self.optimizers: list[torch.optim.Optimizer] = []
        # The (global step, position) of the newest state a save holds (committed or in flight).
        self.saved_at: tuple[int, tuple[int, int]] | None = None
        # The random streams as the epoch's last step left them (a round cut short goes back).
        self._steps_done_rng: RngState | None = None
        self.at_finish: list[Callable[[], None]] = []
        # What the attempt's end releases, whatever the reason (the loader's workers).
        self.at_close: list[Callable[[], None]] = []
        self._streams: list[str] = []  # the script's own random streams (rng.track)
        self._closed = False

    # -- registering and restoring ----------------------------------------------------------
    def register(
        self,
        module: torch.nn.Module,
        states: Mapping[str, Stateful],
        steps_per_epoch: int,
        data: DataIdentity | None,
    ) -> bool:
        """What every checkpoint holds; then the newest committed checkpoint that verifies,
        restored. True when resumed."""
        self.module = module
        self.optimizers = [o for o in states.values() if isinstance(o, torch.optim.Optimizer)]
        self.checkpointer = Checkpointer(
            self.ctx,
            module,
            states,
            self.state,
            steps_per_epoch=max(1, steps_per_epoch),
            before_commit=self._commit_check,
            after_commit=self.reporter.timeline.committed,
            after_snapshot=self.reporter.inflight.committed,
        )
        # The watch of the job's end (rank 0 of a Slurm job) needs to know how long a save takes.
        self.stop_agreement.preemption.measure_saves(self.checkpointer.save_s)
        resumed = self.checkpointer.restore(data)
        if resumed:  # the state restored is a committed one
            self.saved_at = (self.state.global_step, self.state.position)
        return resumed

    def track(self, streams: Mapping[str, Stream]) -> None:
        """The script's own random streams (and a stream loader's place), saved per rank in every
        checkpoint beside the global ones until the attempt closes."""
        for name, (get, put) in streams.items():
            rng.track(name, get, put)
        self._streams = list(streams)

    def _commit_check(self, event: str) -> None:
        # Every point up to a checkpoint is on disk: a resume logs only later steps again.
        self.reporter.writer.flush()
        # A non-finite state is never committed.
        self.guard.check(self.state.global_step, self.state_tensors())

    def state_tensors(self) -> Iterator[object]:
        """This rank's part of every weight and optimizer tensor (its shards under fsdp)."""
        if self.module is not None:
            yield from parallel.local(self.module.parameters())
            yield from parallel.local(self.module.buffers())
        for opt in self.optimizers:
            for per_param in opt.state.values():
                yield from parallel.local(per_param.values())

    def committed_steps(self) -> list[int]:
        return self.checkpointer.committed_steps() if self.checkpointer is not None else []

    # -- saving -----------------------------------------------------------------------------
    def save(self, event: str) -> None:
        """``event`` to the checkpointer, which saves when one is due."""
        assert self.checkpointer is not None
        scalars = self.checkpointer.save(event)
        if scalars:
            self.saved_at = (self.state.global_step, self.state.position)
            self.reporter.saved(scalars, event)
        if event in (checkpointer.EPOCH_END, checkpointer.STOP):
            # Where a stop or an epoch's end left the run, whatever the progress cadence skipped.
            self.reporter.report()

    def steps_done(self) -> None:
        """The epoch's last step is done: the random streams as it left them, which a mining
        round cut short by a stop goes back to (:meth:`stop_in_round`)."""
        self._steps_done_rng = capture_rng()

    def saved_now(self) -> bool:
        """Whether a save holds the state as it is (committed, or its write in flight)."""
        return self.saved_at == (self.state.global_step, self.state.position)

    # -- stopping ---------------------------------------------------------------------------
    def stop(self, reason: str) -> NoReturn:
        """Every rank agreed to stop at a step boundary: save that step, end the job."""
        log.warning(
            "%s: saving at global step %d and stopping",
            self.stop_agreement.preemption.why(reason),
            self.state.global_step,
        )
        if self.saved_now():  # resumed after an epoch's last step: the checkpoint holds it
            self.checkpointer.landed()  # type: ignore[union-attr]
            self.reporter.report()
        else:
            self.save(checkpointer.STOP)
        self.end_stopped(reason)

    def stop_at_epoch_end(self, reason: str) -> NoReturn:
        """A stop agreed at an epoch's end, whose checkpoint holds the state."""
        log.warning(
            "%s: saved at global step %d (the end of epoch %d) and stopping",
            self.stop_agreement.preemption.why(reason),
            self.state.global_step,
            self.state.epoch,
        )
        self.end_stopped(reason)

    def stop_in_round(self, reason: str, finished: int, before_epoch_end: bool) -> NoReturn:
        """A signal cut the round after epoch ``finished`` short: the next attempt resumes at the
        loop's end of that epoch (the code after the loop runs again, on the states as the loop
        ended them) and continues the round from its files."""
        why = self.stop_agreement.preemption.why(reason)
        if self.saved_now():
            # Saved at the epoch's last step (LOOP_END), or the checkpoint this attempt resumed
            # from.
            self.checkpointer.landed()  # type: ignore[union-attr]
            self.reporter.report()
        elif before_epoch_end:
            # The task trainer: its eval before the round changes no registered state, only the
            # random streams, which go back to the last step's.
            if self._steps_done_rng is not None:
                restore_rng(self._steps_done_rng)
            self.save(checkpointer.STOP)
        else:
            # A script that had not called run.mine in an epoch due to mine: its loop's end was
            # not kept, and its code after the loop may have changed the states, which must not
            # be saved: the newest checkpoint stays the resume point, and the steps after it are
            # trained again.
            self.checkpointer.landed()  # type: ignore[union-attr]
            newest = max(self.committed_steps(), default=0)
            log.warning(
                "%s: stopping in the mining round after epoch %d, whose loop's end was not kept "
                "(an earlier epoch due to mine had no run.mine): nothing new is saved; the next "
                "attempt resumes from step %d and trains the %d step(s) after it again",
                why,
                finished,
                newest,
                self.state.global_step - newest,
            )
            self.end_stopped(reason)
        log.warning(
            "%s: saved at global step %d (in the mining round after epoch %d, which the "
            "next attempt continues) and stopping",
            why,
            self.state.global_step,
            finished,
        )
        self.end_stopped(reason)

    def end_stopped(self, reason: str) -> NoReturn:
        outcome, code = self.end(reason)
        raise RunStopped(outcome, code)

    def end(self, outcome: str) -> tuple[str, int]:
        """The attempt's end (the run closed, the job's ending): every later call is refused."""
        self.close(outcome)
        final, code = self._ending(outcome)
        self.order.end(final)
        return final, code

    # -- the end ----------------------------------------------------------------------------
    def finish(self) -> None:
        """The last state committed (saved now unless a save holds it), ``RUN_DIR/model.pt``
        written (the whole model, gathered under fsdp), the ``at_finish`` writes, the job
        ended."""
        assert self.checkpointer is not None and self.module is not None
        if not self.saved_now():
            self.save(checkpointer.STOP)
        self.checkpointer.finish()  # the last checkpoint is committed before the run counts as done
        # Under fsdp: the whole model, gathered (collective), so model.pt loads into the plain one.
        sharded = sharding.is_fsdp(self.module)
        weights = parallel.full_state_dict(self.module) if sharded else None
        if dist.rank() == 0:
            durable.write_atomic(
                self.paths.model,
                weights if sharded else self.module.state_dict(),
                codec=TORCH,
            )
        for write in self.at_finish:
            write()
        dist.barrier()

    def close(self, outcome: str) -> bool:
        """At the end of the attempt, whatever the reason: the ``at_close`` releases, the
        reports, the write in flight. False when closed already."""
        if self._closed:
            return False
        self._closed = True
        for release in self.at_close:
            release()
        rng.untrack(self._streams)
        self.reporter.close(outcome)
        if self.checkpointer is not None:
            self.checkpointer.close()
        return True
