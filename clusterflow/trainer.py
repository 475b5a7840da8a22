"""The DDP training loop: what runs on every rank between rendezvous and exit.

A fresh start and a resume go through the same code: ``Trainer.restore`` loads the newest
committed checkpoint, if any, and the loop continues from its (epoch, step within epoch). State
lives in the checkpoint only, so a requeued job needs nothing else.

Order of an epoch: steps (checkpoint every ``checkpoint.every_steps``; a signal is agreed on at
every step boundary) -> evaluation -> mining (when due) -> an end-of-epoch checkpoint that holds
the new labels, so a resume never repeats a finished round.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from clusterflow import dist, rundir
from clusterflow.config import Config
from clusterflow.metrics import Throughput, gpu_stats, writer_for
from clusterflow.preemption import Preemption
from clusterflow.sampler import GlobalBatchSampler
from clusterflow.state import capture_rng, rank_seed, restore_rng, seed_everything
from clusterflow.store import CheckpointStore, serialize
from clusterflow.tasks import Task

log = logging.getLogger("clusterflow.trainer")


def lr_multiplier(rule: str, world: int) -> float:
    return {"none": 1.0, "linear": float(world), "sqrt": math.sqrt(world)}[rule]


def amp_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[setting]


def _to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


class Trainer:
    def __init__(self, cfg: Config, task: Task, device: torch.device, attempt: int, preemption: Preemption) -> None:
        self.cfg, self.task, self.device, self.attempt, self.preemption = cfg, task, device, attempt, preemption
        self.rank, self.world = dist.rank(), dist.world()
        self.run_dir = cfg.run.dir
        seed_everything(cfg.run.seed)  # identical initial weights on every rank
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = cfg.train.tf32
            torch.backends.cudnn.allow_tf32 = cfg.train.tf32
        model = task.build_model()
        if cfg.task.init_from:
            init_weights(model, cfg.task.init_from)
        if cfg.dist.sync_batchnorm and self.world > 1:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.module = model.to(device)
        self.model: torch.nn.Module = self.module
        if self.world > 1:
            self.model = DDP(self.module, device_ids=[device.index] if device.type == "cuda" else None,
                             find_unused_parameters=cfg.dist.find_unused_parameters, bucket_cap_mb=cfg.dist.bucket_cap_mb)
        seed_everything(rank_seed(cfg.run.seed, self.rank))  # distinct per-rank streams from here on
        t = cfg.train
        self.lr = t.lr * lr_multiplier(t.lr_scaling, self.world)
        params = [p for p in self.module.parameters() if p.requires_grad]
        if t.optimizer == "adamw":
            self.opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=t.weight_decay)
        else:
            self.opt = torch.optim.SGD(params, lr=self.lr, momentum=0.9, weight_decay=t.weight_decay)
        self.dataset = task.train_dataset()
        self.micro_global = t.batch_size // t.grad_accum
        self.sampler = GlobalBatchSampler(len(self.dataset), self.micro_global, self.rank, self.world, cfg.run.seed)
        self.steps_per_epoch = self.sampler.batches_per_epoch() // t.grad_accum
        if self.steps_per_epoch < 1:
            from clusterflow.errors import UserError

            raise UserError(f"train.batch_size={t.batch_size} is larger than the dataset ({len(self.dataset)} samples); lower it")
        self.total_steps = self.steps_per_epoch * t.epochs
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self._lr_lambda)
        self.amp = amp_dtype(t.amp, device)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp == torch.float16)
        self.store = CheckpointStore(cfg.checkpoint_dir, cfg.checkpoint.keep_last, cfg.checkpoint.fsync)
        # counters
        self.epoch = 0
        self.step_in_epoch = 0
        self.global_step = 0
        self.labels: np.ndarray | None = None
        self.mining_history: list[dict[str, Any]] = []
        self.accum = {"loss_sum": 0.0, "loss_count": 0.0}
        self.stop_reason = ""

    def _lr_lambda(self, step: int) -> float:
        t = self.cfg.train
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.schedule == "constant":
            return 1.0
        progress = (step - t.warmup_steps) / max(1, self.total_steps - t.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    # -- checkpoint state ---------------------------------------------------------------------
    def train_state(self, rngs: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "global_step": self.global_step,
            "rng": rngs,  # one entry per rank
            "labels": torch.from_numpy(self.labels) if self.labels is not None else None,
            "mining_history": self.mining_history,
            "accum": dict(self.accum),
            "world_size": self.world,
        }

    def save(self) -> None:
        """Collective: every rank hands its RNG state to rank 0, which commits the checkpoint."""
        rngs = dist.gather_object(capture_rng())
        if self.rank == 0:
            t0 = time.perf_counter()
            # Objects, not bytes: the store streams them through torch.save, hashing as it writes.
            files = {"model.pt": self.module.state_dict(), "train_state.pt": self.train_state(rngs)}
            meta = {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "global_step": self.global_step,
                    "config_hash": self.cfg.fingerprint(), "world_size": self.world, "attempt": self.attempt}
            path = self.store.save(self.global_step, files, meta)
            if path:
                seconds = time.perf_counter() - t0
                log.info("checkpoint step %d committed at %s (%.2f s)", self.global_step, path, seconds)
                self.writer.scalars({"checkpoint/save_s": seconds}, self.global_step)
        dist.barrier()

    def restore(self) -> bool:
        """Load the newest committed checkpoint (every rank reads it). Returns True when resumed."""
        ckpt = self.store.latest()
        if ckpt is None:
            return False
        want, got = self.cfg.fingerprint(), ckpt.manifest.get("config_hash")
        if got and got != want:
            log.warning("checkpoint %s was written with a different config (hash %s, now %s); resuming anyway",
                        ckpt.path, got, want)
        self.module.load_state_dict(ckpt.load("model.pt"))
        st = ckpt.load("train_state.pt")
        self.opt.load_state_dict(st["optimizer"])
        self.sched.load_state_dict(st["scheduler"])
        self.scaler.load_state_dict(st["scaler"])
        self.epoch, self.step_in_epoch, self.global_step = st["epoch"], st["step_in_epoch"], st["global_step"]
        self.labels = st["labels"].numpy() if st["labels"] is not None else None
        self.mining_history = list(st["mining_history"])
        self.accum = dict(st["accum"])
        if st["world_size"] == self.world:
            restore_rng(st["rng"][self.rank])
        else:
            log.warning("resuming with %d ranks from a checkpoint of %d; per-rank RNG streams are re-derived",
                        self.world, st["world_size"])
        log.info("resumed from %s: epoch %d, step %d of the epoch, global step %d",
                 ckpt.path, self.epoch, self.step_in_epoch, self.global_step)
        return True

    # -- the loop -----------------------------------------------------------------------------
    def fit(self) -> str:
        """Train to the end or until a signal. Returns "completed", "preempted" or "timeout"."""
        if self.rank == 0:
            removed = self.store.clean_debris()
            if removed:
                log.warning("removed unfinished checkpoint folders left by a killed writer: %s", ", ".join(removed))
        dist.barrier()
        resumed = self.restore()
        self.writer = writer_for(self.rank == 0, rundir.path(self.run_dir, "tb"), self.attempt,
                                 purge_step=self.global_step if resumed else None)
        from clusterflow.mining import MiningGroup

        self.mining_group = MiningGroup(self.cfg.mining.timeout_s)
        self._status(state="running")
        try:
            while self.epoch < self.cfg.train.epochs:
                if not self._train_epoch():
                    return self.stop_reason
                self._end_of_epoch()
                if self.stop_reason:
                    return self.stop_reason
            self._finish()
            return "completed"
        finally:
            self.writer.close()
            self.store.wait_for_pruning()  # leave no half-deleted old step behind at exit

    def _train_epoch(self) -> bool:
        cfg = self.cfg
        self.task.set_epoch(self.epoch)
        self.sampler.set_epoch(self.epoch, self.step_in_epoch * cfg.train.grad_accum)
        loader = torch.utils.data.DataLoader(self.dataset, batch_sampler=self.sampler, num_workers=cfg.data.num_workers,
                                             pin_memory=cfg.data.pin_memory and self.device.type == "cuda")
        bar = None
        if self.rank == 0 and cfg.train.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=self.steps_per_epoch, initial=self.step_in_epoch, desc=f"epoch {self.epoch + 1}/{cfg.train.epochs}",
                       unit="step", mininterval=1.0 if sys.stderr.isatty() else 30.0, leave=False)
        thr = Throughput()
        interval = {"loss": 0.0, "n": 0.0}
        extra: dict[str, float] = {}
        self.model.train()
        micro = 0
        for batch in loader:
            batch = _to(batch, self.device)
            labels = torch.from_numpy(self.labels[batch["index"].cpu().numpy()]).to(self.device) if self.labels is not None else None
            last_micro = micro == cfg.train.grad_accum - 1
            sync = last_micro or self.world == 1
            ctx = self.model.no_sync() if (not sync and isinstance(self.model, DDP)) else _null()
            with ctx:
                with torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None):
                    loss, metrics = self.task.loss(self.model, batch, labels)
                self.scaler.scale(loss / cfg.train.grad_accum).backward()
            interval["loss"] += float(loss.detach())
            interval["n"] += 1
            for k, v in metrics.items():
                extra[k] = extra.get(k, 0.0) + float(v)
            thr.add(len(batch["index"]))
            micro += 1
            if not last_micro:
                continue
            micro = 0
            if cfg.train.grad_clip:
                self.scaler.unscale_(self.opt)
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), cfg.train.grad_clip)
            self.scaler.step(self.opt)
            self.scaler.update()
            self.opt.zero_grad(set_to_none=True)
            self.sched.step()
            self.step_in_epoch += 1
            self.global_step += 1
            self.accum["loss_sum"] += float(loss.detach())
            self.accum["loss_count"] += 1
            if bar is not None:
                bar.update(1)
            if self.global_step % cfg.train.log_every_steps == 0 or self.step_in_epoch == self.steps_per_epoch:
                self._log_interval(interval, extra, thr)
                interval, extra = {"loss": 0.0, "n": 0.0}, {}
            reason = self.preemption.agree(self.device)
            if reason:
                self.stop_reason = reason
                log.warning("signal received (%s): saving at global step %d and stopping", reason, self.global_step)
                self.save()
                if bar is not None:
                    bar.close()
                return False
            if self.global_step % cfg.checkpoint.every_steps == 0 and self.step_in_epoch < self.steps_per_epoch:
                self.save()  # the last step of an epoch is saved after eval and mining instead
        if bar is not None:
            bar.close()
        return True

    def _log_interval(self, interval: dict[str, float], extra: dict[str, float], thr: Throughput) -> None:
        rep = thr.report()
        n = max(interval["n"], 1)
        local = {"train/loss": interval["loss"] / n, **{f"train/{k}": v / n for k, v in extra.items()}}
        reduced = dist.all_reduce_dict(local, op="mean", device=self.device)
        rates = dist.all_reduce_dict({"rate": rep["samples_per_s_rank"]}, op="sum", device=self.device)
        out = {**reduced, "train/lr": self.sched.get_last_lr()[0], "perf/samples_per_s_total": rates["rate"],
               "perf/samples_per_s_rank0": rep["samples_per_s_rank"], "perf/step_time_s": rep["step_time_s"],
               "train/epoch": self.epoch + self.step_in_epoch / self.steps_per_epoch, **gpu_stats()}
        self.writer.scalars(out, self.global_step)
        if self.rank == 0:
            log.info("epoch %d step %d/%d (global %d) loss %.4f lr %.2e %.0f samples/s",
                     self.epoch + 1, self.step_in_epoch, self.steps_per_epoch, self.global_step,
                     out["train/loss"], out["train/lr"], out["perf/samples_per_s_total"])
        self._status(state="running", last_loss=out["train/loss"], samples_per_s=out["perf/samples_per_s_total"])

    def _end_of_epoch(self) -> None:
        cfg = self.cfg
        finished = self.epoch + 1
        if cfg.train.eval_every_epochs and finished % cfg.train.eval_every_epochs == 0:
            self._evaluate()
        mcfg = cfg.mining
        due = (mcfg.enabled and self.task.can_embed and finished >= mcfg.start_epoch
               and (finished - mcfg.start_epoch) % mcfg.every_epochs == 0 and finished < cfg.train.epochs)
        if due:
            from clusterflow.mining import mine

            threads = torch.get_num_threads()
            try:
                result = mine(self.task, self.module, mcfg, self.device, self.amp, self.mining_group, self.preemption,
                              finished, progress_bar=cfg.train.progress_bar)
            finally:
                torch.set_num_threads(threads)  # bitwise resume needs the same thread count before and after
            if result is None:
                # A signal arrived during the round: commit the finished epoch; the round is redone on restart.
                self.stop_reason = self.preemption.agree(self.device) or "preempted"
                self.save()
                return
            self.labels = result["labels"]
            self.mining_history.append(result["stats"])
            self._log_mining(result["stats"])
        self.epoch += 1
        self.step_in_epoch = 0
        self.save()
        reason = self.preemption.agree(self.device)
        if reason:
            self.stop_reason = reason

    def _log_mining(self, s: dict[str, Any]) -> None:
        scalars = {f"mining/{k}": float(v) for k, v in s.items() if isinstance(v, (int, float)) and k != "epoch"}
        scalars.update({f"mining/seconds_{k}": float(v) for k, v in s["seconds"].items()})
        scalars["mining/embed_per_s_total"] = s["embed_per_s_total"]
        self.writer.scalars(scalars, self.global_step)
        if self.labels is not None:
            sizes = np.bincount(self.labels[self.labels >= 0])
            if len(sizes):
                self.writer.histogram("mining/cluster_sizes", sizes, self.global_step)
        if self.rank == 0:
            q = "".join(f" {k} {s[k]:.3f}" for k in ("nmi", "ari", "pairwise_f", "bcubed_f") if k in s)
            log.info("mining after epoch %d: %d clusters, %d singletons, largest %d, %.2f s;%s",
                     s["epoch"], s["num_clusters"], s["num_singletons"], s["largest_cluster"], s["seconds"]["total"], q)
        self._status(mining=self.mining_history)

    def _evaluate(self) -> None:
        ds = self.task.eval_dataset()
        if ds is None:
            return
        from clusterflow.evaluate import evaluate

        metrics = evaluate(self.task, self.module, ds, self.device, self.amp, self.micro_global // self.world)
        metrics = {k if "/" in k else f"eval/{k}": v for k, v in metrics.items()}
        self.writer.scalars(metrics, self.global_step)
        if self.rank == 0 and metrics:
            log.info("eval after epoch %d: %s", self.epoch + 1, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        self._status(eval=metrics)

    def _finish(self) -> None:
        self._status(state="running")
        if self.rank == 0:
            target = rundir.path(self.run_dir, "model.pt")
            tmp = target + ".tmp"
            with open(tmp, "wb") as f:
                f.write(serialize(self.module.state_dict()))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        dist.barrier()

    def _status(self, **fields: Any) -> None:
        if self.rank == 0:
            rundir.write_status(self.run_dir, epoch=self.epoch, global_step=self.global_step,
                                step_in_epoch=self.step_in_epoch, steps_per_epoch=self.steps_per_epoch, **fields)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def init_weights(model: torch.nn.Module, where: str) -> None:
    """Start from another run's weights (``task.init_from``): a model.pt, a run dir or a checkpoint dir.

    Tensors are matched by name and shape; the rest of the model keeps its fresh initialisation
    (a new classifier head, say). A file that matches nothing is an error, not a silent no-op.
    """
    import fsspec

    from clusterflow.errors import UserError

    fs, path = fsspec.core.url_to_fs(where)
    if fs.isdir(path):
        candidates = [f"{path.rstrip('/')}/model.pt"]
        if not fs.exists(candidates[0]):
            from clusterflow.store import CheckpointStore

            ckpt = CheckpointStore(f"{where.rstrip('/')}/checkpoints").latest()
            if ckpt is None:
                raise UserError(f"task.init_from={where!r} is a folder without model.pt or committed checkpoints; "
                                f"point it at a finished run dir, a checkpoints/step-N folder or a model.pt file")
            candidates = [f"{ckpt.path}/model.pt"]
        path = candidates[0]
    try:
        with fs.open(path, "rb") as f:
            sd = torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"task.init_from={where!r} does not exist; point it at a model.pt, e.g. RUN_DIR/model.pt of stage 1") from None
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        raise UserError(f"task.init_from={where!r}: {path} is not a readable state_dict ({type(exc).__name__}: {exc})") from None
    if not isinstance(sd, dict):
        raise UserError(f"task.init_from={where!r}: {path} holds a {type(sd).__name__}, not a state_dict")
    own = model.state_dict()
    matched = {k: v for k, v in sd.items() if k in own and tuple(own[k].shape) == tuple(v.shape)}
    if not matched:
        raise UserError(f"task.init_from={where!r}: none of its {len(sd)} tensors ({', '.join(list(sd)[:3])}, ...) match the "
                        f"model's names and shapes ({', '.join(list(own)[:3])}, ...); was it written by a different model?")
    model.load_state_dict(matched, strict=False)
    fresh = [k for k in own if k not in matched]
    skipped = [k for k in sd if k not in matched]
    log.info("initialised %d of %d tensors from %s; fresh: %s; not used: %s", len(matched), len(own), path,
             ", ".join(fresh) or "none", ", ".join(skipped) or "none")
