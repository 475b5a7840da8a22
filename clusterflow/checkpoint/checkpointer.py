"""The one owner of checkpoints in a run: when one is due, what goes in it, writing and reading it.

The loop only says what happened (:data:`STEP`, :data:`LOOP_END`, :data:`EPOCH_END`,
:data:`STOP`); the checkpointer decides whether a save is due:

- every ``checkpoint.every_steps`` optimizer steps, except at the last step of an epoch, which is
  saved after its eval and mining instead (so the labels of a finished round are in it);
- at the last step of an epoch whose end runs a script's mining round (:data:`LOOP_END`; the run
  says when): the states as the loop ended them, before the script's own code after the loop
  changes them (a validation, a per-epoch scheduler step), so that a stop or a kill before the
  epoch's end resumes there and that code runs once; the end-of-epoch checkpoint of the same step
  supersedes it;
- at the end of every epoch (after eval and mining);
- on a stop (a signal agreed by every rank).

What is saved is registered, not listed (torchtitan's ``CheckpointManager(states=...)``): ``model``
goes to ``model.pt`` as a plain state_dict, and every object in ``states`` (anything with
``state_dict``/``load_state_dict``) to ``train_state.pt`` under its name, beside every rank's RNG
state. The manifest carries the train state's ``position``, so the state after the end-of-epoch
work supersedes a stop checkpoint taken at the same step before it (see ``storage/store.py``).

Saving (``checkpoint.async``, docs/preemption.md): every rank hands its RNG state to rank 0, which
alone writes. A step or end-of-epoch save is snapshotted into host memory (``staging.py``) and
committed by a background thread with the store's protocol, so the other ranks go on at once and
rank 0 as soon as the snapshot is taken. At most one write is in flight: the next save waits for
it (that wait is the "stall" logged and sent to TensorBoard). A stop, and the end of the run,
wait for the write in flight and then write synchronously, so a stopped job has committed its
last step before any rank exits. A background write that fails is logged and put in ``status``
at once, and the next save is its retry, written synchronously; a synchronous write that fails
fails the job on every rank. Committed steps are never touched by a failure.

Sharded runs (``train.parallel=fsdp``, ``sharded.py``): the model, the optimizers and the EMA
are written by every rank into rank 0's staging folder, which rank 0 commits with
``train_state.pt`` once every rank has written and hashed its files; in the background, every
rank copies its shards and its writer thread runs the same protocol over a process group of its
own. The rules above (one write in flight, synchronous stops and retries) are the same.

Restoring: ``restore.py``.
"""

from __future__ import annotations

import copy
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from clusterflow import rundir
from clusterflow.checkpoint import identity
from clusterflow.checkpoint.background import BackgroundWrite
from clusterflow.checkpoint.data_identity import DataIdentity
from clusterflow.checkpoint.memory import MemoryRestore, MemorySnapshots, history_bounds
from clusterflow.checkpoint.restore import Restorer
from clusterflow.checkpoint.rng import RngState, capture_rng
from clusterflow.checkpoint.sharded import ShardedState, holds_shards
from clusterflow.checkpoint.staging import Staging
from clusterflow.checkpoint.train_state import TrainState
from clusterflow.distributed import comm as dist
from clusterflow.distributed.groups import Subgroup
from clusterflow.errors import RunFailed
from clusterflow.observe import phases
from clusterflow.observe.context import JobContext
from clusterflow.rundir import timeline, transitions
from clusterflow.rundir.saved_config import portable
from clusterflow.storage import durable
from clusterflow.storage.names import DCP, MODEL, TRAIN_STATE
from clusterflow.storage.store import AlsoKeep, CheckpointStore
from clusterflow.storage.tensors import TORCH

log = logging.getLogger("clusterflow.checkpointer")

STEP, LOOP_END, EPOCH_END, STOP = "step", "loop end", "epoch end", "stop"
# The name the train state (the run's counters) has in a checkpoint's train_state.pt.
TRAIN = "train"


class CheckpointWriteError(RunFailed):
    """A checkpoint could not be written synchronously; raised on every rank (the job fails with
    this one line, exit 1: the message names the step, the place and the cause)."""


