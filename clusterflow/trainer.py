"""The DDP training loop: what runs on every rank between rendezvous and exit.

A fresh start and a resume go through the same code: the checkpointer restores the newest
committed checkpoint, if any, and the loop continues from its (epoch, step within epoch). State
lives in the checkpoint only, so a requeued job needs nothing else.

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
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from clusterflow import builders, checkpointer, dist, durable, phases, rundir
from clusterflow.config import Config
from clusterflow.metrics import Throughput, gpu_stats, writer_for
from clusterflow.mining import Miner
from clusterflow.preemption import Preemption, StopAgreement
from clusterflow.sampler import GlobalBatchSampler
from clusterflow.state import rank_seed, seed_everything
from clusterflow.tasks import Task
from clusterflow.train_state import TrainState

log = logging.getLogger("clusterflow.trainer")


def _to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


class _Window:
    """Sums over the micro-steps since the last log. Losses and tensor metrics stay on the device
    (float64, the same sums a Python float gives), so a step that does not log reads nothing back."""

    def __init__(self) -> None:
        self.throughput = Throughput()  # resets itself at each report
        self.clear()

    def clear(self) -> None:
        self.loss: Any = 0.0
        self.n = 0.0
        self.extra: dict[str, Any] = {}

    @staticmethod
    def _value(v: Any) -> Any:
        return v.detach().to(torch.float64) if torch.is_tensor(v) else float(v)

    def add(self, loss: Any, metrics: dict[str, Any], samples: int) -> None:
        self.loss = self.loss + self._value(loss)
        self.n += 1
        for k, v in metrics.items():
            self.extra[k] = self.extra.get(k, 0.0) + self._value(v)
        self.throughput.add(samples)

    def means(self) -> dict[str, float]:
        n = max(self.n, 1)
        return {"train/loss": float(self.loss) / n, **{f"train/{k}": float(v) / n for k, v in self.extra.items()}}


class Trainer:
    def __init__(self, cfg: Config, task: Task, device: torch.device, attempt: int, preemption: Preemption) -> None:
        self.cfg, self.task, self.device, self.attempt = cfg, task, device, attempt
        self.rank, self.world = dist.rank(), dist.world()
        self.paths = rundir.RunPaths(cfg.run.dir)
        self.phases = phases.Phases()
        self.stop = StopAgreement(preemption, device)
        seed_everything(cfg.run.seed)  # identical initial weights on every rank
        self.module, self.model = builders.build_model(cfg, task, device, self.world)
        seed_everything(rank_seed(cfg.run.seed, self.rank))  # distinct per-rank streams from here on
        t = cfg.train
        self.opt = builders.build_optimizer(t, self.module, self.world)
        self._build_data()
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, builders.lr_schedule(t, self.steps_per_epoch * t.epochs))
        self.amp = builders.amp_dtype(t.amp, device)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp == torch.float16)
        self.state = TrainState()
        self.checkpointer = checkpointer.Checkpointer(
            cfg, self.module, {"optimizer": self.opt, "scheduler": self.sched, "scaler": self.scaler, "train": self.state},
            self.state, self.steps_per_epoch, attempt, self.phases)
        self.miner = Miner(cfg.mining, device, self.amp, self.stop, self.phases, progress_bar=t.progress_bar)

    def _build_data(self) -> None:
        t = self.cfg.train
        self.dataset = self.task.train_dataset()
        self.micro_global = t.batch_size // t.grad_accum
        self.sampler = GlobalBatchSampler(len(self.dataset), self.micro_global, self.rank, self.world, self.cfg.run.seed)
        self.steps_per_epoch = self.sampler.batches_per_epoch() // t.grad_accum
        if self.steps_per_epoch < 1:
            from clusterflow.errors import UserError

            raise UserError(f"train.batch_size={t.batch_size} is larger than the dataset ({len(self.dataset)} samples); lower it")

    # -- the loop -----------------------------------------------------------------------------
    def fit(self) -> str:
        """Train to the end or until a signal. Returns "completed", "preempted" or "timeout"."""
        resumed = self.checkpointer.restore()
        self.writer = writer_for(self.rank == 0, self.paths, self.attempt, self._purge_step(resumed))
        self._status(state="running")
        try:
            while self.state.epoch < self.cfg.train.epochs:
                reason = self._train_epoch() or self._end_of_epoch()
                if reason:
                    return reason
            self._finish()
            return "completed"
        finally:
            self.writer.close()
            self.checkpointer.close()

    def _purge_step(self, resumed: bool) -> int:
        """The first step this attempt logs: TensorBoard drops what earlier attempts logged from
        there on. The resumed step itself is logged again only when its end-of-epoch work is redone."""
        s = self.state
        return s.global_step if resumed and s.step_in_epoch == self.steps_per_epoch else s.global_step + 1

    def _train_epoch(self) -> str:
        """The rest of the current epoch's steps. Returns the agreed stop reason, or ""."""
        self.task.set_epoch(self.state.epoch)
        self.sampler.set_epoch(self.state.epoch, self.state.step_in_epoch * self.cfg.train.grad_accum)
        bar = self._progress_bar()
        window = _Window()
        self.model.train()
        self.phases.set(phases.TRAIN)
        micro = 0
        for batch in self._loader():
            micro += 1
            self._forward_backward(batch, last_micro=micro == self.cfg.train.grad_accum, window=window)
            if micro < self.cfg.train.grad_accum:
                continue
            micro = 0
            self._optimizer_step()
            if bar is not None:
                bar.update(1)
            if self._log_due():
                self._log_interval(window)
                window.clear()
            reason = self.stop.poll()
            if reason:
                log.warning("signal received (%s): saving at global step %d and stopping", reason, self.state.global_step)
                self._save(checkpointer.STOP)
                if bar is not None:
                    bar.close()
                return reason
            self._save(checkpointer.STEP)
        if bar is not None:
            bar.close()
        return ""

    def _loader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.dataset, batch_sampler=self.sampler, num_workers=self.cfg.data.num_workers,
                                           pin_memory=self.cfg.data.pin_memory and self.device.type == "cuda")

    def _progress_bar(self) -> Any:
        if self.rank != 0 or not self.cfg.train.progress_bar:
            return None
        from tqdm import tqdm

        return tqdm(total=self.steps_per_epoch, initial=self.state.step_in_epoch, unit="step", leave=False,
                    desc=f"epoch {self.state.epoch + 1}/{self.cfg.train.epochs}", mininterval=1.0 if sys.stderr.isatty() else 30.0)

    def _forward_backward(self, batch: dict[str, Any], last_micro: bool, window: _Window) -> None:
        """One micro-batch. Gradients are synchronised across ranks only on the last one of a step."""
        labels = self.state.labels
        if labels is not None:  # picked with the index still on the host: nothing read back from the device
            labels = torch.from_numpy(labels[batch["index"].numpy()]).to(self.device, non_blocking=True)
        batch = _to(batch, self.device)
        sync = last_micro or self.world == 1
        ctx = self.model.no_sync() if (not sync and isinstance(self.model, DDP)) else contextlib.nullcontext()
        with ctx:
            with torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None):
                loss, metrics = self.task.loss(self.model, batch, labels)
            self.scaler.scale(loss / self.cfg.train.grad_accum).backward()
        window.add(loss, metrics, len(batch["index"]))

    def _optimizer_step(self) -> None:
        if self.cfg.train.grad_clip:
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.train.grad_clip)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        self.state.step_done()

    def _log_due(self) -> bool:
        s = self.state
        return s.global_step % self.cfg.train.log_every_steps == 0 or s.step_in_epoch == self.steps_per_epoch

    def _end_of_epoch(self) -> str:
        """Eval, mining when due, then the end-of-epoch checkpoint. Returns the agreed stop reason, or ""."""
        finished = self.state.epoch + 1
        if self.cfg.train.eval_every_epochs and finished % self.cfg.train.eval_every_epochs == 0:
            self._evaluate()
        if self.miner.due(finished, self.cfg.train.epochs, self.task.can_embed):
            result = self.miner.run(self.task, self.module, finished)
            if result is None:
                # A signal arrived during the round: commit the finished epoch; the round is redone on restart.
                reason = self.stop.poll() or "preempted"
                self._save(checkpointer.STOP)
                return reason
            self.state.labels = result.labels
            self.state.mining_history.append(result.stats)
            self._log_mining(result.stats)
        self.state.epoch_done()
        self._save(checkpointer.EPOCH_END)
        return self.stop.poll()

    def _save(self, event: str) -> None:
        scalars = self.checkpointer.save(event)
        if scalars:
            self.writer.scalars(scalars, self.state.global_step)

    # -- reporting ----------------------------------------------------------------------------
    def _log_interval(self, window: _Window) -> None:
        rep = window.throughput.report()
        s = self.state
        reduced = dist.all_reduce_dict(window.means(), op="mean", device=self.device)
        rates = dist.all_reduce_dict({"rate": rep["samples_per_s_rank"]}, op="sum", device=self.device)
        out = {**reduced, "train/lr": self.sched.get_last_lr()[0], "perf/samples_per_s_total": rates["rate"],
               "perf/samples_per_s_rank0": rep["samples_per_s_rank"], "perf/step_time_s": rep["step_time_s"],
               "train/epoch": s.epoch + s.step_in_epoch / self.steps_per_epoch, **gpu_stats()}
        self.writer.scalars(out, s.global_step)
        if self.rank == 0:
            log.info("epoch %d step %d/%d (global %d) loss %.4f lr %.2e %.0f samples/s", s.epoch + 1, s.step_in_epoch,
                     self.steps_per_epoch, s.global_step, out["train/loss"], out["train/lr"], out["perf/samples_per_s_total"])
        self._status(state="running", last_loss=out["train/loss"], samples_per_s=out["perf/samples_per_s_total"])

    def _log_mining(self, s: dict[str, Any]) -> None:
        scalars = {f"mining/{k}": float(v) for k, v in s.items() if isinstance(v, (int, float)) and k != "epoch"}
        scalars.update({f"mining/seconds_{k}": float(v) for k, v in s["seconds"].items()})
        scalars["mining/embed_per_s_total"] = s["embed_per_s_total"]
        self.writer.scalars(scalars, self.state.global_step)
        labels = self.state.labels
        if labels is not None:
            sizes = np.bincount(labels[labels >= 0])
            if len(sizes):
                self.writer.histogram("mining/cluster_sizes", sizes, self.state.global_step)
        if self.rank == 0:
            q = "".join(f" {k} {s[k]:.3f}" for k in ("nmi", "ari", "pairwise_f", "bcubed_f") if k in s)
            log.info("mining after epoch %d: %d clusters, %d singletons, largest %d, %.2f s;%s",
                     s["epoch"], s["num_clusters"], s["num_singletons"], s["largest_cluster"], s["seconds"]["total"], q)
        self._status(mining=self.state.mining_history)

    def _evaluate(self) -> None:
        ds = self.task.eval_dataset()
        if ds is None:
            return
        from clusterflow.evaluate import evaluate

        with self.phases.enter(phases.EVAL):
            metrics = evaluate(self.task, self.module, ds, self.device, self.amp, self.micro_global // self.world)
        metrics = {k if "/" in k else f"eval/{k}": v for k, v in metrics.items()}
        self.writer.scalars(metrics, self.state.global_step)
        if self.rank == 0 and metrics:
            log.info("eval after epoch %d: %s", self.state.epoch + 1, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        self._status(eval=metrics)

    def _finish(self) -> None:
        self._status(state="running")
        self.checkpointer.finish()  # the last checkpoint is committed before the run counts as done
        if self.rank == 0:
            durable.write_atomic(self.paths.model, self.module.state_dict())
        dist.barrier()

    def _status(self, **fields: Any) -> None:
        if self.rank == 0:
            s = self.state
            rundir.write_status(self.paths, epoch=s.epoch, global_step=s.global_step, step_in_epoch=s.step_in_epoch,
                                steps_per_epoch=self.steps_per_epoch, phase=self.phases.current, **fields)
