"""The run of the library API (docs/own-loop.md): every guarantee of a clusterflow job for a
training loop of the user's own, and the one implementation the task trainer uses too.

    run = clusterflow.start()                       # job/script.py: the job's side of it
    model, optimizer = run.setup(model, optimizer)  # device; DDP or FSDP2 (train.parallel)
    loader = run.loader(dataset, batch_size=256)    # the epoch plan (distributed/sampler.py)
    run.restore(model=model, optimizer=optimizer, scheduler=scheduler)
    for epoch in run.epochs(20):
        for batch in loader:
            ...; optimizer.step(); optimizer.zero_grad()
            run.step(loss=loss)
        run.mine(embed)
    run.finish()

:class:`Run` is a facade: each method checks the call against the order of calls and hands the
work to the part that owns it.

- ``call_order.py``: where the loop is (a :class:`Phase`) and the one line refusing a call out of
  order, naming the fix;
- ``accounting.py``: the epoch's plan, the step each batch belongs to, what a step counts;
- ``loader.py``: the DataLoader over the epoch plan and the checks of ``run.loader``'s arguments;
- ``saves.py``: when the loop's events commit a checkpoint, and how an agreed stop ends the job;
- ``checkpoint/registered.py``: what ``run.restore`` may register;
- ``observe/reporter.py``: metrics at the log cadence, status, timeline, stragglers, profiler;
- ``mining/adapter.py``: the mining round between epochs;
- ``parallel.py``: DDP or FSDP2.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, overload

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from clusterflow import rundir
from clusterflow.checkpoint import checkpointer, registered, rng
from clusterflow.checkpoint.checkpointer import Checkpointer, Stateful
from clusterflow.checkpoint.rng import RngState, capture_rng, restore_rng
from clusterflow.checkpoint.train_state import TrainState
from clusterflow.distributed import comm as dist
from clusterflow.distributed.sampler import LOADER_BATCH, TASK_BATCH, Batching, EpochPlan
from clusterflow.errors import UserError
from clusterflow.mining.adapter import LoopMining
from clusterflow.observe import phases
from clusterflow.observe.context import JobContext
from clusterflow.observe.metrics import NullWriter
from clusterflow.observe.reporter import ForwardMark, Reporter
from clusterflow.observe.timeline import MODEL, RESTORE, TASK_DATA, Startup, process_started_at
from clusterflow.rundir.states import State, StopReason
from clusterflow.tasks import Task
from clusterflow.train import builders, parallel
from clusterflow.train.accounting import Accounting
from clusterflow.train.call_order import Call, CallOrder, Phase
from clusterflow.train.finite import FiniteGuard
from clusterflow.train.loader import Loader, check_arguments, step_samples
from clusterflow.train.models import Models, Units
from clusterflow.train.preemption import AGREE_EVERY_S, Preemption, StopAgreement
from clusterflow.train.probe import Probe
from clusterflow.train.saves import Ending, RunStopped, Saves
from clusterflow.train.seeds import GlobalSeeds
from clusterflow.train.stream import POSITION, StreamLoader
from clusterflow.train.window import LossWindow

log = logging.getLogger("clusterflow.trainer")

# What the mining embed and the sharded model may compute in, besides the script's own autocast.
Amp = torch.dtype | None


class Run:
    """One attempt's training, on this rank. Built by ``clusterflow.start()`` (a script) or
    ``run_job`` (a task); ``ctx``: the job's config, run dir, attempt and the phase clock every
    part of the run marks its time on; ``ending`` is the job's end. ``amp``: the precision of a
    sharded model's forward and of the mining embed (None: as the model is); ``what``: the task
    or script, for messages."""

    def __init__(
        self,
        ctx: JobContext,
        device: torch.device,
        preemption: Preemption,
        ending: Ending,
        *,
        amp: Amp = None,
        what: str = "",
        startup: Startup | None = None,
        seeds: GlobalSeeds | None = None,
    ) -> None:
        cfg, paths, attempt = ctx.cfg, ctx.paths, ctx.attempt
        self.config, self.paths, self.device, self.attempt = cfg, paths, device, attempt
        self.rank, self.world_size = dist.rank(), dist.world()
        self.run_dir = paths.root
        self.amp, self.what = amp, what
        self.own_loop = bool(cfg.script.path)
        # What the messages about the batch name: a script's run.loader argument, or the task's
        # config key.
        self.batch_key = LOADER_BATCH if self.own_loop else TASK_BATCH
        self.phases = ctx.phases
        # Where the start-up went, marked up to the first step (the attempt marked its part).
        self.startup = startup or Startup(process_started_at())
        self.state = TrainState()
        self.window = LossWindow()
        self.stop = StopAgreement(preemption, cfg.dist.timeout_s, interval_s=AGREE_EVERY_S)
        self.guard = FiniteGuard(device, cfg.train, self.committed_steps, own_loop=self.own_loop)
        self.order = CallOrder(self._facts)
        self.account = Accounting(self.state, self.rank, self.world_size)
        self.reporter = Reporter(
            ctx,
            self.startup,
            progress=self._progress,
            note=self._note,
            cuda=_cuda(device),
        )
        self.saves = Saves(
            ctx,
            self.state,
            stop=self.stop,
            ending=ending,
            reporter=self.reporter,
            guard=self.guard,
            order=self.order,
        )
        self.mining = LoopMining(ctx, device, amp, self.stop)
        # clusterflow check's records and halt, in its runs only (train/probe.py).
        self.probe = Probe.of(paths, self.rank, self.world_size, attempt)
        self.total_epochs = 0
        # The global random streams: the script's own seeds kept (train/seeds.py).
        self.seeds = seeds or GlobalSeeds(cfg.run.seed, script=False)
        self.models = Models(cfg, device, amp, self.seeds.at_setup)
        # run.autocast's precision and run.scaler, the GradScaler fp16 needs (a no-op otherwise):
        # the only ones of the run, which the task trainer uses too; saved with every checkpoint
        # when it scales.
        self.precision = builders.Precision(cfg.train.amp, device)
        self.scaler = self.precision.scaler
        self._counts_steps = False  # the loop is run.steps (no epochs of the script's own)
        self._loader: Loader | None = None
        # A stop leaves the loop with the loader's iterator held: its workers are stopped at the
        # attempt's end, whatever the reason, or the interpreter's exit waits for them forever.
        self.saves.at_close.append(self._stop_loader)
        self._resumed = False
        # The random streams the resumed checkpoint restored: set again when the loop starts,
        # whatever the script drew or seeded after run.restore.
        self._restored_rng: RngState | None = None
        self._iterations = 0  # iterations of run.loader begun
        # The iteration whose batches no step counted yet: the random streams and the model
        # forwards when it began (its batches may be fetched again while no model saw them).
        self._fresh: tuple[RngState, int] | None = None
        # A stop agreed at an epoch's last step: saved there, before the loop's end-of-epoch work
        # (the task trainer: its eval and mining resume in a fresh attempt), or at the epoch's end
        # after it (a script: a resume never starts in an epoch whose steps are all done, where a
        # loop that reads its last batch's variables after the loop would find none).
        self.stop_before_epoch_end = False

    # -- what the loop reads ------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """Epochs finished."""
        return self.state.epoch

    @property
    def global_step(self) -> int:
        """Optimizer steps done in all (this run's, across its attempts)."""
        return self.state.global_step

    @property
    def labels(self) -> np.ndarray | None:
        """The last mining round's labels by sample index (restored on resume), or None."""
        return self.state.labels

    @property
    def global_batch(self) -> tuple[int, int] | None:
        """(first sample, size) of the global batch of the step being taken."""
        return self.account.global_batch

    @property
    def steps_per_epoch(self) -> int:
        return self.account.steps_per_epoch

    @property
    def plan(self) -> EpochPlan | None:
        return self.account.plan

    @property
    def checkpointer(self) -> Checkpointer | None:
        return self.saves.checkpointer

    @property
    def outcome(self) -> str | None:
        """The job's outcome once this attempt ended (completed, or what a stop led to)."""
        return self.order.outcome

    @property
    def writer(self) -> NullWriter:
        """TensorBoard, metrics.jsonl and the trackers (rank 0), opened at the first use."""
        return self.reporter.writer

    def samples_trained(self) -> int:
        """Samples of the run's epochs trained, the step being taken included (a learning-rate
        schedule that counts samples reads it between the optimizer step and ``step()``)."""
        return self.account.samples_trained()

    def committed_steps(self) -> list[int]:
        return self.saves.committed_steps()

    # -- setup --------------------------------------------------------------------------------
    @overload
    def setup(
        self, model: torch.nn.Module, optimizer: None = None, *, shard_units: Units = None
    ) -> torch.nn.Module: ...

    @overload
    def setup(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        shard_units: Units = None,
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]: ...

    def setup(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        shard_units: Units = None,
    ) -> torch.nn.Module | tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The model on this rank's device, wrapped for the world (DDP, or FSDP2 with
        ``train.parallel=fsdp``: ``shard_units``, or a function of the model giving them, are
        sharded one by one); the optimizer's parameters follow the sharding. Call it once per
        model (a GAN's two, each with its optimizer). Every rank then draws from a random stream
        of its own (dropout, augmentations)."""
        self.order.enter(Call.SETUP)
        clock = self.reporter.clock
        mark = ForwardMark(clock) if self.probe is None else self.probe.mark(clock)
        wrapped = self.models.setup(model, optimizer, shard_units, mark)
        if self.own_loop:  # the script's code up to here built its model
            self.startup.mark(MODEL)
        return wrapped if optimizer is None else (wrapped, optimizer)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The plain module ``run.setup`` took (or returned) ``model`` for: what an embedding
        for ``run.mine`` calls (a DDP wrapper's forward is collective, and ranks embed different
        numbers of batches). UserError for a model not set up."""
        return self.models.unwrap(model)

    # -- data ---------------------------------------------------------------------------------
    def loader(
        self,
        dataset: Dataset,
        batch_size: int | None = None,
        *,
        global_batch_size: int | None = None,
        accumulate: int = 1,
        set_epoch: Callable[[int], None] | None = None,
        **dataloader_kwargs: object,
    ) -> Loader | StreamLoader:
        """A DataLoader over the epoch plan. Its batch, one of the two: ``batch_size``, each
        rank's batch as ``DataLoader(dataset, batch_size)`` takes it (a step trains
        ``batch_size x world size x accumulate`` samples), or ``global_batch_size``, the samples
        of one optimizer step on all ranks together; ``accumulate`` batches make a step.
        ``set_epoch`` (default: the dataset's own, if it has one) is called with each epoch, in
        the worker processes too. Other keyword arguments go to ``torch.utils.data.DataLoader``
        (num_workers, collate_fn, pin_memory, ...)."""
        if self._loader is not None and self.order.allows(Call.LOADER):
            raise UserError(
                "run.loader was called twice: the epoch plan drives one training loader; build "
                "evaluation loaders with torch.utils.data.DataLoader"
            )
        self.order.enter(Call.LOADER)
        kwargs = dict(dataloader_kwargs)
        check_arguments(dataset, accumulate, kwargs)
        stream = isinstance(dataset, IterableDataset)
        total, key = step_samples(
            sys.maxsize if stream else len(dataset),  # type: ignore[arg-type]
            batch_size,
            global_batch_size,
            accumulate,
            self.world_size,
            what=self.what or "the dataset",
            key=self.batch_key,
        )
        batching = Batching(total, accumulate, self.rank, self.world_size, self.config.run.seed)
        if stream:
            self._loader = self.account.loader = StreamLoader(
                dataset,  # type: ignore[arg-type]
                batching,
                self.attempt,
                kwargs=kwargs,
                iterate=self._iterate,
            )
            return self._loader
        self._loader = self.account.loader = Loader(
            dataset,
            batching,
            key,
            set_epoch=set_epoch if set_epoch is not None else getattr(dataset, "set_epoch", None),
            kwargs=kwargs,
            iterate=self._iterate,
            left=self.account.batches_left,
        )
        if self.own_loop:  # the script's code since its last call built its data
            self.startup.mark(TASK_DATA)
        return self._loader

    def _iterate(self, loader: Loader | StreamLoader) -> Iterator[Any]:
        """This epoch's batches from the position reached; counts what each step takes. Outside
        an epoch: a look at the batches (:meth:`_peek`). A new iteration after batches that no
        ``run.step`` counted and no model saw (``next(iter(loader))`` at an epoch's start, as a
        DataLoader allows) fetches them again, on the random streams as they were."""
        if not self.order.in_epoch:
            yield from self._peek(loader)
            return
        fresh = self._fresh
        if self.order.mid_step and fresh is not None and fresh[1] == self.reporter.clock.forwards:
            self.order.enter(Call.RETAKE)
            self.account.retake()
            restore_rng(fresh[0])
        self.order.enter(Call.ITERATE)
        self._iterations += 1
        mine = self._iterations
        # Until its first step is counted, this iteration's batches may be fetched again.
        self._fresh = None if loader.stream else (capture_rng(), self.reporter.clock.forwards)
        self.account.batches_begin(loader)
        batches = loader.batches(self.state.epoch)
        k = 0  # micro-batches asked for in this iteration
        while True:
            self.reporter.batch_asked(
                self.state.global_step + 1,
                self.state.epoch,
                self.account.micro,
                None if loader.stream else loader.sampler.slice_at(k),
            )
            k += 1
            asked = self.reporter.clock.asking(first_of_step=self.account.micro == 0)
            try:
                items = next(batches)
            except StopIteration:
                break
            self.reporter.clock.came(asked)
            self.order.enter(Call.LAST_BATCH if self.account.is_last_micro() else Call.BATCH)
            first = self.account.batch_came()
            self.reporter.batch_came(self.state.global_step + 1 if first else None)
            yield items
            if mine != self._iterations:
                raise UserError(
                    "an iterator of run.loader was used after a newer iteration of run.loader "
                    "began: iterate the newest one (`for batch in loader:`)"
                )
            if loader.stream and self.account.micro == 0 and not self.account.steps_left():
                return  # a stream has no end of its own: not one item past the run's steps

    def _peek(self, loader: Loader | StreamLoader) -> Iterator[Any]:
        """Batches of ``run.loader`` outside the loop (a look at one, as ``next(iter(loader))``
        takes it from a DataLoader): the ones the run trains next, counted nowhere. A model's
        forward between two of them is a loop of the script's own, refused."""
        if self.order.phase in (Phase.FINISHED, Phase.STOPPED):
            self.order.check(Call.ITERATE)  # the run has ended: refused
        if loader.stream:
            raise UserError(
                f"next(iter(loader)) of a stream (run.loader of a "
                f"{type(loader.dataset).__name__}) outside the loop would move each rank's "
                "position in its stream, which a resume restores; look at a batch inside `for "
                "batch in run.steps(loader, max_steps):` instead"
            )
        s, forwards = self.state, self.reporter.clock.forwards
        loader.sampler.set_epoch(s.epoch, s.sample_in_epoch or 0, self.account.epoch_plan())
        for items in loader.batches(s.epoch):
            yield items
            if self.reporter.clock.forwards != forwards:
                self.order.check(Call.ITERATE)  # a loop outside run.epochs: refused
                raise UserError(
                    "an iterator of run.loader begun outside the loop was used inside it: "
                    "iterate run.loader anew inside `for epoch in run.epochs(n):`"
                )

    # -- state --------------------------------------------------------------------------------
    def restore(
        self,
        model: torch.nn.Module | None = None,
        optimizer: object | None = None,
        **states: object,
    ) -> bool:
        """Register what every checkpoint holds: ``model`` (``model.pt``, a plain state_dict),
        ``optimizer`` and ``states`` (each by its name in ``train_state.pt``; None is skipped),
        beside the run's counters and every rank's random streams; then restore the newest
        committed checkpoint that verifies. True when resumed."""
        self.order.check(Call.RESTORE)
        if model is None:
            raise UserError(
                "run.restore(...) needs the model: run.restore(model=model, optimizer=optimizer)"
            )
        try:
            module = self.unwrap(model)
        except UserError as exc:
            raise UserError(f"run.restore(model=...): {exc}") from None
        kept: dict[str, Stateful] = {}
        streams: dict[str, registered.Stream] = {}
        for name, obj in (("optimizer", optimizer), *states.items()):
            if obj is None:
                continue
            registered.check_name(name)
            if isinstance(obj, torch.nn.Module) and self.models.plain(obj) is not None:
                obj = self.models.plain(obj)  # a second model set up: its plain state_dict
            stream = registered.stream(obj)
            if stream is not None:
                streams[name] = stream
            else:
                kept[name] = registered.stateful(name, obj)
        self.order.enter(Call.RESTORE)
        if self.scaler.is_enabled() and all(o is not self.scaler for o in kept.values()):
            kept[registered.AMP_SCALER] = self.scaler
        kept["train"] = self.state
        loader = self._loader
        if loader is not None and loader.stream:  # each rank's place in its stream
            streams[POSITION] = (loader.position, loader.go_to)
        for name, (get, put) in streams.items():
            rng.track(name, get, put)
        self.saves.streams = list(streams)
        self.startup.mark(MODEL)
        t0 = time.monotonic()
        resumed = self.saves.register(
            module, kept, self.steps_per_epoch, loader.data if loader is not None else None
        )
        if resumed and loader is not None and loader.stream and loader.resumed_at is None:
            raise UserError(self._stream_moved())
        self.startup.mark(RESTORE)
        self.reporter.timeline.restored(
            self.state.global_step, time.monotonic() - t0, self.checkpointer.restored_from
        )
        if self.rank == 0:
            # What the run continues from; a checkpoint skipped as damaged is not in it.
            rundir.write_ledger(self.paths, self.state.ledger.record_file(self.state.global_step))
        self._forget_mined_rounds()
        self.guard.start(self.state.global_step)
        self._resumed = resumed
        self._restored_rng = capture_rng() if resumed else None
        self.mining.resumed(len(self.state.mining_history))
        return resumed

    def before_commit(self, check: Callable[[str], None]) -> None:
        """``check(event)`` runs (collectively) before each checkpoint commits; raising refuses the
        state."""
        self.saves.before_commit(check)

    def at_finish(self, write: Callable[[], None]) -> None:
        """``write()`` runs (collectively) in ``finish``, after ``model.pt``."""
        self.saves.at_finish.append(write)

    # -- epochs and steps ---------------------------------------------------------------------
    def epochs(self, n: int) -> Iterator[int]:
        """The epochs ``0 .. n-1`` this run has not finished, from where it left off. After the
        body of each (its steps, then the script's eval and mining), :meth:`_end_epoch` commits
        the epoch's checkpoint and asks every rank whether to stop."""
        self.order.check(Call.EPOCHS)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise UserError(f"run.epochs({n!r}): give the number of epochs, an int >= 1")
        if self._loader is not None and self._loader.stream:
            raise UserError(
                f"run.epochs(n) over a stream (run.loader of a "
                f"{type(self._loader.dataset).__name__}, an IterableDataset): a stream has no "
                "epochs the ranks could agree on; iterate it with `for batch in "
                "run.steps(loader, max_steps):`"
            )
        self.order.enter(Call.EPOCHS)
        self._loop_starts(n)
        while self.state.epoch < n:
            self._begin_epoch()
            yield self.state.epoch
            self._end_epoch()  # the epoch's checkpoint; a stop agreed here ends the job
        self.order.enter(Call.LOOP_END)

    def _loop_starts(self, total_epochs: int) -> None:
        if self._restored_rng is not None:
            # At the step boundary the checkpoint holds: what the script drew or seeded since
            # run.restore (a seed after it, a look at a batch) does not move the resumed streams.
            restore_rng(self._restored_rng)
        self.total_epochs = total_epochs
        assert self.checkpointer is not None
        self.checkpointer.total_epochs = total_epochs
        self._plan_epoch()
        self.reporter.loop_starts(self._purge_step())  # the first step this attempt logs

    def _plan_epoch(self) -> None:
        self.account.plan_epoch()
        if self.checkpointer is not None:
            self.checkpointer.steps_per_epoch = self.account.steps_per_epoch

    def _purge_step(self) -> int:
        """The resumed step itself is logged again only when its end-of-epoch work is redone."""
        s = self.state
        at_end = self._resumed and self.plan is not None
        return s.global_step if at_end and self.account.last_step() else s.global_step + 1

    def _begin_epoch(self) -> None:
        self.order.enter(Call.EPOCH_BEGIN)
        self._plan_epoch()
        loader = self._loader
        if loader is not None and loader.set_epoch is not None:
            loader.set_epoch(self.state.epoch)
        self.account.epoch_begins()
        self.phases.step = self.state.global_step
        self.phases.set(phases.TRAIN)
        self.reporter.clock.reset()
        if self.account.steps_left() == 0:  # resumed after the epoch's last step, before its end
            self.saves.steps_done_rng = capture_rng()
            reason = self.stop.agree()
            if reason:
                self.saves.stop(reason)

    def _end_epoch(self) -> None:
        """The end of an epoch, after the loop's own end-of-epoch work: its checkpoint committed,
        the mined rounds' files let go, and the ranks' agreement on a stop."""
        self.order.enter(Call.EPOCH_END)
        left = self.account.steps_left()
        if left:
            raise UserError(
                f"epoch {self.state.epoch + 1} ended with {left} of its {self.steps_per_epoch} "
                "steps untrained (the loop over run.loader stopped early), so this epoch would "
                "not train each sample once; to end the run early, leave the epochs loop too "
                "and call run.finish()"
            )
        self.mining.epoch_ended(self.mining_due())
        self.state.epoch_done()
        self.saves.save(checkpointer.EPOCH_END)
        self._forget_mined_rounds()
        reason = self.stop.agree()
        if reason:
            self.saves.stop_at_epoch_end(reason)

    def step(
        self,
        loss: torch.Tensor | float | None = None,
        metrics: Mapping[str, torch.Tensor | float] | None = None,
    ) -> None:
        """After each optimizer step: count it (and its samples, in the ledger), log ``loss`` and
        ``metrics`` at the log cadence (kept on the device until then), save when a checkpoint is
        due; when every rank agreed to stop, save, end the job and raise :class:`RunStopped`."""
        self.order.enter(Call.STEP)
        self._fresh = None
        if loss is not None:
            self.guard.observe(loss if torch.is_tensor(loss) else torch.tensor(float(loss)))
        if loss is not None or metrics:
            self.window.add(loss, metrics or {})
        self.window.throughput.add(self.account.count_step(self.attempt))
        s = self.state
        self.reporter.step_counted(s.global_step)
        if self.probe is not None:
            self.probe.stepped(s.global_step, self.window, self.saves)
        if self.reporter.log_due(s.global_step, s.step_in_epoch, self.steps_per_epoch):
            self._log_interval()
            self.window.clear()
        # The goodput record of where the attempt got (a clock read; a write at most every
        # second): a kill loses no more of it, whatever the log cadence.
        self.reporter.timeline.progress(s.global_step)
        reason = self.stop.poll()  # the answer of the previous step's reduce: no wait
        last = self.account.last_step()
        if reason and last and not self.stop_before_epoch_end:
            reason = ""  # the epoch's end stops: its flag stays set until then
        if not reason:
            loop_end = last and not self.stop_before_epoch_end
            loop_end = loop_end and self.mining.keeps_loop_end(self.mining_due())
            self.saves.save(checkpointer.LOOP_END if loop_end else checkpointer.STEP)
            if last:
                # A round cut short is redone from here, the loop's eval included.
                self.saves.steps_done_rng = capture_rng()
                if self.stop_before_epoch_end:
                    # After the last step, the reduce in flight is read at once (blocking costs
                    # nothing here): a signal during the last step stops before the
                    # end-of-epoch work, not after it.
                    reason = self.stop.agree()
        if reason:
            self.saves.stop(reason)
        if self.probe is not None and self.probe.halt_due(s.global_step):
            self.probe.halt(s.global_step, self.saves)

    def _log_interval(self) -> None:
        rep = self.window.throughput.report()
        # One collective for the finite check, the means and the throughput (a sum: the mean
        # times the world size).
        reduced = self.guard.check(
            self.state.global_step,
            means={**self.window.means(), "rate": rep["samples_per_s_rank"]},
        )
        optimizers = self.saves.optimizers
        lr = optimizers[0].param_groups[0]["lr"] if optimizers else None
        self.reporter.interval(reduced, rep["samples_per_s_rank"], rep["step_time_s"], lr)

    @overload
    def steps(self, loader: int, max_steps: None = None) -> Iterator[int]: ...

    @overload
    def steps(self, loader: Loader | StreamLoader, max_steps: int) -> Iterator[Any]: ...

    def steps(
        self, loader: Loader | StreamLoader | int, max_steps: int | None = None
    ) -> Iterator[Any]:
        """``run.steps(loader, max_steps)``: ``loader``'s batches until the run has taken
        ``max_steps`` optimizer steps in all, across epoch boundaries, from where it left off;
        ``run.step`` after each optimizer step, as in ``run.epochs``. Each epoch's end, when the
        loop reaches it, and the loop's end at an epoch's last step, run :meth:`_end_epoch`
        (the epoch's checkpoint, the ranks' agreement on a stop); ``run.finish`` saves a loop
        that ends in mid-epoch.

        ``run.steps(max_steps)``, without a loader (a script that draws its own batches): the
        step about to be taken (0-based, ``run.global_step``) until the run has taken
        ``max_steps``; ``run.step`` once in each iteration. Its unit is the step: checkpoints
        every ``checkpoint.every_steps``, the ledger records the steps each attempt trained, and
        a resume continues at the step reached with every rank's random streams."""
        self.order.check(Call.STEPS)
        if max_steps is None and isinstance(loader, int) and not isinstance(loader, bool):
            if loader < 1:
                raise UserError(
                    f"run.steps({loader!r}): give the optimizer steps of the whole run, an int >= 1"
                )
            return self._counted(loader)
        if _count(loader) or loader is None or loader is not self._loader:
            given = repr(loader) if isinstance(loader, int) else type(loader).__name__
            raise UserError(
                f"run.steps({given}, ...): give the loader that run.loader returned (the epoch "
                "plan's) and the run's optimizer steps, run.steps(loader, max_steps), or only "
                "the steps of a loop without a loader, run.steps(max_steps)"
            )
        if not _count(max_steps):
            raise UserError(
                f"run.steps(loader, {max_steps!r}): give the optimizer steps of the whole run, "
                "an int >= 1"
            )
        return self._steps_of(loader, max_steps)  # type: ignore[arg-type]

    def _steps_of(self, loader: Loader | StreamLoader, max_steps: int) -> Iterator[Any]:
        self.order.enter(Call.STEPS)
        self._counts_steps = True
        if max_steps < self.state.global_step and self.rank == 0:
            log.warning(
                "run.steps(loader, %d): the run has taken %d steps already, more than max_steps, "
                "so this loop trains none and run.finish() ends the run at step %d; to train "
                "%d steps, start a new run.dir",
                max_steps,
                self.state.global_step,
                self.state.global_step,
                max_steps,
            )
        if loader.stream:  # one epoch of the run's steps, in the stream's order
            loader.n = max(max_steps, self.state.global_step) * loader.global_batch_size
        self._plan_epoch()
        self._loop_starts(self.account.epochs_for(max_steps))
        while self.state.global_step < max_steps:
            self._begin_epoch()
            for items in loader:
                yield items
                if self.state.global_step >= max_steps:
                    break
            if self.account.steps_left() == 0:
                self._end_epoch()  # the epoch's checkpoint; a stop agreed here ends the job
        self.order.enter(Call.LOOP_END)

    def _counted(self, max_steps: int) -> Iterator[int]:
        """``run.steps(max_steps)``: a loop without a loader, one epoch of the run's steps."""
        if self._loader is not None:
            raise UserError(
                f"run.steps({max_steps}) came with a run.loader made: a loop over it takes the "
                f"loader, run.steps(loader, {max_steps}); run.steps({max_steps}) alone is for a "
                "script that draws its own batches (no run.loader)"
            )
        return self._count_steps(max_steps)

    def _count_steps(self, max_steps: int) -> Iterator[int]:
        self.order.enter(Call.STEPS)
        self._counts_steps = True
        self.account.count_to(max_steps)
        if self.checkpointer is not None:
            self.checkpointer.steps_per_epoch = self.account.steps_per_epoch
            self.checkpointer.max_steps = max_steps
        self._loop_starts(1)
        self._begin_epoch()
        while self.state.global_step < max_steps:
            self.order.enter(Call.COUNTED_STEP)
            self.reporter.batch_came(self.state.global_step + 1)
            yield self.state.global_step
        self.order.enter(Call.LOOP_END)

    # -- helpers of the loop ------------------------------------------------------------------
    def accumulate(
        self, model: torch.nn.Module, last: bool | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Around each micro-batch's forward and backward: ``model``'s gradients are
        synchronized across ranks only on the last micro-batch of an optimizer step, once per
        step (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``). Which micro-batch is
        the last: ``run.loader(..., accumulate=k)`` counts them; a loop of
        ``run.steps(max_steps)``, whose script draws its own micro-batches, says it with
        ``last``."""
        counted = self.account.max_steps is not None
        if counted and last is None:
            raise UserError(
                "run.accumulate(model) in run.steps(max_steps) has no loader to count the "
                "micro-batches of a step: say which is the last, run.accumulate(model, "
                "last=micro == accumulation_steps - 1)"
            )
        if not counted and last is not None:
            raise UserError(
                f"run.accumulate(model, last={last!r}): run.loader(..., accumulate=k) counts the "
                "micro-batches of a step; leave last= out"
            )
        sync = last if last is not None else self.order.phase is not Phase.MICRO
        return parallel.gradient_sync(self.models.wrapper(model), sync)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Around a forward and its loss: ``train.amp``'s precision on the run's device (``auto``:
        bf16 on a GPU, nothing on a CPU; ``none``: nothing). With fp16, step the optimizer
        through ``run.scaler``."""
        return self.precision.autocast()

    @property
    def is_main(self) -> bool:
        """True on rank 0 (and in a process alone)."""
        return self.rank == 0

    def print(self, *args: object, sep: str = " ", end: str = "\n") -> None:
        """``print`` on rank 0 only, flushed (the rank's log shows it at once)."""
        if self.rank == 0:
            print(*args, sep=sep, end=end, flush=True)

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (a download, a cache it writes); the other ranks wait for
        it, then run it (reading what rank 0 wrote)."""
        if self.rank != 0:
            dist.barrier()
        yield
        if self.rank == 0:
            dist.barrier()

    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """A copy of ``tensor`` reduced over every rank: ``op`` "mean", "sum", "max" or "min"."""
        return dist.reduce(tensor, op)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along the first dimension in rank order, on every
        rank; the first dimensions may differ (an evaluation's last, smaller batch)."""
        return dist.gather(tensor)

    # -- mining -------------------------------------------------------------------------------
    def mining_due(self, can_embed: bool = True) -> bool:
        """Whether this epoch's end runs a mining round (``mining.*``; never in ``run.steps``)."""
        if self._counts_steps:
            return False
        return self.mining.due(self.state.epoch + 1, self.total_epochs, can_embed)

    def mine(
        self,
        embed: Callable[[Any], torch.Tensor] | Task,
        dataset: Dataset | None = None,
        ground_truth: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """The mining stage, when due after this epoch (``mining.*``): ``embed(batch)`` on every
        rank's shard of ``dataset`` (default: the loader's; a batch as its DataLoader yields
        it, on the device, in eval mode without gradients), the k-NN graph and clusters on rank 0,
        the labels on every rank. Returns the labels (int64, -1 for none) or None when no round is
        due; ``run.labels`` keeps the last round's. A stop during the round saves and ends the
        job (:class:`RunStopped`); the next attempt continues the round."""
        if self._counts_steps and self.order.phase not in (Phase.FINISHED, Phase.STOPPED):
            raise UserError(
                "run.mine(...) came inside run.steps(...), which has no place "
                "between epochs: mine in `for epoch in run.epochs(n):` after the loop over "
                "run.loader"
            )
        self.order.enter(Call.MINE)
        left = self.account.steps_left()
        if left:
            raise UserError(
                f"run.mine(...) came before the end of epoch {self.state.epoch + 1}'s steps "
                f"({left} left): call it after the loop over run.loader"
            )
        finished = self.state.epoch + 1
        data = dataset if dataset is not None else getattr(self._loader, "dataset", None)
        source = self.mining.source(embed, data, ground_truth, finished)
        if not self.mining.due(finished, self.total_epochs, source.can_embed):
            return None
        module = self.saves.module
        assert module is not None
        with parallel.gathered(module):
            result = self.mining.run(source, module, finished)
        if result is None:
            reason = self.stop.agree() or StopReason.PREEMPTED
            self.saves.stop_in_round(reason, finished, self.stop_before_epoch_end)
        self.state.labels = result.labels
        self.state.mining_history.append(result.stats)
        self.mining.report(
            result.stats,
            self.state.labels,
            self.state.mining_history,
            self.reporter,
            self.state.global_step,
        )
        return result.labels

    def _forget_mined_rounds(self) -> None:
        """Delete the files of the mining rounds whose labels a committed checkpoint holds."""
        if self.rank == 0 and self.checkpointer is not None:
            self.mining.forget(self.checkpointer.committed_epoch())

    # -- the end ------------------------------------------------------------------------------
    def finish(self) -> str:
        """The end of the run: the last state committed (saved now if the loop left before an
        epoch's end), ``RUN_DIR/model.pt`` written (the whole model, gathered under fsdp), the
        loader's workers stopped, the job ended. Returns the job's outcome (``completed``)."""
        self.order.enter(Call.FINISH)
        self.reporter.report(running=True)
        self.saves.finish()
        outcome, _ = self.saves.end(State.COMPLETED)  # the loader's workers stopped there
        return outcome

    def _stop_loader(self) -> None:
        if self._loader is not None:
            self._loader.shutdown()

    def close(self, outcome: str) -> None:
        """At the end of the attempt, whatever the reason: the profile, the attempt's timeline,
        the metrics and trackers, the write in flight."""
        self.saves.close(outcome)

    # -- reporting ----------------------------------------------------------------------------
    def log(self, scalars: Mapping[str, float]) -> None:
        """Scalars at the current global step: TensorBoard, metrics.jsonl, the trackers (rank 0),
        and ``checkpoint.keep_best``'s metric. The loop's loss is logged by ``step``."""
        self.reporter.log(scalars)

    def report(self, fsync: bool = True, running: bool = False, **fields: object) -> None:
        """Rank 0: the progress into status.json, with ``fields``; ``running`` says the attempt
        goes on (a transition: refused after another writer ended the run)."""
        self.reporter.report(fsync=fsync, running=running, **fields)

    def _progress(self) -> dict[str, int]:
        s = self.state
        counted = self.account.max_steps
        return {
            "epoch": s.epoch,
            "epochs": self.total_epochs,  # the loop's: run.epochs(n), or those run.steps reaches
            "global_step": s.global_step,
            "step_in_epoch": s.step_in_epoch,
            "steps_per_epoch": self.steps_per_epoch,
            **({"max_steps": counted} if counted is not None else {}),
        }

    def _note(self, scalars: Mapping[str, float]) -> None:
        if self.checkpointer is not None:
            self.checkpointer.note(scalars)

    def _stream_moved(self) -> str:
        manifest = self.checkpointer.store.manifest(self.state.global_step) or {}  # type: ignore[union-attr]
        return (
            f"run.loader({type(self._loader.dataset).__name__}): the checkpoint of step "  # type: ignore[union-attr]
            f"{self.state.global_step} holds each rank's position in its stream for "
            f"{manifest.get('world_size', 'another number of')} ranks, and this attempt runs "
            f"{self.world_size}: a stream's position belongs to the rank that read it; resume "
            "on the world size it was written with, or start a new run.dir"
        )

    def _facts(self) -> dict[str, object]:
        """What a refused call's message names."""
        return {
            "step": self.state.global_step + 1,
            "micro": self.account.micro,
            "accumulate": self._loader.accumulate if self._loader is not None else 1,
            "epoch": self.state.epoch + 1,
            "left": self.account.steps_left(),
            "counted": self.account.max_steps is not None,
        }


def _cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _count(value: object) -> bool:
    """An int >= 1 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


__all__ = ["Amp", "Ending", "Run", "RunStopped"]
