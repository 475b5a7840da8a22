"""The mining stage between epochs; one round reads as its contract (docs/mining.md)::

    embed      every rank embeds its contiguous shard (eval mode, no grad, AMP on GPU); each row
               carries its index
    gather     search=rank0: every row to rank 0 only (dist.gather_rows), placed back by index
    + graph    and rank 0 finds the k nearest others of each (knn.search: FAISS or exact torch);
               search=all: every rank searches its own block against all rows
               (knn.torch_engine.distributed_search) and only the k-NN lists travel to rank 0
               search=sharded: every rank indexes its own shard, query blocks travel a ring
               (knn/sharded.py), and the graph, the curve and the components are computed
               across ranks (sharded_graph.py, sharded_curves.py: Miner._sharded); the labels
               are then gathered and broadcast like rank 0's
    cluster    rank 0: the threshold curve of the mutual graph (curves.py), then mining.method:
               mutual_knn (edges >= the threshold, a number or the curve's "auto", then
               connected components: the very functions behind ``mutual_knn_clusters``) or
               finch (finch.py); stats
    broadcast  labels (int64) from rank 0 on a subgroup whose timeout covers the search

With ``mining.resume`` each rank's embeddings and the finished query blocks are committed to the
run dir as the round goes (rounds.py), so a round cut short continues where it stopped, and a
round leaves the global random streams as it found them (skipping an embedding then changes no
later draw).

"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from clusterflow.checkpoint.rng import capture_rng, restore_rng
from clusterflow.config.sections import DataConfig
from clusterflow.distributed import comm as dist
from clusterflow.distributed import workers
from clusterflow.distributed.groups import Subgroup
from clusterflow.distributed.sampler import shard_range
from clusterflow.errors import RunFailed
from clusterflow.mining import curves, finch, knn
from clusterflow.mining.clustering import (
    cluster_stats,
    clusters_from_graph,
    ignore_singletons,
    normalize,
    tie_warning,
)
from clusterflow.mining.knn import KnnParams, SearchHooks
from clusterflow.mining.knn.sharded import sharded_search
from clusterflow.mining.knn.torch_engine import distributed_search
from clusterflow.mining.mutual_graph import edges_at, mutual_graph
from clusterflow.mining.quality import quality
from clusterflow.mining.rounds import RoundFiles, SearchBlocks, forget_rounds, round_key
from clusterflow.mining.sharded_curves import sharded_resolve
from clusterflow.mining.sharded_graph import mutual_edges, sharded_clusters
from clusterflow.observe import phases
from clusterflow.observe.context import JobContext
from clusterflow.observe.observer import mining_wait_timeout_s
from clusterflow.tasks import Task

log = logging.getLogger("clusterflow.mining")

KnnLists = tuple[np.ndarray, np.ndarray]  # (sims, ids), (N, k) each
# Rank 0: lists (None: aborted), engine, normalised rows (rank0 search).
Found = tuple["KnnLists | None", str, "np.ndarray | None"]


@dataclass
class Round:
    """What one round hands the next epoch (labels) and the logs (stats, the same on every rank
    except ``seconds``, each rank's own)."""

    labels: np.ndarray
    stats: dict[str, Any]


@dataclass(frozen=True)
class EmbeddedShard:
    """This rank's part of a round's embeddings: the dataset ``indices`` it embedded, their rows
    (``emb``), and whether they were read back from the round's files (``reused``)."""

    indices: np.ndarray
    emb: np.ndarray
    reused: bool


class StopVote(Protocol):
    """What a round asks of the trainer's stop agreement (``train.preemption.StopAgreement``):
    ``agree()``, collective, the reason all ranks stop for ("" to go on), at the round's one
    blocking point; ``requested``, this rank's own flag, polled between query blocks."""

    @property
    def requested(self) -> bool: ...

    def agree(self) -> str: ...


def embed_shard(
    task: Task,
    model: torch.nn.Module,
    dataset: Dataset,
    batch: int,
    device: torch.device,
    amp_dtype: torch.dtype | None,
    *,
    data: DataConfig | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """This rank's contiguous shard: (indices, float32 embeddings).

    Built to keep a GPU fed: the DataLoader decodes in ``data.num_workers`` processes into
    pinned memory (``data.pin_memory``; None: in this process, unpinned), batches go to the
    device with non-blocking copies, and each batch's embeddings go back with a non-blocking
    copy into one preallocated (pinned) host array, synchronised once at the end, so the host
    never waits for the device inside the loop. No collective runs here. Indices are the host
    copies of the batch's ``index``, in shard order. ``on_batch(samples)`` is called once per
    batch with its samples (rank 0's progress bar; the heartbeat: a rank stuck in one batch is
    a stall)."""
    shard = shard_range(len(dataset), dist.rank(), dist.world())
    num_workers = data.num_workers if data is not None else 0
    pin = data is not None and data.pin_memory and device.type == "cuda"
    loader = torch.utils.data.DataLoader(
        torch.utils.data.Subset(dataset, list(shard)),
        batch_size=batch,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=pin,
        # A stop signal reaches the workers too: the round stops, they outlive it.
        worker_init_fn=workers.quiet(None) if num_workers else None,
    )
    host: torch.Tensor | None = None
    idx = []
    done = 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for b in workers.started(loader):
            idx.append(b["index"])
            b = {
                k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v
                for k, v in b.items()
            }
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                z = task.embed(model, b).float()
            if host is None:  # the width is known from the first batch
                host = torch.empty((len(shard), *z.shape[1:]), dtype=torch.float32, pin_memory=pin)
            host[done : done + len(z)].copy_(z, non_blocking=True)
            done += len(z)
            if on_batch is not None:
                on_batch(len(z))
    if device.type == "cuda":
        # The one wait: every copy into `host` has landed.
        torch.cuda.current_stream(device).synchronize()
    model.train(was_training)
    if host is None:
        return np.zeros(0, np.int64), np.zeros((0, 1), np.float32)
    return torch.cat(idx).numpy().astype(np.int64), host.numpy()


def _blocks(files: RoundFiles | None) -> SearchBlocks | None:
    return files.search_blocks() if files is not None else None


class Rank0Search:
    """mining.search=rank0: every row gathered to rank 0, which searches alone (FAISS with any
    index, or the exact torch engine on all its GPUs or cores)."""

    def __init__(self, params: KnnParams, keep_rows: bool = False) -> None:
        # keep_rows: hand the rows to the clustering (FINCH).
        self.params, self.keep_rows = params, keep_rows

    def __call__(
        self,
        indices: np.ndarray,
        emb: np.ndarray,
        n: int,
        dim: int,
        *,
        should_abort: Callable[[], bool],
        seconds: dict[str, Any],
        files: RoundFiles | None,
    ) -> Found:
        """Collective. Rank 0 gets the k-NN lists of all n rows (None when aborted), the engine
        used and the normalised rows; ``files``: rank 0 keeps its finished query blocks there."""

        t0 = time.perf_counter()
        full = dist.gather_rows(indices, emb, n, dim)
        seconds["gather"] = time.perf_counter() - t0
        if full is None:
            return None, "", None
        timings: dict[str, Any] = {}
        x, blocks = normalize(full), _blocks(files)
        del full  # rank 0 holds one copy of the rows during the search
        lists = knn.search(x, self.params, should_abort, timings, blocks)
        if blocks is not None:
            blocks.flush()  # on a signal too: the grace period keeps the finished blocks
            seconds.update(blocks_from_disk=blocks.reused, keep_blocks=blocks.seconds)
        if lists is not None:
            seconds.update(index=timings["index"], search=timings["search"])
        return lists, timings["engine"], (x if self.keep_rows else None)


class SpreadSearch:
    """mining.search=all: every rank searches its own block with the exact torch engine (query
    blocks broadcast, partial top-k merged); only the k-NN lists travel to rank 0."""

    def __init__(self, params: KnnParams, device: torch.device) -> None:
        self.params, self.device = params, device

    def __call__(
        self,
        indices: np.ndarray,
        emb: np.ndarray,
        n: int,
        dim: int,
        *,
        should_abort: Callable[[], bool],
        seconds: dict[str, Any],
        files: RoundFiles | None,
    ) -> Found:

        t0 = time.perf_counter()
        world, rank = dist.world(), dist.rank()
        offsets = [shard_range(n, r, world).start for r in range(world)] + [n]
        order = np.argsort(indices, kind="stable")
        if not np.array_equal(indices[order], np.arange(offsets[rank], offsets[rank + 1])):
            raise RuntimeError(
                "mining shards are not the contiguous blocks the distributed search needs; "
                "this is a bug in clusterflow"
            )
        timings: dict[str, Any] = {}
        blocks = _blocks(files)
        local = distributed_search(
            normalize(emb[order]),
            offsets,
            self.params.k,
            self.device,
            query_batch=self.params.query_batch,
            hooks=SearchHooks(should_abort, timings, blocks),
        )
        if blocks is not None:
            blocks.flush()
            seconds.update(blocks_from_disk=timings["blocks_skipped"], keep_blocks=blocks.seconds)
        if local is None:
            return None, "", None  # every rank saw the abort at the same query block
        rows = indices[order]  # the search returns this rank's rows in index order
        sims, ids = (
            dist.gather_rows(rows, local[0], n, self.params.k),
            dist.gather_rows(rows, local[1], n, self.params.k, np.int64),
        )
        seconds.update(
            gather=time.perf_counter() - t0 - timings["index"] - timings["search"],
            index=timings["index"],
            search=timings["search"],
        )
        return (None if sims is None else (sims, ids)), timings["engine"], None


def _offsets_of(indices: np.ndarray, n: int) -> tuple[list[int], np.ndarray]:
    """Every rank's first index (and n), and the order that sorts this rank's rows; the shards
    must be the contiguous blocks ``shard_range`` gives."""
    world, rank = dist.world(), dist.rank()
    offsets = [shard_range(n, r, world).start for r in range(world)] + [n]
    order = np.argsort(indices, kind="stable")
    if not np.array_equal(indices[order], np.arange(offsets[rank], offsets[rank + 1])):
        raise RuntimeError(
            "mining shards are not the contiguous blocks the distributed search needs; "
            "this is a bug in clusterflow"
        )
    return offsets, order


class ShardedSearch:
    """mining.search=sharded: every rank indexes its own shard (any engine and index), query
    blocks travel a ring of ranks (knn/sharded.py); each rank ends with its own rows' lists,
    and the graph, the curve and the components are computed across ranks (``Miner._sharded``)."""

    def __init__(self, params: KnnParams, device: torch.device, tick: Callable[[], None]) -> None:
        self.params, self.device, self.tick = params, device, tick

    def __call__(
        self,
        indices: np.ndarray,
        emb: np.ndarray,
        n: int,
        *,
        should_abort: Callable[[], bool],
        seconds: dict[str, Any],
        files: RoundFiles | None,
    ) -> tuple[KnnLists | None, list[int], str]:
        """Collective: this rank's rows' k-NN lists in index order (None on every rank when
        aborted), every rank's first index, and the engine."""
        offsets, order = _offsets_of(indices, n)
        engine, why = knn.choose_engine(self.params.engine)
        timings: dict[str, Any] = {}
        blocks = _blocks(files)
        local = sharded_search(
            normalize(emb[order]),
            offsets,
            self.params,
            engine,
            self.device if engine == "torch" else "cpu",
            hooks=SearchHooks(should_abort, timings, blocks, self.tick),
        )
        if blocks is not None:
            blocks.flush()  # on a signal too: the grace period keeps the finished blocks
            seconds.update(blocks_from_disk=timings["blocks_skipped"], keep_blocks=blocks.seconds)
        if local is not None:
            seconds.update(
                index=timings["index"], search=timings["search"], exchange=timings["exchange"]
            )
        return local, offsets, f"{timings['engine'][:-1]}; {why})"


class Miner:
    """The mining stage of one trainer: when a round is due, and running it. It reads the job's
    ``mining`` section, the embedding DataLoader's workers and pinned memory (``data``), rank 0's
    progress bar (``train.progress_bar``), where rounds keep their work until their labels are
    committed (the run's mining rounds folder with ``mining.resume``, fsynced as checkpoints
    are), and how long ranks wait for rank 0's search."""

    def __init__(
        self,
        ctx: JobContext,
        device: torch.device,
        amp_dtype: torch.dtype | None,
        stop: StopVote,
    ) -> None:
        job = ctx.cfg
        cfg = job.mining
        self.cfg, self.device, self.amp, self.stop = cfg, device, amp_dtype, stop
        # The data section: worker processes and pinned memory for the embedding's DataLoader.
        self.data = job.data
        self.phases = ctx.phases
        self.progress_bar = job.train.progress_bar
        self.rounds_dir = ctx.paths.mining_rounds if cfg.resume else None
        self.fsync = job.checkpoint.fsync
        # Ranks wait here for rank 0's search: on mining.timeout_s, or longer with the watchdog
        # (observe.observer.mining_wait_timeout_s), so that rank 0's watchdog names a hung search.
        self.group = Subgroup(mining_wait_timeout_s(cfg.timeout_s, job.dist.stall_limit_s))
        self.params = KnnParams.from_config(cfg)
        self.search: Rank0Search | SpreadSearch | ShardedSearch = (
            SpreadSearch(self.params, device)
            if cfg.search == "all" and dist.world() > 1
            else ShardedSearch(self.params, device, self.phases.tick)
            if cfg.search == "sharded"
            else Rank0Search(self.params, keep_rows=cfg.method == "finch")
        )

    def due(self, finished_epochs: int, total_epochs: int, can_embed: bool) -> bool:
        c = self.cfg
        return (
            c.enabled
            and can_embed
            and c.start_epoch <= finished_epochs < total_epochs
            and (finished_epochs - c.start_epoch) % c.every_epochs == 0
        )

    def forget_rounds(self, committed_epoch: int) -> None:
        """Delete the files of the rounds whose labels a committed checkpoint holds (one rank
        calls it)."""
        if self.rounds_dir is not None:
            forget_rounds(self.rounds_dir, committed_epoch)

    def run(self, task: Task, model: torch.nn.Module, epoch: int) -> Round | None:
        """One round, collective. None on every rank when a preemption signal cut it short (the
        caller saves and exits; the round continues from its files on restart)."""
        threads, rng = torch.get_num_threads(), capture_rng()
        try:
            return self._round(task, model, epoch)
        finally:
            # A bitwise resume needs the same thread count before and after.
            torch.set_num_threads(threads)
            # The embed's DataLoader draws a seed; a resumed round may skip the embed.
            restore_rng(rng)

    def _round(self, task: Task, model: torch.nn.Module, epoch: int) -> Round | None:
        dataset = task.embed_dataset()
        n = len(dataset)
        seconds: dict[str, Any] = {}
        files = self._files(model, epoch, n)
        indices, emb, reused = self._embed(task, model, dataset, epoch, files, seconds)
        # Clusters of NaN would look like a result.
        if dist.any_rank(not np.isfinite(emb).all(), device=self.device):
            raise RunFailed(
                f"mining after epoch {epoch}: the embeddings are not finite (NaN or inf) though "
                "every weight is: the forward pass overflows (a diverging run: lower train.lr) or "
                "the task's embed() makes them (a division by a zero norm?); no round was run on "
                "them"
            )
        # On rank 0: into the stats it broadcasts.
        embed_times = dist.gather_object((len(indices), seconds["embed"]))
        if self.stop.agree():
            return None
        if isinstance(self.search, ShardedSearch):
            shard = EmbeddedShard(indices, emb, reused)
            return self._sharded(
                task, shard, n, epoch, embed_times=embed_times, seconds=seconds, files=files
            )
        dim = int(dist.broadcast_object(emb.shape[1] if dist.rank() == 0 else None))
        with self.phases.enter(phases.MINING_SEARCH):
            lists, engine, x = self.search(
                indices,
                emb,
                n,
                dim,
                should_abort=lambda: self.stop.requested,
                seconds=seconds,
                files=files,
            )
            labels, stats = (
                self._cluster(task, lists, x, n, epoch, engine=engine, seconds=seconds)
                if lists is not None
                else (None, None)
            )
        if stats is not None:  # rank 0, which gathered every rank's embedding time
            stats.update(_embed_rates(embed_times, n))
        with self.phases.enter(phases.MINING_WAIT):
            # Waits, on the group's timeout, for rank 0's search.
            stats = self.group.broadcast_object(stats)
            if stats is None:
                return None  # rank 0 aborted the search on a signal
            t3 = time.perf_counter()
            labels = self.group.broadcast_array(labels, n)
            seconds["broadcast"] = time.perf_counter() - t3
        stats["resumed"] = {
            "embeddings": reused,
            "search_blocks": int(seconds.pop("blocks_from_disk", 0)),
        }
        seconds["total"] = sum(seconds.values())
        stats["seconds"] = seconds
        return Round(labels=labels, stats=stats)

    def _sharded(
        self,
        task: Task,
        shard: EmbeddedShard,
        n: int,
        epoch: int,
        *,
        embed_times: list[tuple[int, float]] | None,
        seconds: dict[str, Any],
        files: RoundFiles | None,
    ) -> Round | None:
        """The rest of a mining.search=sharded round, every rank alike: the search, then the
        mutual graph, the curve and the labels across ranks; the labels are then gathered and
        broadcast (the sampler draws any sample on any rank), and the stats computed from them
        on every rank."""
        indices, emb, reused = shard.indices, shard.emb, shard.reused
        c = self.cfg
        with self.phases.enter(phases.MINING_SEARCH):
            lists, offsets, engine = self.search(
                indices,
                emb,
                n,
                should_abort=lambda: self.stop.requested,
                seconds=seconds,
                files=files,
            )
        if lists is None:
            return None  # every rank saw the abort at the same query block
        with self.phases.enter(phases.MINING_GRAPH):
            why = tie_warning(*lists) if len(lists[0]) else None
            if dist.any_rank(why is not None) and dist.rank() == 0:
                log.warning(
                    "mining epoch %d: the embeddings are identical on at least one shard: the "
                    "clusters are made by tie-breaking, not found; lower train.lr, or check the "
                    "task's embed()",
                    epoch,
                )
            t0 = time.perf_counter()
            graph = mutual_edges(*lists, offsets)
            truth = task.ground_truth()
            threshold, curve = sharded_resolve(graph, c.threshold, truth, tick=self.phases.tick)
            t1 = time.perf_counter()
            local, info = sharded_clusters(
                graph, threshold, c.singletons, c.max_cluster_size, tick=self.phases.tick
            )
            seconds.update(curve=t1 - t0, cluster=time.perf_counter() - t1)
        with self.phases.enter(phases.MINING_WAIT):
            t2 = time.perf_counter()
            rows = np.arange(offsets[dist.rank()], offsets[dist.rank() + 1])
            full = dist.gather_rows(rows, local[:, None], n, 1, np.int64)
            labels = self.group.broadcast_array(
                None if full is None else np.ascontiguousarray(full[:, 0]), n
            )
            seconds["broadcast"] = time.perf_counter() - t2
        stats = {
            "epoch": epoch,
            **cluster_stats(labels),
            "engine": engine,
            "num_samples": n,
            "method": c.method,
            "threshold": threshold,
            "threshold_rule": "auto" if c.threshold == "auto" else "fixed",
            "mutual_edges": info["mutual_edges"],
            "hooking_rounds": info["hooking_rounds"],
            "curve": curve.to_dict(),
        }
        if truth is not None:
            stats.update(quality(labels, truth))
        times = dist.broadcast_object(embed_times)
        stats.update(_embed_rates(times, n))
        _log_round(epoch, engine, stats)
        stats["resumed"] = {
            "embeddings": reused,
            "search_blocks": int(seconds.pop("blocks_from_disk", 0)),
        }
        seconds["total"] = sum(seconds.values())
        stats["seconds"] = seconds
        return Round(labels=labels, stats=stats)

    def _files(self, model: torch.nn.Module, epoch: int, n: int) -> RoundFiles | None:
        if self.rounds_dir is None:
            return None
        c = self.cfg
        settings = {
            "knn": dataclasses.asdict(self.params),
            "embed_batch": c.embed_batch,
            "search": c.search,
            "amp": str(self.amp),
            "device": str(self.device.type),
        }
        if c.search != "all":
            settings["engine"] = knn.choose_engine(c.engine)
        key = round_key(model, epoch, dist.world(), n, settings)
        return RoundFiles(self.rounds_dir, epoch, dist.rank(), key, self.fsync)

    def _embed(
        self,
        task: Task,
        model: torch.nn.Module,
        dataset: Dataset,
        epoch: int,
        files: RoundFiles | None,
        seconds: dict[str, Any],
    ) -> tuple[np.ndarray, np.ndarray, bool]:
        """This rank's (indices, rows) and whether they were read back: every rank reads its shard
        back, or every rank embeds (the embed's progress is a collective)."""
        kept = files.load_shard() if files is not None else None
        if not dist.any_rank(kept is None, device=self.device):
            indices, emb, seconds["embed"] = kept
            log.info(
                "mining epoch %d: rank %d read its %d embeddings back from %s",
                epoch,
                dist.rank(),
                len(indices),
                files.dir,
            )
            return indices, emb, True
        if files is not None:
            files.discard()  # another attempt's files, or a partial round: start afresh
        with self.phases.enter(phases.MINING_EMBED):
            t0 = time.perf_counter()
            bar = self._bar(len(dataset), epoch)

            def on_batch(samples: int) -> None:
                # Shards differ by at most one sample: rank 0's bar counts its batches times
                # the world size, so no rank ever waits for another's progress.
                if bar is not None:
                    bar.update(min(samples * dist.world(), bar.total - bar.n))
                self.phases.tick()

            indices, emb = embed_shard(
                task,
                model,
                dataset,
                self.cfg.embed_batch,
                self.device,
                self.amp,
                data=self.data,
                on_batch=on_batch,
            )
            seconds["embed"] = time.perf_counter() - t0
            if bar is not None:
                bar.close()
        if files is not None:
            t1 = time.perf_counter()
            files.save_shard(indices, emb, seconds["embed"])
            seconds["keep_embeddings"] = time.perf_counter() - t1
        return indices, emb, False

    def _bar(self, n: int, epoch: int) -> tqdm | None:
        if dist.rank() != 0 or not self.progress_bar:
            return None
        return tqdm(
            total=n, desc=f"mining epoch {epoch}: embed", unit="img", leave=False, mininterval=1.0
        )

    def _cluster(
        self,
        task: Task,
        lists: KnnLists,
        x: np.ndarray | None,
        n: int,
        epoch: int,
        *,
        engine: str,
        seconds: dict[str, Any],
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Rank 0: labels and their stats from the k-NN lists (and, for FINCH, the rows)."""
        c, truth = self.cfg, task.ground_truth()
        why = tie_warning(*lists)
        if why:
            log.warning("mining epoch %d: %s", epoch, why)
        t0 = time.perf_counter()
        graph = mutual_graph(*lists)
        rule = c.threshold if c.method == "mutual_knn" else "auto"
        threshold, curve = curves.resolve_threshold(*lists, rule, truth, graph)
        t1 = time.perf_counter()
        if c.method == "finch":
            labels, info = finch.finch_clusters(
                x, *lists, search=finch.default_search(self.params), graph=graph
            )
            labels = ignore_singletons(labels) if c.singletons == "ignore" else labels
            found = {"threshold": None, "finch": info, "mutual_edges": len(graph.w)}
        else:
            edges = edges_at(graph, threshold)
            labels = clusters_from_graph(edges, c.singletons, c.max_cluster_size)
            found = {
                "threshold": threshold,
                "threshold_rule": "auto" if rule == "auto" else "fixed",
                "mutual_edges": edges.nnz // 2,
            }
        seconds.update(curve=t1 - t0, cluster=time.perf_counter() - t1)
        stats = {
            "epoch": epoch,
            **cluster_stats(labels),
            "engine": engine,
            "num_samples": n,
            "method": c.method,
            **found,
            "curve": curve.to_dict(),
        }
        if truth is not None:
            stats.update(quality(labels, truth))
        _log_round(epoch, engine, stats)
        return labels, stats


def _embed_rates(times: list[tuple[int, float]], n: int) -> dict[str, Any]:
    """Embedding throughput from each rank's (rows, seconds). Per rank: its shard over its own
    time. Total: every sample over the time of the slowest rank (the ranks start together, and the
    round waits for the last one)."""
    return {
        "embed_per_s_rank": [rows / max(t, 1e-9) for rows, t in times],
        "embed_per_s_total": n / max(max(t for _, t in times), 1e-9),
    }


def _log_round(epoch: int, engine: str, stats: dict[str, Any]) -> None:
    log.info(
        "mining epoch %d: %s engine, %s, %d clusters, %d singletons, largest %d",
        epoch,
        engine,
        _how(stats),
        stats["num_clusters"],
        stats["num_singletons"],
        stats["largest_cluster"],
    )


def _how(stats: dict[str, Any]) -> str:
    """How a round's labels were made, in words (logs and status)."""
    if stats.get("method") == "finch":
        info = stats["finch"]
        return f"FINCH level {info['level']} of {len(info['num_clusters'])}"
    rule = " (auto)" if stats.get("threshold_rule") == "auto" else ""
    return f"threshold {stats['threshold']:.4g}{rule}"


def for_status(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rounds as status.json carries them: the last round's curve thinned to a few dozen
    points, none for the earlier rounds (the checkpoint and TensorBoard keep them all)."""
    out = [{k: v for k, v in m.items() if k != "curve"} for m in history]
    if history and "curve" in history[-1]:
        out[-1]["curve"] = curves.thin(history[-1]["curve"], history[-1].get("threshold"))
    return out
