"""The mining stage between epochs; one round reads as its contract (docs/mining.md)::

    embed      every rank embeds its contiguous shard (eval mode, no grad, AMP on GPU); each row
               carries its index
    gather     search=rank0: every row to rank 0 only (dist.gather_rows), placed back by index
    + graph    and rank 0 finds the k nearest others of each (knn.search: FAISS or exact torch);
               search=all: every rank searches its own block against all rows
               (knn_torch.distributed_search) and only the k-NN lists travel to rank 0
    cluster    rank 0: mutual edges >= threshold, connected components (clustering.py, the very
               functions behind ``mutual_knn_clusters``), stats
    broadcast  labels (int64) from rank 0 on a subgroup whose timeout covers the search

``mutual_knn_clusters``, ``normalize`` and ``cluster_stats`` are re-exported from clustering.py:
``clusterflow.mining.mutual_knn_clusters`` is a public contract.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from clusterflow import dist, phases
from clusterflow.clustering import cluster_stats, clusters_from_knn, mutual_knn_clusters, normalize  # noqa: F401 - re-exported
from clusterflow.knn import KnnParams

log = logging.getLogger("clusterflow.mining")

KnnLists = tuple[np.ndarray, np.ndarray]  # (sims, ids), (N, k) each


@dataclass
class Round:
    """What one round hands the next epoch (labels) and the logs (stats, the same on every rank
    except ``seconds``, each rank's own)."""

    labels: np.ndarray
    stats: dict[str, Any]


def embed_shard(task: Any, model: Any, dataset: Any, rank: int, world: int, batch: int, device: Any,
                amp_dtype: Any, progress: Any = None, num_workers: int = 0, pin_memory: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """This rank's contiguous shard: (indices, float32 embeddings).

    Built to keep a GPU fed: the DataLoader decodes in ``num_workers`` processes into pinned
    memory, batches go to the device with non-blocking copies, and each batch's embeddings go
    back with a non-blocking copy into one preallocated (pinned) host array, synchronised once at
    the end, so the host never waits for the device inside the loop. No collective runs here:
    ``progress`` (rank 0's bar) advances by this rank's batches times the world size (shards
    differ by at most one sample), so no rank ever waits for another's progress. Indices are the
    host copies of the batch's ``index``, in shard order."""
    import torch

    from clusterflow.sampler import shard_range

    shard = shard_range(len(dataset), rank, world)
    pin = pin_memory and device.type == "cuda"
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, list(shard)), batch_size=batch, shuffle=False,
                                         num_workers=num_workers, pin_memory=pin)
    host: Any = None
    idx = []
    done = 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for b in loader:
            idx.append(b["index"])
            b = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in b.items()}
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                z = task.embed(model, b).float()
            if host is None:  # the width is known from the first batch
                host = torch.empty((len(shard), *z.shape[1:]), dtype=torch.float32, pin_memory=pin)
            host[done : done + len(z)].copy_(z, non_blocking=True)
            done += len(z)
            if progress is not None:
                progress.update(min(len(z) * world, progress.total - progress.n))
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the one wait: every copy into `host` has landed
    model.train(was_training)
    if host is None:
        return np.zeros(0, np.int64), np.zeros((0, 1), np.float32)
    return torch.cat(idx).numpy().astype(np.int64), host.numpy()


class Rank0Search:
    """mining.search=rank0: every row gathered to rank 0, which searches alone (FAISS with any
    index, or the exact torch engine on all its GPUs or cores)."""

    def __init__(self, params: KnnParams) -> None:
        self.params = params

    def __call__(self, indices: np.ndarray, emb: np.ndarray, n: int, dim: int, should_abort: Callable[[], bool],
                 seconds: dict[str, float]) -> tuple[KnnLists | None, str]:
        """Collective. Rank 0 gets the k-NN lists of all n rows (None when aborted) and the engine used."""
        from clusterflow import knn

        t0 = time.perf_counter()
        full = dist.gather_rows(indices, emb, n, dim)
        seconds["gather"] = time.perf_counter() - t0
        if full is None:
            return None, ""
        timings: dict[str, Any] = {}
        lists = knn.search(normalize(full), self.params, should_abort, timings)
        if lists is not None:
            seconds.update(index=timings["index"], search=timings["search"])
        return lists, timings["engine"]


class SpreadSearch:
    """mining.search=all: every rank searches its own block with the exact torch engine (query
    blocks broadcast, partial top-k merged); only the k-NN lists travel to rank 0."""

    def __init__(self, params: KnnParams, device: Any) -> None:
        self.params, self.device = params, device

    def __call__(self, indices: np.ndarray, emb: np.ndarray, n: int, dim: int, should_abort: Callable[[], bool],
                 seconds: dict[str, float]) -> tuple[KnnLists | None, str]:
        from clusterflow.knn_torch import distributed_search
        from clusterflow.sampler import shard_range

        t0 = time.perf_counter()
        world, rank = dist.world(), dist.rank()
        offsets = [shard_range(n, r, world).start for r in range(world)] + [n]
        order = np.argsort(indices, kind="stable")
        if not np.array_equal(indices[order], np.arange(offsets[rank], offsets[rank + 1])):
            raise RuntimeError("mining shards are not the contiguous blocks the distributed search needs; this is a bug in clusterflow")
        timings: dict[str, Any] = {}
        local = distributed_search(normalize(emb[order]), offsets, self.params.k, self.device,
                                   query_batch=self.params.query_batch, should_abort=should_abort, timings=timings)
        if local is None:
            return None, ""  # every rank saw the abort at the same query block
        rows = indices[order]  # the search returns this rank's rows in index order
        sims, ids = (dist.gather_rows(rows, local[0], n, self.params.k), dist.gather_rows(rows, local[1], n, self.params.k, np.int64))
        seconds.update(gather=time.perf_counter() - t0 - timings["index"] - timings["search"],
                       index=timings["index"], search=timings["search"])
        return (None if sims is None else (sims, ids)), timings["engine"]