class Stateful(Protocol):
    """A registered state: optimizers, schedulers, the grad scaler, the train state, the EMA."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> object: ...


class Checkpointer:
    def __init__(
        self,
        ctx: JobContext,
        model: torch.nn.Module,
        states: Mapping[str, Stateful],
        state: TrainState,
        *,
        steps_per_epoch: int,
        before_commit: Callable[[str], None] | None = None,
        after_commit: Callable[[int, float | None], None] | None = None,
        after_snapshot: Callable[[int], None] | None = None,
    ) -> None:
        """``states``: what a checkpoint holds besides the model, by name; ``state``, the run's
        counters, is saved with them as :data:`TRAIN`. ``after_snapshot``: told each step whose
        snapshot in memory this rank committed (``checkpoint.memory_every_steps``)."""
        cfg, paths, attempt = ctx.cfg, ctx.paths, ctx.attempt
        c = cfg.checkpoint
        self.store = CheckpointStore(
            cfg.checkpoint_dir,
            c.keep_last,
            c.fsync,
            also_keep=AlsoKeep(c.keep_every_steps, c.best),
            check=identity.check,
            codec=TORCH,
        )
        # The keep_best metric's latest logged value, saved in each manifest (``note``).
        self.metrics: dict[str, float] = {}
        self.logged: set[str] = set()  # every scalar name logged so far, to name in a warning
        self.warned_best = False
        if dist.rank() == 0:
            self.store.after_publish = self._published
        self.cfg, self.model, self.states, self.state = cfg, model, {**states, TRAIN: state}, state
        # train.parallel=fsdp: the model and optimizers are written by every rank (sharded.py).
        self.sharded: ShardedState | None = None
        if cfg.train.parallel == "fsdp":
            # Optimizers, and every state that holds shards (the trainer's EMA, a second model
            # set up, a script's dict of sharded tensors).
            shards = {
                n: o
                for n, o in self.states.items()
                if isinstance(o, torch.optim.Optimizer)
                or getattr(o, "sharded", False)
                or holds_shards(o)
            }
            self.sharded = ShardedState(model, shards)
            self.states = {n: o for n, o in self.states.items() if n not in shards}
        self.every_steps, self.steps_per_epoch, self.attempt = (
            c.every_steps,
            steps_per_epoch,
            attempt,
        )
        # The run's epochs (a script's run.epochs(n) says how many): in each manifest, so that
        # status can tell a run's last checkpoint.
        self.total_epochs = cfg.train.epochs
        # A loop without a loader (run.steps(max_steps)): its length in steps, in each manifest.
        self.max_steps: int | None = None
        self.phases = ctx.phases
        # Collective; raises to refuse a state (the trainer: non-finite).
        self.before_commit = before_commit
        # Rank 0, with the step and the seconds its write took until then, as soon as a
        # checkpoint is published (on the write thread when the save runs in the background):
        # the attempt's timeline.
        self.after_commit = after_commit or (lambda step, seconds: None)
        self.paths = paths
        self.writes = BackgroundWrite()
        self.staging = None
        if c.async_ and dist.rank() == 0 and self.sharded is None:
            optimizers = [o for o in self.states.values() if isinstance(o, torch.optim.Optimizer)]
            self.staging = Staging(model, optimizers)
        # Background sharded saves: every rank writes, over a group of their own (the loop's
        # collectives go on meanwhile in the default group).
        self._bg = Subgroup(cfg.dist.timeout_s) if self.sharded and c.async_ else None
        # Where a background write may be in flight: rank 0, or every rank when sharded.
        self._writes_here = dist.rank() == 0 or self.sharded is not None
        self._last_write_s: float | None = None
        # How long a write takes, for the watch of the job's end (save_s): when the write under
        # way started (rank 0), the longest one measured, and the longest an earlier attempt of
        # the run measured (its timeline), until this attempt has measured its own.
        self._write_started: float | None = None
        self._longest_write_s = 0.0
        self._earlier_write_s = (
            timeline.longest_write(timeline.read_all(paths)) if dist.rank() == 0 else 0.0
        )
        self._rounds_saved = 0  # mining rounds in the last saved state (set again by restore)
        # checkpoint.memory_every_steps: snapshots in the nodes' memory (memory.py), between the
        # shared filesystem's checkpoints.
        self.memory = (
            MemorySnapshots(
                cfg, paths, model, self.states, state, attempt, on_commit=after_snapshot
            )
            if c.memory_every_steps > 0 and self.sharded is None
            else None
        )
        # Where the last restore read the state: (memory | replica | shared, where, step).
        self.restored_from: tuple[str, str, int] | None = None

    # -- the loop's length ----------------------------------------------------------------------
    def loop_starts(self, total_epochs: int) -> None:
        """The run's loop starts and reaches ``total_epochs`` (a script's ``run.epochs(n)``, or
        the epochs ``run.steps`` reaches): in each manifest, so that status can tell the run's
        last checkpoint."""
        self.total_epochs = total_epochs

    def epoch_planned(self, steps_per_epoch: int) -> None:
        """The current epoch has ``steps_per_epoch`` optimizer steps: a step save is never due at
        its last (the end-of-epoch save takes it)."""
        self.steps_per_epoch = steps_per_epoch

    def counts_steps(self, max_steps: int) -> None:
        """A loop without a loader (``run.steps(max_steps)``): its length in steps, in each
        manifest."""
        self.max_steps = max_steps

    def save_s(self) -> float:
        """Rank 0: how long a checkpoint write takes, as measured from its start to its publish
        (the longest of this attempt's, else of an earlier attempt's; a write in flight for longer
        counts with its time so far); 0 before any was measured."""
        started = self._write_started
        flight = time.perf_counter() - started if started is not None and self.writes.busy else 0
        return max(self._longest_write_s or self._earlier_write_s, flight)

    def due(self, event: str) -> bool:
        if event != STEP:
            return True
        return self.state.save_due(self.every_steps, self.steps_per_epoch)

    # -- saving -------------------------------------------------------------------------------
    def save(self, event: str) -> dict[str, float]:
        """Collective when due. Returns scalars for the metrics: ``checkpoint/stall_s`` (how long
        this call blocked the loop), ``checkpoint/gate_s`` (how long the last optimizer step waited
        for the previous snapshot), ``checkpoint/save_s`` (the last finished write); empty when not
        due."""
        if event == STEP and self.memory is not None and self.memory.due(self.steps_per_epoch):
            with self.phases.enter(phases.SNAPSHOT):
                self.memory.take(capture_rng())
        if not self.due(event):
            return {}
        if self.memory is not None and event == STOP:
            self.memory.stop()  # the stop's checkpoint supersedes every snapshot
        if self.before_commit is not None:
            self.before_commit(event)
        t0 = time.perf_counter()
        with self.phases.enter(phases.CHECKPOINT):
            rngs = dist.gather_object(capture_rng())
            failed = dist.broadcast_object(
                self._wait_for_write(expected=event == STOP) if self._writes_here else None
            )
            new_round = self._new_round()
            background = (
                self.cfg.checkpoint.async_ and event != STOP and failed is None and not new_round
            )
            if self.sharded is not None:
                (self._start_sharded(rngs) if background else self._write_sharded(rngs, failed))
            elif background:
                if dist.rank() == 0:
                    self._start_write(rngs)
                    if event == LOOP_END and self.staging is not None:
                        # The script's code after the loop may change any state in place.
                        self.staging.settle()
            else:
                self._write_now(rngs, failed)
        if self.memory is not None and event == STOP:
            # Committed on the shared filesystem: this node's snapshots are older than it.
            self.memory.close(clear=True)
        return self._scalars(time.perf_counter() - t0)

    def _new_round(self) -> bool:
        """True when the state holds a mining round no earlier save held: that save is written
        synchronously, so no kill can make the run mine that round again (a round costs far more
        than a write)."""
        rounds = len(self.state.mining_history)
        new, self._rounds_saved = rounds > self._rounds_saved, rounds
        return new

    def finish(self) -> None:
        """Collective, at the end of the run: wait for the write in flight; write a failed one
        again now."""
        if self.memory is not None:
            self.memory.stop()  # no snapshot is sent to a peer that clears its own after this
        failed = dist.broadcast_object(
            self._wait_for_write(expected=True) if self._writes_here else None
        )
        if failed:
            rngs = dist.gather_object(capture_rng())
            if self.sharded is not None:
                self._write_sharded(rngs, failed)
            else:
                self._write_now(rngs, failed)
        if self.memory is not None:
            self.memory.close(clear=True)

    def wait(self) -> None:
        """This rank's write in flight, finished (a failure is reported by the write itself)."""
        if self._writes_here:
            self._wait_for_write(expected=True)

    def landed(self) -> None:
        """Collective, at a stop whose state a save in flight (or committed) holds already: wait
        for that write. A failure, reported already, is not written again: the state has moved on
        since it was taken, and the resume goes back to the checkpoint before it."""
        dist.broadcast_object(self._wait_for_write(expected=True) if self._writes_here else None)

    def _write_sharded(self, rngs: list[RngState] | None, retry_of: str | None) -> None:
        """Collective: the sharded save written now (``_sharded_save``); a failure fails the job
        on every rank."""
        if dist.rank() == 0 and retry_of:
            log.warning(
                "writing checkpoint step %d synchronously: "
                "the background write before it failed (%s)",
                self.state.global_step,
                retry_of,
            )
        step, meta = self.state.global_step, {**self._meta(), "format": DCP}
        files = self._files(rngs) if dist.rank() == 0 else None
        error = self._sharded_save(step, meta, None, files, _MAIN, retry_of)
        if error:
            if dist.rank() == 0:
                log.error("%s; the committed steps are untouched; the job stops", error)
                transitions.report(self.paths, checkpoint_error=error)
            raise CheckpointWriteError(error)

    def _start_sharded(self, rngs: list[RngState] | None) -> None:
        """Every rank: copy its shards (and rank 0 the small states) now, and write them on a
        background thread that talks over its own process group, while the loop goes on."""
        step, meta = self.state.global_step, {**self._meta(), "format": DCP}
        shards = self.sharded.snapshot()
        files = copy.deepcopy(self._files(rngs)) if dist.rank() == 0 else None

        def write() -> None:
            error = self._sharded_save(step, meta, shards, files, self._bg, None)
            if error:
                raise CheckpointWriteError(error)

        self.writes.start(step, write, self._background_failed)

    def _sharded_save(
        self,
        step: int,
        meta: dict[str, Any],
        shards: dict[str, Any] | None,
        files: dict[str, Any] | None,
        comm: Subgroup | _Main,
        retry_of: str | None,
    ) -> str | None:
        """Collective over ``comm``: every rank writes its shards (``shards``, or the live state
        when None) into rank 0's staging folder and hashes them; rank 0 adds ``files`` and commits
        the folder once every rank has succeeded. A kill at any point leaves a staging folder
        that is never read (no manifest, or one that the next restore verifies before publishing
        it). Returns the error every rank agrees on, or None."""
        folder, error, ident = None, None, identity.new_id()
        if dist.rank() == 0:
            try:
                folder = self.store.begin(step, meta)
            except Exception as exc:  # noqa: BLE001 - every rank learns it below
                error = self._failure(step, exc)
        folder, error, ident = comm.broadcast_object((folder, error, ident))
        if folder is None:
            return error
        if dist.rank() == 0:
            files, meta = self._stamped(files, meta, ident, step)
        t0 = time.perf_counter()
        self._write_started = t0
        listed, mine = {}, None
        try:
            listed = self.sharded.write(
                folder, self.store.fsync, shards, comm.group, identity.tag(ident, step)
            )
        except Exception as exc:  # noqa: BLE001 - gathered: rank 0 names it
            mine = self._failure(step, exc)
        parts = comm.gather_object((listed, mine, dist.rank()))
        if dist.rank() == 0:
            error = self._commit_sharded(step, folder, parts, files, meta, retry_of)
            self._last_write_s = time.perf_counter() - t0
        return comm.broadcast_object(error)

    def _commit_sharded(
        self,
        step: int,
        folder: str,
        parts: list[tuple[dict[str, dict[str, Any]], str | None, int]],
        files: dict[str, Any],
        meta: dict[str, Any],
        retry_of: str | None,
    ) -> str | None:
        """Rank 0: commit the staged folder when every rank wrote its files. Returns the error."""
        failed = [(rank, why) for _, why, rank in parts if why]
        if failed:
            self.store.abandon(folder)
            rank, why = failed[0]
            return f"{why} (rank {rank})"
        listed: dict[str, Any] = {}
        for written, _, _ in parts:
            listed.update(written)
        t0 = time.perf_counter()
        try:
            path = self.store.commit(folder, step, files, listed, meta)
        except Exception as exc:  # noqa: BLE001 - every rank learns it
            return self._failure(step, exc)
        if retry_of:
            transitions.report(self.paths, checkpoint_error=None)
        rundir.write_ledger(self.paths, meta["samples"])
        log.info(
            "checkpoint step %d committed at %s (%d files from %d ranks, %.2f s)",
            step,
            path,
            len(listed) + 1,
            len(parts),
            time.perf_counter() - t0,
        )
        return None

    def _wait_for_write(self, expected: bool = False) -> str | None:
        """Rank 0: wait for the write in flight. Returns its error, if it failed. ``expected``: a
        stop or the end of the run, where waiting is the point, not a sign of saves due too
        often."""
        outcome = self.writes.wait()
        if outcome is None:
            return None
        self._last_write_s = outcome.seconds
        if outcome.waited >= 0.01 and not expected:
            (log.warning if outcome.waited >= 1.0 else log.info)(
                "checkpoint: the loop waited %.2f s for the background write of step %d "
                "(saves are due faster than they are written; raise checkpoint.every_steps, "
                "or write to a faster filesystem)",
                outcome.waited,
                outcome.step,
            )
        return outcome.error

    def _start_write(self, rngs: list[RngState] | None) -> None:
        """Rank 0: snapshot the state and commit it on the background thread."""
        self._write_started = time.perf_counter()
        step = self.state.global_step
        files, meta = self._stamped(self._files(rngs), self._meta(), identity.new_id(), step)
        try:
            snap = self.staging.take(files)
        # E.g. no host memory for the copy: a failed write like any other.
        except Exception as exc:  # noqa: BLE001
            failure = exc

            def write() -> None:
                raise failure
        else:

            def write() -> None:
                self.staging.copy_rest(snap)
                self._commit(step, self.staging.result(snap), meta, "in the background")

        self.writes.start(step, write, self._background_failed)

    def _background_failed(self, step: int, exc: BaseException) -> str:
        """On the writer's thread: report at once; the next save retries synchronously."""
        message = self._failure(step, exc)
        log.error(
            "%s; the committed steps are untouched; the next save is written synchronously "
            "and fails the job if it fails too",
            message,
        )
        if dist.rank() == 0:
            transitions.report(self.paths, checkpoint_error=message)
        return message

    def _write_now(self, rngs: list[RngState] | None, retry_of: str | None) -> None:
        """Collective: rank 0 commits before anyone goes on; a failure fails the job on every
        rank."""
        error = None
        if dist.rank() == 0:
            step = self.state.global_step
            if retry_of:
                log.warning(
                    "writing checkpoint step %d synchronously: "
                    "the background write before it failed (%s)",
                    step,
                    retry_of,
                )
            try:
                files, meta = self._stamped(
                    self._files(rngs), self._meta(), identity.new_id(), step
                )
                self._last_write_s = self._commit(step, files, meta, "")
                if retry_of:
                    transitions.report(self.paths, checkpoint_error=None)
            except Exception as exc:  # noqa: BLE001 - every rank learns it below
                error = self._failure(step, exc)
                log.error("%s; the committed steps are untouched; the job stops", error)
                transitions.report(self.paths, checkpoint_error=error)
        error = dist.broadcast_object(error)  # instead of a barrier: every rank knows the outcome
        if error:
            raise CheckpointWriteError(error)

    def _failure(self, step: int, exc: BaseException) -> str:
        cause = _cause(exc)
        if isinstance(cause, RunFailed):
            # A full disk: its sentence names the step, the path, the size and the free space.
            return str(cause)
        return (
            f"checkpoint step {step} could not be written to {self.store.url}: "
            f"{type(cause).__name__}: {cause}"
        )

    def _files(self, rngs: list[RngState] | None) -> dict[str, Any]:
        train_state = {name: obj.state_dict() for name, obj in self.states.items()}
        train_state.update(rng=rngs, world_size=dist.world())  # one RNG entry per rank
        if self.sharded is not None:
            return {TRAIN_STATE: train_state}
        return {MODEL: self.model.state_dict(), TRAIN_STATE: train_state}

    @staticmethod
    def _stamped(
        files: dict[str, Any], meta: dict[str, Any], ident: str, step: int
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The files and the manifest's fields of one save, tied together by its id
        (``identity.py``)."""
        return identity.stamp(files, ident, step), {**meta, "checkpoint_id": ident}

    def _meta(self) -> dict[str, Any]:
        self._warn_unlogged_best()
        p = self.state
        return {
            "epoch": p.epoch,
            "epochs": self.total_epochs,
            **({"max_steps": self.max_steps} if self.max_steps is not None else {}),
            "step_in_epoch": p.step_in_epoch,
            "global_step": p.global_step,
            "position": list(p.position),
            "config_hash": self.cfg.fingerprint(),
            "config": portable(self.cfg.to_dict()),
            "world_size": dist.world(),
            "attempt": self.attempt,
            # What this checkpoint trained of each epoch (RUN_DIR/sample_ledger.json once it is
            # committed).
            "samples": p.ledger.record_file(p.global_step),
            **({"metrics": dict(self.metrics)} if self.metrics else {}),
        }

    def note(self, scalars: Mapping[str, float]) -> None:
        """Logged scalars: the keep_best metric's latest value goes into the next manifests."""
        best = self.cfg.checkpoint.best
        if best is None:
            return
        self.logged.update(scalars)
        if best[0] in scalars:
            self.metrics[best[0]] = float(scalars[best[0]])

    def _warn_unlogged_best(self) -> None:
        """Once every epoch-end metric (eval, mining) has been logged at least once, a keep_best
        metric still unseen is named, with the names that were logged: a misspelt metric would
        otherwise keep no best checkpoint, silently."""
        c, best = self.cfg, self.cfg.checkpoint.best
        if best is None or self.warned_best or best[0] in self.metrics:
            return
        every = (c.train.eval_every_epochs, c.mining.start_epoch + c.mining.every_epochs - 1)
        if self.state.epoch < max(1, *every):
            return
        self.warned_best = True
        log.warning(
            "checkpoint.keep_best = %r: the metric %r was not logged by epoch %d, so no "
            "checkpoint is kept as the best one; metrics logged: %s",
            self.cfg.checkpoint.keep_best,
            best[0],
            self.state.epoch,
            ", ".join(sorted(self.logged)) or "none",
        )

    def _published(self, step: int) -> None:
        """Rank 0, as soon as a save published ``step`` (before pruning): the write's time is
        measured, the attempt's timeline records the commit, then RUN_DIR/best points at the best
        step."""
        started, seconds = self._write_started, None
        if started is not None:  # not the clean-up's publish of a staged folder at the start
            seconds = time.perf_counter() - started
            self._longest_write_s = max(self._longest_write_s, seconds)
        self.after_commit(step, seconds)
        if self.cfg.checkpoint.best is not None:
            self._point_best()

    def _point_best(self) -> None:
        """RUN_DIR/best: a relative symbolic link to the best checkpoint (its URL in a file for
        a store that is not a local path), replaced atomically; published before pruning, so it
        never names a pruned folder."""
        step = self.store.best_step()
        if step is None:
            return
        target = self.paths.best
        try:
            if not self.store.local:
                durable.write_atomic(target, self.store.url_of(step) + "\n")
                return
            tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
            os.symlink(os.path.relpath(self.store.step_path(step), self.paths.root), tmp)
            os.replace(tmp, target)
        except OSError as exc:
            log.warning("could not point %s at checkpoint step %d: %s", target, step, exc)

    def _commit(
        self, step: int, files: Mapping[str, Any], meta: Mapping[str, Any], how: str
    ) -> float:
        t0 = time.perf_counter()
        if not how:  # a synchronous write (one in the background started with its snapshot)
            self._write_started = t0
        # Objects, not bytes: the store streams them through torch.save, hashing as it writes.
        path = self.store.save(step, files, meta)
        seconds = time.perf_counter() - t0
        if path:
            rundir.write_ledger(self.paths, meta["samples"])
            log.info(
                "checkpoint step %d committed at %s %s(%.2f s)",
                step,
                path,
                f"{how} " if how else "",
                seconds,
            )
        return seconds

    def _scalars(self, stall: float) -> dict[str, float]:
        out = {"checkpoint/stall_s": stall}
        if self.memory is not None:
            out.update(self.memory.scalars())
        if self.staging is not None:
            out["checkpoint/gate_s"], self.staging.gate_s = self.staging.gate_s, 0.0
        if self._last_write_s is not None:
            out["checkpoint/save_s"], self._last_write_s = self._last_write_s, None
        return out

    def restore(self, data: DataIdentity | None = None) -> bool:
        """Collective, at the start of every attempt (``restore.Restorer``): ``data`` is the
        identity of the data this attempt trains on, which the checkpoint's must match
        (``data_identity.py``). Returns True when resumed."""
        memory = self._memory_restore()
        restorer = Restorer(
            self.cfg,
            self.model,
            self.states,
            self.state,
            self.store,
            sharded=self.sharded,
            data=data,
            memory=memory,
        )
        resumed = restorer.restore()
        self.restored_from = restorer.restored_from
        if memory is not None:
            memory.forget_after(self.state.global_step)
        # keep_best: the metric as of the step resumed from (a newer step may have been skipped
        # as damaged, and its value belongs to steps this attempt trains again).
        restored = (
            self.store.manifest(self.state.global_step)
            if resumed and self.cfg.checkpoint.best
            else None
        )
        if restored and isinstance(restored.get("metrics"), dict):
            self.metrics = dict(restored["metrics"])
        self._rounds_saved = len(self.state.mining_history)
        return resumed

    def _memory_restore(self) -> MemoryRestore | None:
        """Collective, with snapshots in memory: this node's snapshots found (``connect``) and the
        restore from them, bounded by the run's history (rank 0 reads the attempts' timelines:
        the steps a later attempt's resume abandoned are never restored)."""
        if self.memory is None:
            return None
        self.memory.connect()
        records = timeline.read_all(self.paths) if dist.rank() == 0 else timeline.Timelines()
        return MemoryRestore(self.memory.local, self.attempt, history_bounds(records, self.attempt))

    def committed_steps(self) -> list[int]:
        """The committed steps once rank 0's write in flight has landed (for a failure message that
        names the newest good checkpoint; a failed background write was already reported)."""
        if self._writes_here:
            self.writes.wait()
        return self.store.steps()

    def committed_epoch(self) -> int:
        """Epochs finished in the newest committed checkpoint, from its manifest (-1: none)."""
        manifest = self.store.newest_manifest()
        return int(manifest.get("epoch", -1)) if manifest else -1

    def close(self) -> None:
        """At exit, whatever the reason: let the write in flight finish (a failure is already
        logged), and leave no half-deleted old step behind."""
        if self._writes_here:
            self.writes.wait()
        if self.staging is not None:
            self.staging.close()
        if self.memory is not None:
            self.memory.close()
        self.store.wait_for_pruning()


class _Main:
    """The default process group, as a sharded save talks over it (no group of its own)."""

    group = None
    broadcast_object = staticmethod(dist.broadcast_object)
    gather_object = staticmethod(dist.gather_object)


_MAIN = _Main()


def _cause(exc: BaseException) -> BaseException:
    """What to report for a failed write: torch.save turns a failed file write (a full disk) into
    an opaque RuntimeError ("unexpected pos ...") whose context is the OSError that says what
    happened."""
    seen: BaseException | None = exc
    while isinstance(seen, RuntimeError) and not isinstance(seen, OSError):
        seen = seen.__cause__ or seen.__context__
    return seen if isinstance(seen, BaseException) else exc
