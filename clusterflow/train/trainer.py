"""The training loop (DDP or sharded: ``parallel.py``): what runs on every rank between
rendezvous and exit.

A fresh start and a resume go through the same code: the checkpointer restores the newest
committed checkpoint, if any, and the loop continues from its epoch and the number of samples of
that epoch's order it trained (``distributed/sampler.py``: the same order on any world size). State
lives in the checkpoint only, so a requeued job needs nothing else.

No sample is dropped or repeated: the epoch's last batch also takes the samples left over when
the batch size does not divide the dataset, ranks may then hold one sample more than others, and
each micro-batch's loss is weighted by its share of the step's samples, so that the averaged
gradient is the mean over every sample of the step whichever rank held it (docs/data.md).

Order of an epoch: steps (after each, the ranks agree on whether to stop, and the checkpointer
saves when due) -> evaluation -> mining (when due) -> the end-of-epoch checkpoint, which holds the
new labels. That checkpoint supersedes a stop checkpoint taken at the same step before the
end-of-epoch work, so a resume never repeats a finished round.

The loop asks each component whether it is due (``checkpointer.save(event)``, ``miner.due``,
``_log_due``) and never decides for it; ``Phases`` says what the rank is doing now.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from clusterflow import rundir
from clusterflow.checkpoint import checkpointer
from clusterflow.checkpoint.data_identity import identify
from clusterflow.checkpoint.rng import capture_rng, rank_seed, restore_rng, seed_everything
from clusterflow.checkpoint.train_state import TrainState
from clusterflow.config.job_config import Config
from clusterflow.distributed import comm as dist
from clusterflow.distributed.sampler import (
    EpochItems,
    EpochPlan,
    GlobalBatchSampler,
    WithEpoch,
    check_fits,
    epoch_order,
    share,
    split,
)
from clusterflow.mining import figure
from clusterflow.mining.stage import Miner, for_status
from clusterflow.observe import phases
from clusterflow.observe.metrics import Every, gpu_stats, writer_for
from clusterflow.observe.observer import mining_wait_timeout_s
from clusterflow.observe.profiling import profile_for
from clusterflow.observe.timeline import timeline_for
from clusterflow.rundir import restarts, transitions
from clusterflow.rundir.states import State, StopReason
from clusterflow.storage import durable
from clusterflow.storage.tensors import TORCH
from clusterflow.tasks import Task
from clusterflow.train import builders, parallel
from clusterflow.train.ema import EMA
from clusterflow.train.evaluate import evaluate
from clusterflow.train.finite import FiniteGuard
from clusterflow.train.preemption import AGREE_EVERY_S, WHY, Preemption, StopAgreement
from clusterflow.train.window import LossWindow

log = logging.getLogger("clusterflow.trainer")


def _to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {
        k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()
    }


class Trainer:
    def __init__(
        self,
        cfg: Config,
        paths: rundir.RunPaths,
        task: Task,
        device: torch.device,
        attempt: int,
        preemption: Preemption,
    ) -> None:
        self.cfg, self.task, self.device, self.attempt = cfg, task, device, attempt
        self.rank, self.world = dist.rank(), dist.world()
        self.paths = paths
        self.phases = phases.Phases()
        self._first_step = True
        self._step_mark = self._busy_until = self._waited_mark = self._waited_until = 0.0
        # Rank 0's record of this attempt in time, for the goodput ledger.
        self.timeline = timeline_for(
            self.rank == 0, self.paths, attempt, self.phases, world_size=self.world
        )
        self.stop = StopAgreement(preemption, cfg.dist.timeout_s, interval_s=AGREE_EVERY_S)
        seed_everything(cfg.run.seed)  # identical initial weights on every rank
        self.module, self.model = builders.build_model(cfg, task, device, self.world)
        self.sharded = parallel.is_sharded(self.module)
        # Distinct per-rank streams from here on.
        seed_everything(rank_seed(cfg.run.seed, self.rank))
        t = cfg.train
        self.opt = builders.build_optimizer(t, self.module, self.world)
        self.ema = EMA(self.module, t.ema_decay) if t.ema_decay else None
        self.state = TrainState()
        self._build_data()
        n = len(self.dataset)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt,
            builders.lr_schedule(
                t, n * t.epochs, lambda: self.state.epoch * n + (self.state.sample_in_epoch or 0)
            ),
        )
        self.amp = builders.amp_dtype(t.amp, device)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp == torch.float16)
        # The labels array that self._labels holds on the device.
        self._labels_of: np.ndarray | None = None
        self._labels: torch.Tensor | None = None
        self._persistent_loader: torch.utils.data.DataLoader | None = None
        self._progress_due = Every(1.0)  # status.json's progress fields
        # The latest log step's loss and rate: every status write carries them, so the epoch's
        # and the run's end record the last logged loss even when the cadence skipped its write.
        self._logged: dict[str, float] = {}
        self.checkpointer = checkpointer.Checkpointer(
            cfg,
            self.paths,
            self.module,
            {
                "optimizer": self.opt,
                "scheduler": self.sched,
                "scaler": self.scaler,
                "train": self.state,
                **({"ema": self.ema} if self.ema is not None else {}),
            },
            self.state,
            self.steps_per_epoch,
            attempt,
            self.phases,
            before_commit=self._before_commit,
            after_commit=self.timeline.committed,
        )
        self.guard = FiniteGuard(device, t, self.checkpointer.committed_steps)
        self.miner = Miner(
            cfg.mining,
            device,
            self.amp,
            self.stop,
            self.phases,
            progress_bar=t.progress_bar,
            rounds_dir=self.paths.mining_rounds,
            fsync=cfg.checkpoint.fsync,
            data=cfg.data,
            wait_timeout_s=mining_wait_timeout_s(cfg.mining.timeout_s, cfg.dist.stall_limit_s),
        )

    def _build_data(self) -> None:
        t = self.cfg.train
        self.dataset = self.task.train_dataset()
        # What a checkpoint records of the data, and a resume compares with it.
        self.data = identify(self.dataset)
        check_fits(len(self.dataset), t.batch_size, self.world * t.grad_accum, self.cfg.task.target)
        self.micro_global = t.batch_size // t.grad_accum
        dataset = self.dataset
        self.sampler = GlobalBatchSampler(
            len(dataset),
            t.batch_size,
            self.rank,
            self.world,
            self.cfg.run.seed,
            t.grad_accum,
            order=lambda seed, epoch: epoch_order(dataset, seed, epoch),
        )
        self.plan = self.sampler.plan
        self.steps_per_epoch = self.plan.steps()

    def _plan_epoch(self) -> None:
        """The current epoch's global batches from the state: its saved plan (a checkpoint's), with
        a new segment where a resume changed ``train.batch_size``."""
        s, t = self.state, self.cfg.train
        if s.sample_in_epoch is None:  # a checkpoint that counted steps of train.batch_size
            s.sample_in_epoch = s.step_in_epoch * t.batch_size
        old = EpochPlan.of(len(self.dataset), t.batch_size, s.plan)
        self.plan = old.with_batch(s.sample_in_epoch, t.batch_size)
        if self.plan is not old and self.rank == 0:
            log.warning(
                "train.batch_size %d from sample %d of epoch %d on (the epoch started with %d)",
                t.batch_size,
                s.sample_in_epoch,
                s.epoch + 1,
                old.segments[-1][1],
            )
        s.plan = self.plan.as_list()
        self.steps_per_epoch = self.checkpointer.steps_per_epoch = self.plan.steps()

    # -- the loop -----------------------------------------------------------------------------
    def fit(self) -> str:
        """Train to the end or until a signal or a cancel. Returns "completed" or the agreed
        stop reason (a ``StopReason``: preempted, timeout, interrupted, cancelled)."""
        t0 = time.monotonic()
        resumed = self.checkpointer.restore(self.data)
        if not resumed:  # a resume may change train.batch_size, and so the step count
            self.cfg.check_profile_reaches(len(self.dataset))
        self.timeline.restored(self.state.global_step, time.monotonic() - t0)
        self._first_step = True
        self._plan_epoch()
        if self.rank == 0:
            # What the run continues from; a checkpoint skipped as damaged is not in it.
            rundir.write_ledger(self.paths, self.state.ledger.record_file(self.state.global_step))
        self._forget_mined_rounds()
        self.guard.start(self.state.global_step)
        self.writer = writer_for(
            self.rank == 0,
            self.paths,
            self.attempt,
            self._purge_step(resumed),
            self.cfg.trackers,
            self.cfg.to_dict(),
        )
        self.profile = profile_for(
            self.cfg.train.profile_window,
            self.rank,
            self.attempt,
            self.paths,
            self.device.type == "cuda",
        )
        self._status(running=True)
        outcome = State.FAILED  # what the trackers record when an exception ends the loop
        try:
            while self.state.epoch < self.cfg.train.epochs:
                reason = self._train_epoch() or self._end_of_epoch()
                if reason:
                    outcome = reason
                    return reason
            self._finish()
            outcome = State.COMPLETED
            return outcome
        finally:
            self.profile.close()
            self.timeline.ended(outcome, self.state.global_step, self.writer)
            self.writer.close(outcome)
            self.checkpointer.close()

    def _purge_step(self, resumed: bool) -> int:
        """The first step this attempt logs: TensorBoard drops what earlier attempts logged from
        there on. The resumed step itself is logged again only when its end-of-epoch work is
        redone."""
        s = self.state
        return (
            s.global_step
            if resumed and s.step_in_epoch == self.steps_per_epoch
            else s.global_step + 1
        )

    def _train_epoch(self) -> str:
        """The rest of the current epoch's steps. Returns the agreed stop reason, or ""."""
        self._plan_epoch()
        self.task.set_epoch(self.state.epoch)
        self.sampler.set_epoch(self.state.epoch, self.state.sample_in_epoch, self.plan)
        # Each step's global batch: (first sample, size), for the loss weights and the ledger.
        steps = iter(self.plan.batches_from(self.state.sample_in_epoch))
        batch, micros = (0, 0), [0]
        bar = self._progress_bar()
        window = LossWindow()
        self.model.train()
        self.phases.step = self.state.global_step
        self.phases.set(phases.TRAIN)
        micro, reason = 0, ""
        # A step's own part (data, forward, backward before the last gradient sync) less its
        # waits in the loss's collectives: not the wait for slower peers. A few clock reads a
        # step, for the straggler watch.
        self._step_mark = self._busy_until = time.perf_counter()
        self._waited_mark = self._waited_until = dist.waited_s()
        for items in self._loader():
            if micro == 0:
                self.profile.begin(self.state.global_step + 1)
                batch = next(steps)
                micros = split(batch[1], self.cfg.train.grad_accum)
            # Every rank's share of this micro-batch, for losses that gather rows across ranks.
            rows = split(micros[micro], self.world)
            micro += 1
            with dist.batch_rows(rows):
                self._forward_backward(
                    items,
                    last_micro=micro == self.cfg.train.grad_accum,
                    window=window,
                    of=batch[1],
                )
            if micro < self.cfg.train.grad_accum:
                continue
            micro = 0
            self._optimizer_step(batch)
            self.profile.end(self.state.global_step)
            # A Python int: the heartbeat reads nothing from the device.
            busy = self._busy_until - self._step_mark - (self._waited_until - self._waited_mark)
            self.phases.tick(self.state.global_step, busy)
            self._step_mark, self._waited_mark = time.perf_counter(), dist.waited_s()
            if self._first_step:
                self._first_step = False
                self.timeline.first_step(self.state.global_step)
                if self.rank == 0:  # an attempt a restart inside the job started: when it trains
                    restarts.note_first_step(self.paths, self.attempt, self.state.global_step)
            if bar is not None:
                bar.update(1)
            if self._log_due():
                self._log_interval(window)
                window.clear()
            reason = self.stop.poll()  # the answer of the previous step's reduce: no wait
            if reason:
                break
            self._save(checkpointer.STEP)
        if bar is not None:
            bar.close()
        # After the last step, the reduce in flight is read at once (blocking costs nothing here):
        # a signal during the last step stops before the end-of-epoch work, not after it.
        reason = reason or self.stop.agree()
        if reason:
            log.warning(
                "%s: saving at global step %d and stopping",
                WHY.get(reason, reason),
                self.state.global_step,
            )
            self._save(checkpointer.STOP)
        return reason

    def _loader(self) -> torch.utils.data.DataLoader:
        """This epoch's DataLoader; with persistent workers, one per attempt."""
        d = self.cfg.data
        persistent = d.persistent_workers and d.num_workers > 0
        if persistent and self._persistent_loader is not None:
            return self._persistent_loader
        # Its own generator: worker seeds depend on (seed, rank, epoch) only, and the global
        # random stream (dropout) is not drawn from, so a resume in mid-epoch continues that
        # stream exactly.
        g = torch.Generator().manual_seed(
            rank_seed(self.cfg.run.seed, self.rank) + self.state.epoch
        )
        data, batches = (
            (EpochItems(self.task), WithEpoch(self.sampler))
            if persistent
            else (self.dataset, self.sampler)
        )
        loader = torch.utils.data.DataLoader(
            data,
            batch_sampler=batches,
            num_workers=d.num_workers,
            generator=g,
            pin_memory=d.pin_memory and self.device.type == "cuda",
            persistent_workers=persistent,
            prefetch_factor=d.prefetch_factor if d.num_workers else None,
        )
        if persistent:
            self._persistent_loader = loader
        return loader

    def _progress_bar(self) -> tqdm | None:
        if self.rank != 0 or not self.cfg.train.progress_bar:
            return None
        return tqdm(
            total=self.steps_per_epoch,
            initial=self.state.step_in_epoch,
            unit="step",
            leave=False,
            desc=f"epoch {self.state.epoch + 1}/{self.cfg.train.epochs}",
            mininterval=1.0 if sys.stderr.isatty() else 30.0,
        )

    def _forward_backward(
        self, batch: dict[str, Any], last_micro: bool, window: LossWindow, of: int
    ) -> None:
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
            with torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None):
                loss, metrics = self.task.loss(self.model, batch, labels)
            if last_micro:
                self._busy_until, self._waited_until = time.perf_counter(), dist.waited_s()
            weighted = loss * weight if weight != 1 else loss
            self.scaler.scale(weighted / self.cfg.train.grad_accum).backward()
        self.guard.observe(loss)
        window.add(loss, metrics, count)

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

    def _optimizer_step(self, batch: tuple[int, int]) -> None:
        """The step that trained samples ``[start, start + size)`` of the epoch's order."""
        if self.cfg.train.grad_clip:
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.train.grad_clip)
        s = self.state
        params = self.module.parameters()
        if self.guard.policy != "skip_step" or self.guard.step_ok(
            parallel.local_grads(params) if self.sharded else params,
            self.scaler,
            s.global_step + 1,
        ):
            self.scaler.step(self.opt)
            self.scaler.update()
            if self.ema is not None:
                self.ema.update()
        self.opt.zero_grad(set_to_none=True)
        start, size = batch
        s.step_done(size)
        s.ledger.record(
            s.epoch,
            self.data,
            start,
            start + size,
            self.attempt,
            self.world,
            self.cfg.train.batch_size,
        )
        self.sched.step()  # the schedule's progress counts the samples trained

    def _before_commit(self, event: str) -> None:
        # Every point up to a checkpoint is on disk: a resume logs only later steps again.
        self.writer.flush()
        self._check_finite(state=True)

    def _check_finite(self, state: bool = False) -> None:
        """Collective: every loss since the last check finite (and with ``state``, every weight and
        optimizer tensor), or the run stops here. At log steps, before each commit, at epoch end."""
        self.guard.check(self.state.global_step, self._state_tensors() if state else ())

    def _state_tensors(self) -> Iterator[object]:
        """This rank's part of every weight and optimizer tensor (its shards under fsdp), and the
        optimizer state's other values (``FiniteGuard.check`` keeps the floating-point tensors)."""
        yield from parallel.local(self.module.parameters())
        yield from parallel.local(self.module.buffers())
        for per_param in self.opt.state.values():
            yield from parallel.local(per_param.values())

    def _log_due(self) -> bool:
        s = self.state
        return (
            s.global_step % self.cfg.train.log_every_steps == 0
            or s.step_in_epoch == self.steps_per_epoch
        )

    def _end_of_epoch(self) -> str:
        """Eval, mining when due, then the end-of-epoch checkpoint. Returns the agreed stop
        reason, or ""."""
        finished = self.state.epoch + 1
        self._check_finite(state=True)  # eval and mining never run on non-finite weights
        rng = capture_rng()  # a round cut short is redone from here, eval included
        if self.cfg.train.eval_every_epochs and finished % self.cfg.train.eval_every_epochs == 0:
            self._evaluate()
        if self.miner.due(finished, self.cfg.train.epochs, self.task.can_embed):
            teacher = self.ema.swapped() if self.cfg.mining.embed_with == "ema" else None
            with teacher or contextlib.nullcontext(), parallel.gathered(self.module):
                result = self.miner.run(self.task, self.module, finished)
            if result is None:
                # A signal arrived during the round: commit the finished epoch; the round
                # continues on restart.
                reason = self.stop.agree() or StopReason.PREEMPTED
                restore_rng(rng)
                self._save(checkpointer.STOP)
                return reason
            self.state.labels = result.labels
            self.state.mining_history.append(result.stats)
            self._log_mining(result.stats)
        self.state.epoch_done()
        self._save(checkpointer.EPOCH_END)
        self._forget_mined_rounds()
        return self.stop.agree()

    def _forget_mined_rounds(self) -> None:
        """Delete the files of the mining rounds whose labels a committed checkpoint holds."""
        if self.rank == 0:
            self.miner.forget_rounds(self.checkpointer.committed_epoch())

    def _save(self, event: str) -> None:
        scalars = self.checkpointer.save(event)
        if scalars:
            self._log(scalars)
            self.writer.tag("clusterflow.checkpoint", f"step-{self.state.global_step} ({event})")
            # A resume from this checkpoint logs from the next step: these points are not logged
            # again.
            self.writer.flush()
        if event != checkpointer.STEP:
            # Where a stop or an epoch's end left the run, whatever the progress cadence skipped.
            self._status()

    # -- reporting ----------------------------------------------------------------------------
    def _log(self, scalars: dict[str, float]) -> None:
        """Scalars at the current step: to the writer, and to the checkpointer (keep_best)."""
        self.writer.scalars(scalars, self.state.global_step)
        self.checkpointer.note(scalars)

    def _log_interval(self, window: LossWindow) -> None:
        rep = window.throughput.report()
        s = self.state
        # One collective for the finite check, the means and the throughput (a sum: the mean
        # times the world size).
        reduced = self.guard.check(
            s.global_step, means={**window.means(), "rate": rep["samples_per_s_rank"]}
        )
        rate = reduced.pop("rate") * self.world
        out = {
            **reduced,
            "train/lr": self.sched.get_last_lr()[0],
            "perf/samples_per_s_total": rate,
            "perf/samples_per_s_rank0": rep["samples_per_s_rank"],
            "perf/step_time_s": rep["step_time_s"],
            "train/epoch": s.epoch + s.step_in_epoch / self.steps_per_epoch,
            **gpu_stats(),
            **self.phases.scalars(),
        }
        self._log(out)
        if self.rank == 0:
            log.info(
                "epoch %d step %d/%d (global %d) loss %.4f lr %.2e %.0f samples/s",
                s.epoch + 1,
                s.step_in_epoch,
                self.steps_per_epoch,
                s.global_step,
                out["train/loss"],
                out["train/lr"],
                out["perf/samples_per_s_total"],
            )
        self._logged = {
            "last_loss": out["train/loss"],
            "samples_per_s": out["perf/samples_per_s_total"],
        }
        # Each write is a rename: milliseconds on ext4 or NFS, so at most one a second.
        if self._progress_due.due():
            self._status(fsync=False, running=True)
        self.timeline.progress(s.global_step)

    def _log_mining(self, s: dict[str, Any]) -> None:
        scalars = {
            f"mining/{k}": float(v)
            for k, v in s.items()
            if isinstance(v, (int, float)) and k != "epoch"
        }
        scalars.update({f"mining/seconds_{k}": float(v) for k, v in s["seconds"].items()})
        scalars["mining/embed_per_s_total"] = s["embed_per_s_total"]
        scalars.update(
            {f"mining/embed_per_s_rank{r}": v for r, v in enumerate(s.get("embed_per_s_rank", []))}
        )
        self._log(scalars)
        labels = self.state.labels
        if labels is not None:
            sizes = np.bincount(labels[labels >= 0])
            if len(sizes):
                self.writer.histogram("mining/cluster_sizes", sizes, self.state.global_step)
        if "curve" in s:
            self.writer.image("mining/curve", lambda: figure.render(s), self.state.global_step)
        if self.rank == 0:
            q = "".join(
                f" {k} {s[k]:.3f}" for k in ("nmi", "ari", "pairwise_f", "bcubed_f") if k in s
            )
            log.info(
                "mining after epoch %d: %d clusters, %d singletons, largest %d, %.2f s;%s",
                s["epoch"],
                s["num_clusters"],
                s["num_singletons"],
                s["largest_cluster"],
                s["seconds"]["total"],
                q,
            )
        self._status(mining=for_status(self.state.mining_history))

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
        self._log(metrics)
        if self.rank == 0 and metrics:
            log.info(
                "eval after epoch %d: %s",
                self.state.epoch + 1,
                ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()),
            )
        self._status(eval=metrics)

    def _eval_pass(self, ds: Dataset) -> dict[str, float]:
        with self.phases.enter(phases.EVAL), parallel.gathered(self.module):
            metrics = evaluate(
                self.task,
                self.module,
                ds,
                self.device,
                self.amp,
                self.micro_global // self.world,
                self.phases.tick,
            )
        return {k if "/" in k else f"eval/{k}": v for k, v in metrics.items()}

    def _finish(self) -> None:
        self._status(running=True)
        self.checkpointer.finish()  # the last checkpoint is committed before the run counts as done
        # Under fsdp: the whole model, gathered (collective), so model.pt loads into the plain one.
        weights = parallel.full_state_dict(self.module) if self.sharded else None
        if self.rank == 0:
            durable.write_atomic(
                self.paths.model,
                weights if self.sharded else self.module.state_dict(),
                codec=TORCH,
            )
        ema = self.ema.full_state(self.module) if self.ema is not None else None
        if ema is not None and self.rank == 0:
            durable.write_atomic(self.paths.model_ema, ema, codec=TORCH)
        dist.barrier()

    def _status(self, fsync: bool = True, running: bool = False, **fields: object) -> None:
        """Rank 0: the progress into status.json, with ``fields``; ``running`` says the attempt
        goes on (a transition: refused after another writer ended the run)."""
        if self.rank == 0:
            s = self.state
            progress = {
                "epoch": s.epoch,
                "global_step": s.global_step,
                "step_in_epoch": s.step_in_epoch,
                "steps_per_epoch": self.steps_per_epoch,
                "phase": self.phases.current,
                **self._logged,
                **fields,
            }
            if running:
                transitions.mark_running(self.paths, fsync=fsync, **progress)
            else:
                transitions.report(self.paths, fsync=fsync, **progress)
