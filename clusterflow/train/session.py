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
work to the part that owns it. Its public names are the library API and nothing else; the task
trainer and the job take what they need beyond it from :class:`RunInternals`, a view of the run.

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
from clusterflow.checkpoint import checkpointer, registered
from clusterflow.checkpoint.checkpointer import Checkpointer, Stateful
from clusterflow.checkpoint.rng import RngState, capture_rng, restore_rng
from clusterflow.checkpoint.train_state import TrainState
from clusterflow.distributed import comm as dist
from clusterflow.distributed.sampler import LOADER_BATCH, TASK_BATCH, Batching
from clusterflow.errors import UserError
from clusterflow.mining.adapter import LoopMining
from clusterflow.observe import phases
from clusterflow.observe.context import JobContext
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
    or script, for messages.

    Its public names are the library API of docs/own-loop.md and nothing else; what
    clusterflow's own code needs beyond it (the task trainer, the job) is :class:`RunInternals`.
    """

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
        self._config, self._paths, self.device, self._attempt = cfg, paths, device, attempt
        self.rank, self.world_size = dist.rank(), dist.world()
        self.run_dir = paths.root
        self._amp, self._what = amp, what
        self._own_loop = bool(cfg.script.path)
        # What the messages about the batch name: a script's run.loader argument, or the task's
        # config key.
        self._batch_key = LOADER_BATCH if self._own_loop else TASK_BATCH
        self._phases = ctx.phases
        # Where the start-up went, marked up to the first step (the attempt marked its part).
        self._startup = startup or Startup(process_started_at())
        self._state = TrainState()
        self._window = LossWindow()
        self._stop = StopAgreement(preemption, cfg.dist.timeout_s, interval_s=AGREE_EVERY_S)
        self._guard = FiniteGuard(device, cfg.train, self._committed_steps, own_loop=self._own_loop)
        self._order = CallOrder(self._facts)
        self._account = Accounting(self._state, self.rank, self.world_size)
        self._reporter = Reporter(
            ctx,
            self._startup,
            progress=self._progress,
            note=self._note,
            cuda=_cuda(device),
        )
        self._saves = Saves(
            ctx,
            self._state,
            stop=self._stop,
            ending=ending,
            reporter=self._reporter,
            guard=self._guard,
            order=self._order,
        )
        self._mining = LoopMining(ctx, device, amp, self._stop)
        # clusterflow check's records and halt, in its runs only (train/probe.py).
        self._probe = Probe.of(paths, self.rank, self.world_size, attempt)
        self._total_epochs = 0
        # The global random streams: the script's own seeds kept (train/seeds.py).
        self._seeds = seeds or GlobalSeeds(cfg.run.seed, script=False)
        self._models = Models(cfg, device, amp, self._seeds.at_setup)
        # run.autocast's precision and run.scaler, the GradScaler fp16 needs (a no-op otherwise):
        # the only ones of the run, which the task trainer uses too; saved with every checkpoint
        # when it scales.
        self._precision = builders.Precision(cfg.train.amp, device)
        self.scaler = self._precision.scaler
        self._counts_steps = False  # the loop is run.steps (no epochs of the script's own)
        self._loader: Loader | None = None
        # A stop leaves the loop with the loader's iterator held: its workers are stopped at the
        # attempt's end, whatever the reason, or the interpreter's exit waits for them forever.
        self._saves.at_close.append(self._stop_loader)
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
        self._stop_before_epoch_end = False

    # -- what the loop reads ------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """Epochs finished."""
        return self._state.epoch

    @property
    def global_step(self) -> int:
        """Optimizer steps done in all (this run's, across its attempts)."""
        return self._state.global_step

    @property
    def labels(self) -> np.ndarray | None:
        """The last mining round's labels by sample index (restored on resume), or None."""
        return self._state.labels

    @property
    def _steps_per_epoch(self) -> int:
        return self._account.steps_per_epoch

    @property
    def _checkpointer(self) -> Checkpointer | None:
        return self._saves.checkpointer

    def _committed_steps(self) -> list[int]:
        return self._saves.committed_steps()

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
        self._order.enter(Call.SETUP)
        clock = self._reporter.clock
        mark = ForwardMark(clock) if self._probe is None else self._probe.mark(clock)
        wrapped = self._models.setup(model, optimizer, shard_units, mark)
        if self._own_loop:  # the script's code up to here built its model
            self._startup.mark(MODEL)
        return wrapped if optimizer is None else (wrapped, optimizer)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The plain module ``run.setup`` took (or returned) ``model`` for: what an embedding
        for ``run.mine`` calls (a DDP wrapper's forward is collective, and ranks embed different
        numbers of batches). UserError for a model not set up."""
        return self._models.unwrap(model)

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
        if self._loader is not None and self._order.allows(Call.LOADER):
            raise UserError(
                "run.loader was called twice: the epoch plan drives one training loader; build "
                "evaluation loaders with torch.utils.data.DataLoader"
            )
        self._order.enter(Call.LOADER)
        kwargs = dict(dataloader_kwargs)
        check_arguments(dataset, accumulate, kwargs)
        stream = isinstance(dataset, IterableDataset)
        total, key = step_samples(
            sys.maxsize if stream else len(dataset),  # type: ignore[arg-type]
            batch_size,
            global_batch_size,
            accumulate,
            self.world_size,
            what=self._what or "the dataset",
            key=self._batch_key,
        )
        batching = Batching(total, accumulate, self.rank, self.world_size, self._config.run.seed)
        if stream:
            self._loader = StreamLoader(
                dataset,  # type: ignore[arg-type]
                batching,
                self._attempt,
                kwargs=kwargs,
                iterate=self._iterate,
            )
            self._account.counts_batches_of(self._loader)
            return self._loader
        self._loader = Loader(
            dataset,
            batching,
            key,
            set_epoch=set_epoch if set_epoch is not None else getattr(dataset, "set_epoch", None),
            kwargs=kwargs,
            iterate=self._iterate,
            left=self._account.batches_left,
        )
        self._account.counts_batches_of(self._loader)
        if self._own_loop:  # the script's code since its last call built its data
            self._startup.mark(TASK_DATA)
        return self._loader

    def _iterate(self, loader: Loader | StreamLoader) -> Iterator[Any]:
        """This epoch's batches from the position reached; counts what each step takes. Outside
        an epoch: a look at the batches (:meth:`_peek`). A new iteration after batches that no
        ``run.step`` counted and no model saw (``next(iter(loader))`` at an epoch's start, as a
        DataLoader allows) fetches them again, on the random streams as they were."""
        if not self._order.in_epoch:
            yield from self._peek(loader)
            return
        fresh = self._fresh
        if self._order.mid_step and fresh is not None and fresh[1] == self._reporter.clock.forwards:
            self._order.enter(Call.RETAKE)
            self._account.retake()
            restore_rng(fresh[0])
        self._order.enter(Call.ITERATE)
        self._iterations += 1
        mine = self._iterations
        # Until its first step is counted, this iteration's batches may be fetched again.
        self._fresh = None if loader.stream else (capture_rng(), self._reporter.clock.forwards)
        self._account.batches_begin(loader)
        batches = loader.batches(self._state.epoch)
        k = 0  # micro-batches asked for in this iteration
        while True:
            self._reporter.batch_asked(
                self._state.global_step + 1,
                self._state.epoch,
                self._account.micro,
                None if loader.stream else loader.sampler.slice_at(k),
            )
            k += 1
            asked = self._reporter.clock.asking(first_of_step=self._account.micro == 0)
            try:
                items = next(batches)
            except StopIteration:
                break
            self._reporter.clock.came(asked)
            self._order.enter(Call.LAST_BATCH if self._account.is_last_micro() else Call.BATCH)
            first = self._account.batch_came()
            self._reporter.batch_came(self._state.global_step + 1 if first else None)
            yield items
            if mine != self._iterations:
                raise UserError(
                    "an iterator of run.loader was used after a newer iteration of run.loader "
                    "began: iterate the newest one (`for batch in loader:`)"
                )
            if loader.stream and self._account.micro == 0 and not self._account.steps_left():
                return  # a stream has no end of its own: not one item past the run's steps

    def _peek(self, loader: Loader | StreamLoader) -> Iterator[Any]:
        """Batches of ``run.loader`` outside the loop (a look at one, as ``next(iter(loader))``
        takes it from a DataLoader): the ones the run trains next, counted nowhere. A model's
        forward between two of them is a loop of the script's own, refused."""
        if self._order.phase in (Phase.FINISHED, Phase.STOPPED):
            self._order.check(Call.ITERATE)  # the run has ended: refused
        if loader.stream:
            raise UserError(
                f"next(iter(loader)) of a stream (run.loader of a "
                f"{type(loader.dataset).__name__}) outside the loop would move each rank's "
                "position in its stream, which a resume restores; look at a batch inside `for "
                "batch in run.steps(loader, max_steps):` instead"
            )
        s, forwards = self._state, self._reporter.clock.forwards
        loader.sampler.set_epoch(s.epoch, s.sample_in_epoch or 0, self._account.epoch_plan())
        for items in loader.batches(s.epoch):
            yield items
            if self._reporter.clock.forwards != forwards:
                self._order.check(Call.ITERATE)  # a loop outside run.epochs: refused
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
        self._order.check(Call.RESTORE)
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
            if isinstance(obj, torch.nn.Module) and self._models.plain(obj) is not None:
                obj = self._models.plain(obj)  # a second model set up: its plain state_dict
            stream = registered.stream(obj)
            if stream is not None:
                streams[name] = stream
            else:
                kept[name] = registered.stateful(name, obj)
        self._order.enter(Call.RESTORE)
        if self.scaler.is_enabled() and all(o is not self.scaler for o in kept.values()):
            kept[registered.AMP_SCALER] = self.scaler
        loader = self._loader
        if loader is not None and loader.stream:  # each rank's place in its stream
            streams[POSITION] = (loader.position, loader.go_to)
        self._saves.track(streams)
        self._startup.mark(MODEL)
        t0 = time.monotonic()
        resumed = self._saves.register(
            module, kept, self._steps_per_epoch, loader.data if loader is not None else None
        )
        if resumed and loader is not None and loader.stream and loader.resumed_at is None:
            raise UserError(self._stream_moved())
        self._startup.mark(RESTORE)
        self._reporter.timeline.restored(
            self._state.global_step, time.monotonic() - t0, self._checkpointer.restored_from
        )
        if self.rank == 0:
            # What the run continues from; a checkpoint skipped as damaged is not in it.
            ledger = self._state.ledger.record_file(self._state.global_step)
            rundir.write_ledger(self._paths, ledger)
        self._forget_mined_rounds()
        self._guard.start(self._state.global_step)
        self._resumed = resumed
        self._restored_rng = capture_rng() if resumed else None
        self._mining.resumed(len(self._state.mining_history))
        return resumed

    # -- epochs and steps ---------------------------------------------------------------------
    def epochs(self, n: int) -> Iterator[int]:
        """The epochs ``0 .. n-1`` this run has not finished, from where it left off. After the
        body of each (its steps, then the script's eval and mining), :meth:`_end_epoch` commits
        the epoch's checkpoint and asks every rank whether to stop."""
        self._order.check(Call.EPOCHS)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise UserError(f"run.epochs({n!r}): give the number of epochs, an int >= 1")
        if self._loader is not None and self._loader.stream:
            raise UserError(
                f"run.epochs(n) over a stream (run.loader of a "
                f"{type(self._loader.dataset).__name__}, an IterableDataset): a stream has no "
                "epochs the ranks could agree on; iterate it with `for batch in "
                "run.steps(loader, max_steps):`"
            )
        self._order.enter(Call.EPOCHS)
        self._loop_starts(n)
        while self._state.epoch < n:
            self._begin_epoch()
            yield self._state.epoch
            self._end_epoch()  # the epoch's checkpoint; a stop agreed here ends the job
        self._order.enter(Call.LOOP_END)

    def _loop_starts(self, total_epochs: int) -> None:
        if self._restored_rng is not None:
            # At the step boundary the checkpoint holds: what the script drew or seeded since
            # run.restore (a seed after it, a look at a batch) does not move the resumed streams.
            restore_rng(self._restored_rng)
        self._total_epochs = total_epochs
        assert self._checkpointer is not None
        self._checkpointer.loop_starts(total_epochs)
        self._plan_epoch()
        self._reporter.loop_starts(self._purge_step())  # the first step this attempt logs

    def _plan_epoch(self) -> None:
        self._account.plan_epoch()
        if self._checkpointer is not None:
            self._checkpointer.epoch_planned(self._account.steps_per_epoch)

    def _purge_step(self) -> int:
        """The resumed step itself is logged again only when its end-of-epoch work is redone."""
        s = self._state
        at_end = self._resumed and self._account.plan is not None
        return s.global_step if at_end and self._account.last_step() else s.global_step + 1

    def _begin_epoch(self) -> None:
        self._order.enter(Call.EPOCH_BEGIN)
        self._plan_epoch()
        loader = self._loader
        if loader is not None and loader.set_epoch is not None:
            loader.set_epoch(self._state.epoch)
        self._account.epoch_begins()
        self._phases.step = self._state.global_step
        self._phases.set(phases.TRAIN)
        self._reporter.clock.reset()
        if self._account.steps_left() == 0:  # resumed after the epoch's last step, before its end
            self._saves.steps_done()
            reason = self._stop.agree()
            if reason:
                self._saves.stop(reason)

    def _end_epoch(self) -> None:
        """The end of an epoch, after the loop's own end-of-epoch work: its checkpoint committed,
        the mined rounds' files let go, and the ranks' agreement on a stop."""
        self._order.enter(Call.EPOCH_END)
        left = self._account.steps_left()
        if left:
            raise UserError(
                f"epoch {self._state.epoch + 1} ended with {left} of its {self._steps_per_epoch} "
                "steps untrained (the loop over run.loader stopped early), so this epoch would "
                "not train each sample once; to end the run early, leave the epochs loop too "
                "and call run.finish()"
            )
        self._mining.epoch_ended(self._mining_due())
        self._state.epoch_done()
        self._saves.save(checkpointer.EPOCH_END)
        self._forget_mined_rounds()
        reason = self._stop.agree()
        if reason:
            self._saves.stop_at_epoch_end(reason)

    def step(
        self,
        loss: torch.Tensor | float | None = None,
        metrics: Mapping[str, torch.Tensor | float] | None = None,
    ) -> None:
        """After each optimizer step: count it (and its samples, in the ledger), log ``loss`` and
        ``metrics`` at the log cadence (kept on the device until then), save when a checkpoint is
        due; when every rank agreed to stop, save, end the job and raise :class:`RunStopped`."""
        self._order.enter(Call.STEP)
        self._fresh = None
        if loss is not None:
            self._guard.observe(loss if torch.is_tensor(loss) else torch.tensor(float(loss)))
        if loss is not None or metrics:
            self._window.add(loss, metrics or {})
        self._window.throughput.add(self._account.count_step(self._attempt))
        s = self._state
        self._reporter.step_counted(s.global_step)
        if self._probe is not None:
            self._probe.stepped(s.global_step, self._window, self._saves)
        if self._reporter.log_due(s.global_step, s.step_in_epoch, self._steps_per_epoch):
            self._log_interval()
            self._window.clear()
        # The goodput record of where the attempt got (a clock read; a write at most every
        # second): a kill loses no more of it, whatever the log cadence.
        self._reporter.timeline.progress(s.global_step)
        reason = self._stop.poll()  # the answer of the previous step's reduce: no wait
        last = self._account.last_step()
        if reason and last and not self._stop_before_epoch_end:
            reason = ""  # the epoch's end stops: its flag stays set until then
        if not reason:
            loop_end = last and not self._stop_before_epoch_end
            loop_end = loop_end and self._mining.keeps_loop_end(self._mining_due())
            self._saves.save(checkpointer.LOOP_END if loop_end else checkpointer.STEP)
            if last:
                # A round cut short is redone from here, the loop's eval included.
                self._saves.steps_done()
                if self._stop_before_epoch_end:
                    # After the last step, the reduce in flight is read at once (blocking costs
                    # nothing here): a signal during the last step stops before the
                    # end-of-epoch work, not after it.
                    reason = self._stop.agree()
        if reason:
            self._saves.stop(reason)
        if self._probe is not None and self._probe.halt_due(s.global_step):
            self._probe.halt(s.global_step, self._saves)

    def _log_interval(self) -> None:
        rep = self._window.throughput.report()
        # One collective for the finite check, the means and the throughput (a sum: the mean
        # times the world size).
        reduced = self._guard.check(
            self._state.global_step,
            means={**self._window.means(), "rate": rep["samples_per_s_rank"]},
        )
        optimizers = self._saves.optimizers
        lr = optimizers[0].param_groups[0]["lr"] if optimizers else None
        self._reporter.interval(reduced, rep["samples_per_s_rank"], rep["step_time_s"], lr)

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
        self._order.check(Call.STEPS)
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
        self._order.enter(Call.STEPS)
        self._counts_steps = True
        if max_steps < self._state.global_step and self.rank == 0:
            log.warning(
                "run.steps(loader, %d): the run has taken %d steps already, more than max_steps, "
                "so this loop trains none and run.finish() ends the run at step %d; to train "
                "%d steps, start a new run.dir",
                max_steps,
                self._state.global_step,
                self._state.global_step,
                max_steps,
            )
        if loader.stream:  # one epoch of the run's steps, in the stream's order
            loader.n = max(max_steps, self._state.global_step) * loader.global_batch_size
        self._plan_epoch()
        self._loop_starts(self._account.epochs_for(max_steps))
        while self._state.global_step < max_steps:
            self._begin_epoch()
            for items in loader:
                yield items
                if self._state.global_step >= max_steps:
                    break
            if self._account.steps_left() == 0:
                self._end_epoch()  # the epoch's checkpoint; a stop agreed here ends the job
        self._order.enter(Call.LOOP_END)

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
        self._order.enter(Call.STEPS)
        self._counts_steps = True
        self._account.count_to(max_steps)
        if self._checkpointer is not None:
            self._checkpointer.counts_steps(max_steps)
        self._loop_starts(1)
        self._begin_epoch()
        while self._state.global_step < max_steps:
            self._order.enter(Call.COUNTED_STEP)
            self._reporter.batch_came(self._state.global_step + 1)
            yield self._state.global_step
        self._order.enter(Call.LOOP_END)

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
        counted = self._account.max_steps is not None
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
        sync = last if last is not None else self._order.phase is not Phase.MICRO
        return parallel.gradient_sync(self._models.wrapper(model), sync)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Around a forward and its loss: ``train.amp``'s precision on the run's device (``auto``:
        bf16 on a GPU, nothing on a CPU; ``none``: nothing). With fp16, step the optimizer
        through ``run.scaler``."""
        return self._precision.autocast()

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
    def _mining_due(self, can_embed: bool = True) -> bool:
        """Whether this epoch's end runs a mining round (``mining.*``; never in ``run.steps``)."""
        if self._counts_steps:
            return False
        return self._mining.due(self._state.epoch + 1, self._total_epochs, can_embed)

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
        if self._counts_steps and self._order.phase not in (Phase.FINISHED, Phase.STOPPED):
            raise UserError(
                "run.mine(...) came inside run.steps(...), which has no place "
                "between epochs: mine in `for epoch in run.epochs(n):` after the loop over "
                "run.loader"
            )
        self._order.enter(Call.MINE)
        left = self._account.steps_left()
        if left:
            raise UserError(
                f"run.mine(...) came before the end of epoch {self._state.epoch + 1}'s steps "
                f"({left} left): call it after the loop over run.loader"
            )
        finished = self._state.epoch + 1
        data = dataset if dataset is not None else getattr(self._loader, "dataset", None)
        source = self._mining.source(embed, data, ground_truth, finished)
        if not self._mining.due(finished, self._total_epochs, source.can_embed):
            return None
        module = self._saves.module
        assert module is not None
        with parallel.gathered(module):
            result = self._mining.run(source, module, finished)
        if result is None:
            reason = self._stop.agree() or StopReason.PREEMPTED
            self._saves.stop_in_round(reason, finished, self._stop_before_epoch_end)
        self._state.labels = result.labels
        self._state.mining_history.append(result.stats)
        self._mining.report(
            result.stats,
            self._state.labels,
            self._state.mining_history,
            self._reporter,
            self._state.global_step,
        )
        return result.labels

    def _forget_mined_rounds(self) -> None:
        """Delete the files of the mining rounds whose labels a committed checkpoint holds."""
        if self.rank == 0 and self._checkpointer is not None:
            self._mining.forget(self._checkpointer.committed_epoch())

    # -- the end ------------------------------------------------------------------------------
    def finish(self) -> str:
        """The end of the run: the last state committed (saved now if the loop left before an
        epoch's end), ``RUN_DIR/model.pt`` written (the whole model, gathered under fsdp), the
        loader's workers stopped, the job ended. Returns the job's outcome (``completed``)."""
        self._order.enter(Call.FINISH)
        self._reporter.report(running=True)
        self._saves.finish()
        outcome, _ = self._saves.end(State.COMPLETED)  # the loader's workers stopped there
        return outcome

    def _stop_loader(self) -> None:
        if self._loader is not None:
            self._loader.shutdown()

    # -- reporting ----------------------------------------------------------------------------
    def log(self, scalars: Mapping[str, float]) -> None:
        """Scalars at the current global step: TensorBoard, metrics.jsonl, the trackers (rank 0),
        and ``checkpoint.keep_best``'s metric. The loop's loss is logged by ``step``."""
        self._reporter.log(scalars)

    def _progress(self) -> dict[str, int]:
        s = self._state
        counted = self._account.max_steps
        return {
            "epoch": s.epoch,
            "epochs": self._total_epochs,  # the loop's: run.epochs(n), or those run.steps reaches
            "global_step": s.global_step,
            "step_in_epoch": s.step_in_epoch,
            "steps_per_epoch": self._steps_per_epoch,
            **({"max_steps": counted} if counted is not None else {}),
        }

    def _note(self, scalars: Mapping[str, float]) -> None:
        if self._checkpointer is not None:
            self._checkpointer.note(scalars)

    def _stream_moved(self) -> str:
        manifest = self._checkpointer.store.manifest(self._state.global_step) or {}  # type: ignore[union-attr]
        return (
            f"run.loader({type(self._loader.dataset).__name__}): the checkpoint of step "  # type: ignore[union-attr]
            f"{self._state.global_step} holds each rank's position in its stream for "
            f"{manifest.get('world_size', 'another number of')} ranks, and this attempt runs "
            f"{self.world_size}: a stream's position belongs to the rank that read it; resume "
            "on the world size it was written with, or start a new run.dir"
        )

    def _facts(self) -> dict[str, object]:
        """What a refused call's message names."""
        return {
            "step": self._state.global_step + 1,
            "micro": self._account.micro,
            "accumulate": self._loader.accumulate if self._loader is not None else 1,
            "epoch": self._state.epoch + 1,
            "left": self._account.steps_left(),
            "counted": self._account.max_steps is not None,
        }


class RunInternals:
    """What clusterflow's own code takes from a :class:`Run` beyond the library API of
    docs/own-loop.md, which is all a script sees (``tests/test_own_loop.py`` pins ``Run``'s
    public names to that page): the task trainer's loop (``train/trainer.py``: the config, the
    non-finite guard and loss window it feeds, the epoch's accounting, its eval report, what
    ``finish`` writes besides ``model.pt``) and the job's life (``job/attempt.py``,
    ``job/script.py``: the attempt's close, the checkpoint write in flight). A view of the run,
    holding no state of its own: ``Attempt.open_run`` builds the one it hands on."""

    def __init__(self, run: Run) -> None:
        self._run = run
        self.config, self.paths, self.phases = run._config, run._paths, run._phases
        self.state = run._state  # the counters, labels and ledger every checkpoint holds
        self.guard, self.window = run._guard, run._window
        self.precision = run._precision  # its dtype: the evaluation's autocast

    @property
    def global_batch(self) -> tuple[int, int] | None:
        """(first sample, size) of the global batch of the step being taken."""
        return self._run._account.global_batch

    @property
    def steps_per_epoch(self) -> int:
        return self._run._steps_per_epoch

    def samples_trained(self) -> int:
        """Samples of the run's epochs trained, the step being taken included (a learning-rate
        schedule that counts samples reads it between the optimizer step and ``run.step()``)."""
        return self._run._account.samples_trained()

    def mining_due(self, can_embed: bool = True) -> bool:
        """Whether this epoch's end runs a mining round (``mining.*``; never in ``run.steps``)."""
        return self._run._mining_due(can_embed)

    def stop_before_epoch_end(self) -> None:
        """A stop agreed at an epoch's last step saves there, before the loop's end-of-epoch work
        (a task's eval and mining, which a fresh attempt redoes), not at the epoch's end."""
        self._run._stop_before_epoch_end = True

    def at_finish(self, write: Callable[[], None]) -> None:
        """``write()`` runs (collectively) in ``run.finish``, after ``model.pt``."""
        self._run._saves.at_finish.append(write)

    def report(self, **fields: object) -> None:
        """Rank 0: the progress into status.json, with ``fields``."""
        self._run._reporter.report(**fields)

    def close(self, outcome: str) -> None:
        """At the end of the attempt, whatever the reason: the profile, the attempt's timeline,
        the metrics and trackers, the write in flight."""
        self._run._saves.close(outcome)

    def wait_for_write(self) -> None:
        """The checkpoint write in flight, if any, completed (an epoch's end writes in the
        background)."""
        checkpointer = self._run._checkpointer
        if checkpointer is not None:
            checkpointer.wait()


def _cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _count(value: object) -> bool:
    """An int >= 1 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


__all__ = ["Amp", "Ending", "Run", "RunInternals", "RunStopped"]