class Miner:
    """The mining stage of one trainer: when a round is due, and running it."""

    def __init__(self, cfg: Any, device: Any, amp_dtype: Any, stop: Any, tracker: phases.Phases | None = None,
                 progress_bar: bool = True, data: Any = None) -> None:
        self.cfg, self.device, self.amp, self.stop = cfg, device, amp_dtype, stop
        # The data section: worker processes and pinned memory for the embedding's DataLoader.
        self.loader_args = {"num_workers": data.num_workers, "pin_memory": data.pin_memory} if data is not None else {}
        self.phases = tracker or phases.Phases()
        self.progress_bar = progress_bar
        self.group = dist.Subgroup(cfg.timeout_s)  # ranks wait here, on the mining timeout, for rank 0's search
        params = KnnParams.from_config(cfg)
        self.search = SpreadSearch(params, device) if cfg.search == "all" and dist.world() > 1 else Rank0Search(params)

    def due(self, finished_epochs: int, total_epochs: int, can_embed: bool) -> bool:
        c = self.cfg
        return (c.enabled and can_embed and c.start_epoch <= finished_epochs < total_epochs
                and (finished_epochs - c.start_epoch) % c.every_epochs == 0)

    def run(self, task: Any, model: Any, epoch: int) -> Round | None:
        """One round, collective. None on every rank when a preemption signal cut it short (the
        caller saves and exits; the round is redone on restart)."""
        import torch

        threads = torch.get_num_threads()
        try:
            return self._round(task, model, epoch)
        finally:
            torch.set_num_threads(threads)  # bitwise resume needs the same thread count before and after

    def _round(self, task: Any, model: Any, epoch: int) -> Round | None:
        rank, world = dist.rank(), dist.world()
        dataset = task.embed_dataset()
        n = len(dataset)
        seconds: dict[str, float] = {}
        with self.phases.enter(phases.MINING_EMBED):
            t0 = time.perf_counter()
            bar = self._bar(n, epoch)
            indices, emb = embed_shard(task, model, dataset, rank, world, self.cfg.embed_batch, self.device, self.amp, bar,
                                       **self.loader_args)
            seconds["embed"] = time.perf_counter() - t0
            if bar is not None:
                bar.close()
        embed_times = dist.gather_object((len(indices), seconds["embed"]))  # on rank 0: into the stats it broadcasts
        if self.stop.agree():
            return None
        dim = int(dist.broadcast_object(emb.shape[1] if rank == 0 else None))
        with self.phases.enter(phases.MINING_SEARCH):
            lists, engine = self.search(indices, emb, n, dim, lambda: self.stop.requested, seconds)
        labels, stats = self._cluster(task, lists, n, epoch, engine, seconds) if lists is not None else (None, None)
        if stats is not None:  # rank 0, which gathered every rank's embedding time
            # Per rank: its shard over its own time. Total: every sample over the time of the
            # slowest rank (the ranks start together, and the round waits for the last one).
            stats["embed_per_s_rank"] = [rows / max(t, 1e-9) for rows, t in embed_times]
            stats["embed_per_s_total"] = n / max(max(t for _, t in embed_times), 1e-9)
        with self.phases.enter(phases.MINING_WAIT):
            stats = self.group.broadcast_object(stats)  # waits, on the mining timeout, for rank 0's search
            if stats is None:
                return None  # rank 0 aborted the search on a signal
            t3 = time.perf_counter()
            labels = self.group.broadcast_array(labels, n)
            seconds["broadcast"] = time.perf_counter() - t3
        seconds["total"] = sum(seconds.values())
        stats["seconds"] = seconds
        return Round(labels=labels, stats=stats)

    def _bar(self, n: int, epoch: int) -> Any:
        if dist.rank() != 0 or not self.progress_bar:
            return None
        from tqdm import tqdm

        return tqdm(total=n, desc=f"mining epoch {epoch}: embed", unit="img", leave=False, mininterval=1.0)

    def _cluster(self, task: Any, lists: KnnLists, n: int, epoch: int, engine: str,
                 seconds: dict[str, float]) -> tuple[np.ndarray, dict[str, Any]]:
        """Rank 0: labels and their stats from the k-NN lists."""
        t0 = time.perf_counter()
        labels, edges = clusters_from_knn(*lists, self.cfg.threshold, self.cfg.singletons, self.cfg.max_cluster_size)
        seconds["cluster"] = time.perf_counter() - t0
        stats = {"epoch": epoch, **cluster_stats(labels), "engine": engine, "num_samples": n, "mutual_edges": edges}
        truth = task.ground_truth()
        if truth is not None:
            from clusterflow.cluster_metrics import quality

            stats.update(quality(labels, truth))
        log.info("mining epoch %d: %s engine, %d clusters, %d singletons, largest %d",
                 epoch, engine, stats["num_clusters"], stats["num_singletons"], stats["largest_cluster"])
        return labels, stats
