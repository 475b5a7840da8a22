"""The training loop of a task (DDP or sharded: ``parallel.py``): what runs on every rank between
rendezvous and exit. It is a user of the library API's :class:`Run` (``session.py``), as a script of
the user's own is (what it needs beyond that API, the run's :class:`RunInternals` gives it): the run
sets the model up, plans the data, restores, counts steps, saves, stops and mines; this module is
the task's loop on top (its model, optimizer, schedule, gradient accumulation, EMA, evaluation), in
the run's precision (``run.autocast``, ``run.scaler``: one GradScaler, stepped here and saved with
every checkpoint).

A fresh start and a resume go through the same code: the run restores the newest committed
checkpoint, if any, and the loop continues from its epoch and the number of samples of that
epoch's order it trained (``distributed/sampler.py``: the same order on any world size). State
lives in the checkpoint only, so a requeued job needs nothing else.

No sample is dropped or repeated: the epoch's last batch also takes the samples left over when
the batch size does not divide the dataset, ranks may then hold one sample more than others, and
each micro-batch's loss is weighted by its share of the step's samples, so that the averaged
gradient is the mean over every sample of the step whichever rank held it (docs/data.md).

Order of an epoch: steps (after each, ``run.step``: the ranks agree on whether to stop, and the
checkpointer saves when due) -> evaluation -> mining (when due) -> the end-of-epoch checkpoint
(``run.epochs``), which holds the new labels. That checkpoint supersedes a stop checkpoint taken
at the same step before the end-of-epoch work, so a resume never repeats a finished round.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from clusterflow.checkpoint.rng import seed_everything
from clusterflow.checkpoint.train_state import TrainState
from clusterflow.distributed import comm as dist
from clusterflow.distributed import sharding
from clusterflow.distributed.sampler import share, split
from clusterflow.observe import phases
from clusterflow.storage import durable
from clusterflow.storage.tensors import TORCH
from clusterflow.tasks import Task
from clusterflow.train import builders, parallel
from clusterflow.train.ema import EMA
from clusterflow.train.evaluate import evaluate
from clusterflow.train.session import Run, RunInternals, RunStopped

log = logging.getLogger("clusterflow.trainer")


def _to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {
        k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()
    }


class Trainer:
    """A task's loop on ``run``, through its library API; ``internals``: what the loop needs of
    the run beyond that API (the config, the guard and loss window it feeds, the step's global
    batch, the eval report, a stop before the end-of-epoch work)."""

    def __init__(self, run: Run, internals: RunInternals, task: Task) -> None:
        self.run, self.internals, self.task = run, internals, task
        cfg = self.cfg = internals.config
        self.device, self.rank, self.world = run.device, run.rank, run.world_size
        seed_everything(cfg.run.seed)  # identical initial weights on every rank
        module = builders.build_model(cfg, task, self.device)
        target = cfg.task.target
        # Distinct per-rank streams from here on (run.setup).
        self.model = run.setup(module, shard_units=lambda m: parallel.shard_units(task, m, target))
        self.module = run.unwrap(self.model)
        self.sharded = sharding.is_fsdp(self.module)
        t, d = cfg.train, cfg.data
        self.opt = builders.build_optimizer(t, self.module, self.world)
        self.ema = EMA(self.module, t.ema_decay) if t.ema_decay else None
        self.dataset = task.train_dataset()
        self.loader = run.loader(
            self.dataset,
            global_batch_size=t.batch_size,
            accumulate=t.grad_accum,
            set_epoch=task.set_epoch,
            num_workers=d.num_workers,
            pin_memory=d.pin_memory and self.device.type == "cuda",
            persistent_workers=d.persistent_workers and d.num_workers > 0,
            prefetch_factor=d.prefetch_factor if d.num_workers else None,
        )
        self.micro_global = t.batch_size // t.grad_accum
        n = len(self.dataset)
        # The schedule's progress counts the samples trained, the step being taken included.
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, builders.lr_schedule(t, n * t.epochs, internals.samples_trained)
        )
        # The run's precision: its autocast around the forward, and its GradScaler, the one
        # stepped here and saved with every checkpoint (registered as "scaler" below).
        self.amp = internals.precision.dtype  # the evaluation's autocast
        self.scaler = run.scaler
        # The labels array that self._labels holds on the device.
        self._labels_of: np.ndarray | None = None
        self._labels: torch.Tensor | None = None
        if self.ema is not None:
            internals.at_finish(self._write_ema)
        # A stop at an epoch's last step saves before the eval and mining, which a resume redoes.
        internals.stop_before_epoch_end()

    @property
    def phases(self) -> phases.Phases:
        return self.internals.phases

    @property
    def state(self) -> TrainState:
        return self.internals.state

    # -- the loop -----------------------------------------------------------------------------
    def fit(self) -> str:
        """Train to the end or until a signal or a cancel. Returns the job's outcome: "completed",
        or what the stop led to (requeued, stopped, preempted, timeout, interrupted, cancelled)."""
        run = self.run
        try:
            resumed = run.restore(
                model=self.model,
                optimizer=self.opt,
                scheduler=self.sched,
                scaler=self.scaler,
                ema=self.ema,
            )
            if not resumed:  # a resume may change train.batch_size, and so the step count
                self.cfg.check_profile_reaches(len(self.dataset))
            for _ in run.epochs(self.cfg.train.epochs):
                self._train_epoch()
                self._end_of_epoch()
            return run.finish()
        except RunStopped as stopped:
            return stopped.outcome

    def _train_epoch(self) -> None:
        """The rest of the current epoch's steps (``run.step`` stops the loop on an agreed stop)."""
        bar = self._progress_bar()
        self.model.train()
        accumulate, micro = self.cfg.train.grad_accum, 0
        batch, micros = (0, 0), [0]
        for items in self.loader:
            if micro == 0:
                # Each step's global batch: (first sample, size), for the loss weights, set by
                # the loader's first micro-batch.
                batch = self.internals.global_batch or batch
                micros = split(batch[1], accumulate)
            # Every rank's share of this micro-batch, for losses that gather rows across ranks.
            rows = split(micros[micro], self.world)
            micro += 1
            with dist.batch_rows(rows):
                self._forward_backward(items, last_micro=micro == accumulate, of=batch[1])
            if micro < accumulate:
                continue
            micro = 0
            self._optimizer_step()
            self.sched.step()  # the schedule's progress counts the samples trained
            if bar is not None:
                bar.update(1)
            self.run.step()
        if bar is not None:
            bar.close()

    def _progress_bar(self) -> tqdm | None:
        if self.rank != 0 or not self.cfg.train.progress_bar:
            return None
        return tqdm(
            total=self.internals.steps_per_epoch,
            initial=self.state.step_in_epoch,
            unit="step",
            leave=False,
            desc=f"epoch {self.state.epoch + 1}/{self.cfg.train.epochs}",
            mininterval=1.0 if sys.stderr.isatty() else 30.0,
        )

    def _forward_backward(self, batch: dict[str, Any], last_micro: bool, of: int) -> None:
        """One micro-batch of a step of ``of`` samples. Gradients are synchronised across ranks
        only on the last one of a step. The loss (a mean over this micro-batch) is weighted by
        the micro-batch's share of the step: averaged over ranks and micro-batches, the gradient
        is the mean over the step's samples even where ranks hold different numbers of them."""
        count = len(batch["index"])
        weight = share(count, self.world, self.cfg.train.grad_accum, of)
        batch = _to(batch, self.device)
        labels = self._device_labels()
        if labels is not None:
            # Picked on the device by the batch's index: no copy, nothing read back.
            labels = labels[batch["index"]]
        sync = last_micro or self.world == 1
        with parallel.gradient_sync(self.model, sync):
            with self.run.autocast():
                loss, metrics = self.task.loss(self.model, batch, labels)
            weighted = loss * weight if weight != 1 else loss
            self.scaler.scale(weighted / self.cfg.train.grad_accum).backward()
        self.internals.guard.observe(loss)
        self.internals.window.add(loss, metrics)

    def _device_labels(self) -> torch.Tensor | None:
        """The pseudo-labels of every sample, copied to the device once per mining round (or
        resume)."""
        labels = self.state.labels
        if labels is None:
            return None
        if self._labels_of is not labels:
            src = torch.from_numpy(labels)
            if self.device.type == "cuda":
                # So the copy need not wait; torch keeps the pinned block until it is done.
                src = src.pin_memory()
            self._labels_of, self._labels = labels, src.to(self.device, non_blocking=True)
        return self._labels

    def _optimizer_step(self) -> None:
        if self.cfg.train.grad_clip:
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.train.grad_clip)
        guard, params = self.internals.guard, self.module.parameters()
        if guard.policy != "skip_step" or guard.step_ok(
            parallel.local_grads(params) if self.sharded else params,
            self.scaler,
            self.state.global_step + 1,
        ):
            self.scaler.step(self.opt)
            self.scaler.update()
            if self.ema is not None:
                self.ema.update()
        self.opt.zero_grad(set_to_none=True)

    def _check_finite(self) -> None:
        """Collective: every loss since the last check, every weight and optimizer tensor finite,
        or the run stops here (eval and mining never run on non-finite weights)."""
        self.internals.guard.check(self.state.global_step, self._state_tensors())

    def _state_tensors(self) -> Iterator[object]:
        yield from parallel.local(self.module.parameters())
        yield from parallel.local(self.module.buffers())
        for per_param in self.opt.state.values():
            yield from parallel.local(per_param.values())

    def _end_of_epoch(self) -> None:
        """Eval and mining when due; ``run.epochs`` then commits the end-of-epoch checkpoint."""
        finished = self.state.epoch + 1
        self._check_finite()
        if self.cfg.train.eval_every_epochs and finished % self.cfg.train.eval_every_epochs == 0:
            self._evaluate()
        if self.internals.mining_due(self.task.can_embed):
            teacher = self.ema.swapped() if self.cfg.mining.embed_with == "ema" else None
            with teacher or contextlib.nullcontext():
                self.run.mine(self.task)

    # -- reporting ----------------------------------------------------------------------------
    def _evaluate(self) -> None:
        ds = self.task.eval_dataset()
        if ds is None:
            return
        metrics = self._eval_pass(ds)
        if self.ema is not None:
            # The same metrics of the EMA weights: eval/x -> eval_ema/x.
            with self.ema.swapped():
                ema = self._eval_pass(ds)
            metrics.update({k.replace("/", "_ema/", 1): v for k, v in ema.items()})
        self.run.log(metrics)
        if self.rank == 0 and metrics:
            log.info(
                "eval after epoch %d: %s",
                self.state.epoch + 1,
                ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()),
            )
        self.internals.report(eval=metrics)

    def _eval_pass(self, ds: Dataset) -> dict[str, float]:
        with self.phases.enter(phases.EVAL), parallel.gathered(self.module):
            metrics = evaluate(
                self.task,
                self.module,
                ds,
                self.device,
                self.amp,
                self.micro_global // self.world,
                tick=self.phases.tick,
            )
        return {k if "/" in k else f"eval/{k}": v for k, v in metrics.items()}

    def _write_ema(self) -> None:
        """At the end of the run, beside model.pt: the EMA weights (gathered under fsdp)."""
        ema = self.ema.full_state(self.module) if self.ema is not None else None
        if ema is not None and self.rank == 0:
            durable.write_atomic(self.internals.paths.model_ema, ema, codec=TORCH)
