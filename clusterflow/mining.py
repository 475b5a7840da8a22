"""The mining stage: shard embedding on every rank, rank-0 k-NN graph, mutual-kNN components.

Flow of one round (``mine``)::

    every rank: embed its contiguous shard (eval mode, no grad, AMP on GPU), index travels with row
    gather to rank 0 only (padded for the collective, placed back by index)   -> other ranks O(shard)
    rank 0:     k-NN search (FAISS or the exact torch engine) -> mutual filter -> components
    broadcast:  labels (int64, N) from rank 0 on a group whose timeout covers the search

``mutual_knn_clusters`` is the pure function the stage uses; its definition is a contract
(docs/mining.md): cosine similarity on L2-normalised rows; edge i-j kept iff j is among i's k
nearest others, i among j's, and similarity >= threshold; labels are connected components
numbered 0..C-1 in order of each component's smallest member.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any, Callable

import numpy as np
from scipy import sparse
from scipy.sparse.csgraph import connected_components

log = logging.getLogger("clusterflow.mining")


# ---------------------------------------------------------------------------------------------
# The pure function


def normalize(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


def knn_graph(x: np.ndarray, k: int, index: str = "flat", engine: str = "auto", query_batch: int = 65536,
              should_abort: Callable[[], bool] | None = None, timings: dict | None = None,
              **index_args: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """k nearest others of every (already normalised) row, with the chosen engine."""
    from clusterflow import knn

    name, why = knn.choose_engine(engine)
    if timings is not None:
        timings["engine"] = f"{name} ({why})"
    if name == "torch":
        if index != "flat":
            log.info("the torch engine is exact; mining.index=%s applies to faiss only", index)
        return knn.torch_search(x, k, query_batch=query_batch, should_abort=should_abort, timings=timings)
    return knn.faiss_search(x, k, query_batch=query_batch, should_abort=should_abort, timings=timings, index=index, **index_args)


def mutual_edges(sims: np.ndarray, ids: np.ndarray, threshold: float) -> sparse.csr_matrix:
    """Symmetric sparse matrix of the mutual k-NN edges with similarity >= threshold."""
    n, k = ids.shape
    rows = np.repeat(np.arange(n, dtype=np.int64), k)
    cols = ids.ravel()
    keep = (cols >= 0) & (sims.ravel() >= threshold)
    rows, cols, vals = rows[keep], cols[keep], sims.ravel()[keep]
    a = sparse.csr_matrix((np.ones(len(rows), np.int8), (rows, cols)), shape=(n, n))
    w = sparse.csr_matrix((vals.astype(np.float32), (rows, cols)), shape=(n, n))
    mutual = a.multiply(a.T)  # 1 where i->j and j->i
    return w.multiply(mutual).tocsr()


def number_by_smallest_member(labels: np.ndarray) -> np.ndarray:
    """Renumber so component c is the one whose smallest member is the c-th smallest."""
    _, first = np.unique(labels, return_index=True)
    order = np.argsort(first)
    remap = np.empty_like(order)
    remap[order] = np.arange(len(order))
    _, inv = np.unique(labels, return_inverse=True)
    return remap[inv].astype(np.int64)


def _split_large(graph: sparse.csr_matrix, labels: np.ndarray, max_size: int) -> np.ndarray:
    """Split components larger than ``max_size`` by raising the threshold inside each of them.

    Each round drops the weakest quarter of a too-large piece's remaining edges (at least one
    edge, so it always ends) and looks at its components again; small enough pieces are final.
    """
    labels = labels.copy()
    next_label = int(labels.max()) + 1
    stack: list[tuple[np.ndarray, sparse.csr_matrix]] = [
        (m, graph[m][:, m].tocsr()) for m in (np.flatnonzero(labels == c) for c, size in enumerate(np.bincount(labels)) if size > max_size)
    ]
    while stack:
        members, sub = stack.pop()
        if sub.nnz == 0:
            continue
        sub = sub.copy()
        sub.data[sub.data <= np.quantile(sub.data, 0.25)] = 0
        sub.eliminate_zeros()
        ncomp, parts = connected_components(sub, directed=False)
        if ncomp == 1:
            stack.append((members, sub))
            continue
        for p in range(ncomp):
            inside = parts == p
            labels[members[inside]] = next_label
            next_label += 1
            if inside.sum() > max_size:
                stack.append((members[inside], sub[inside][:, inside].tocsr()))
    return labels


def clusters_from_graph(graph: sparse.csr_matrix, singletons: str = "cluster", max_cluster_size: int = 0) -> np.ndarray:
    _, labels = connected_components(graph, directed=False)
    if max_cluster_size:
        labels = _split_large(graph, labels, max_cluster_size)
    labels = number_by_smallest_member(labels)
    if singletons == "ignore":
        sizes = np.bincount(labels)
        single = sizes[labels] == 1
        labels = np.where(single, -1, labels)
        kept = labels >= 0
        if kept.any():
            labels[kept] = number_by_smallest_member(labels[kept])
    return labels


def mutual_knn_clusters(embeddings: np.ndarray, k: int, threshold: float, index: str = "flat", *,
                        engine: str = "auto", singletons: str = "cluster", max_cluster_size: int = 0,
                        query_batch: int = 65536, timings: dict | None = None, **index_args: Any) -> np.ndarray:
    """Pseudo-labels from the mutual k-NN graph (see the module docstring for the definition).

    ``embeddings``: float32 (N, d). Returns int64 (N,). With ``singletons="ignore"`` samples
    without any kept edge get -1; ``max_cluster_size`` splits giant chained components.
    """
    emb = np.asarray(embeddings)
    if emb.ndim != 2 or emb.shape[0] == 0:
        raise ValueError(f"embeddings must be a non-empty (N, d) array, got shape {emb.shape}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    timings = {} if timings is None else timings
    t0 = time.perf_counter()
    x = normalize(emb)
    timings["normalize"] = time.perf_counter() - t0
    result = knn_graph(x, k, index=index, engine=engine, query_batch=query_batch, timings=timings, **index_args)
    assert result is not None  # no abort callback here
    t1 = time.perf_counter()
    graph = mutual_edges(*result, threshold)
    labels = clusters_from_graph(graph, singletons, max_cluster_size)
    timings["cluster"] = time.perf_counter() - t1
    return labels


def cluster_stats(labels: np.ndarray) -> dict[str, Any]:
    kept = labels[labels >= 0]
    sizes = np.bincount(kept) if len(kept) else np.zeros(0, np.int64)
    edges = [1, 2, 3, 5, 10, 20, 50, 100, 1000, 10**9]
    hist, _ = np.histogram(sizes, bins=edges)
    return {
        "num_clusters": int(len(sizes) + (labels < 0).sum()),
        "num_singletons": int((sizes == 1).sum() + (labels < 0).sum()),
        "largest_cluster": int(sizes.max()) if len(sizes) else 1,
        "size_histogram": {f"{lo}-{hi - 1}" if hi - 1 != lo else str(lo): int(h) for lo, hi, h in zip(edges[:-1], edges[1:], hist)},
    }


# ---------------------------------------------------------------------------------------------
# The distributed stage


def embed_shard(task: Any, model: Any, dataset: Any, rank: int, world: int, batch: int, device: Any,
                amp_dtype: Any, progress: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """This rank's contiguous shard: (indices, float32 embeddings). Every rank runs the same number
    of loop turns (shards differ by at most one sample), so the progress all-reduce lines up."""
    import torch

    from clusterflow import dist
    from clusterflow.sampler import shard_range

    n = len(dataset)
    shard = shard_range(n, rank, world)
    max_shard = -(-n // world)
    turns = -(-max_shard // batch)
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, list(shard)), batch_size=batch, shuffle=False)
    it = iter(loader)
    out, idx = [], []
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for _ in range(turns):
            b = next(it, None)
            done = 0
            if b is not None:
                b = {k: v.to(device, non_blocking=True) if hasattr(v, "to") else v for k, v in b.items()}
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    z = task.embed(model, b)
                out.append(z.float().cpu())
                idx.append(b["index"].cpu())
                done = len(b["index"])
            total = dist.all_reduce_dict({"n": done})["n"]
            if progress is not None:
                progress.update(int(total))
    model.train(was_training)
    if not out:
        return np.zeros(0, np.int64), np.zeros((0, 1), np.float32)
    return torch.cat(idx).numpy().astype(np.int64), torch.cat(out).numpy()


def gather_to_main(indices: np.ndarray, emb: np.ndarray, n: int, dim: int, dtype: Any = np.float32) -> np.ndarray | None:
    """Rank 0 receives every shard and places rows by index; others get None and keep O(shard).

    The collective needs equal sizes (gloo refuses uneven ones), so shards are padded to the
    largest with index -1 and trimmed by index on arrival.
    """
    import torch
    import torch.distributed as tdist

    from clusterflow import dist

    if not dist._initialized():
        full = np.zeros((n, dim), dtype)
        full[indices] = emb
        return full
    world, rank = dist.world(), dist.rank()
    pad = -(-n // world)
    e = torch.zeros((pad, dim), dtype=torch.from_numpy(np.zeros(0, dtype)).dtype)
    i = torch.full((pad,), -1, dtype=torch.int64)
    e[: len(indices)] = torch.from_numpy(emb) if len(indices) else e[:0]
    i[: len(indices)] = torch.from_numpy(indices)
    backend = tdist.get_backend()
    if backend == "nccl":
        e, i = e.cuda(), i.cuda()
    es = [torch.empty_like(e) for _ in range(world)] if rank == 0 else None
    is_ = [torch.empty_like(i) for _ in range(world)] if rank == 0 else None
    tdist.gather(e, es, dst=0)
    tdist.gather(i, is_, dst=0)
    if rank != 0:
        return None
    full = np.zeros((n, dim), dtype)
    seen = np.zeros(n, bool)
    for ee, ii in zip(es, is_):
        ii = ii.cpu().numpy()
        ok = ii >= 0
        full[ii[ok]] = ee.cpu().numpy()[ok]
        seen[ii[ok]] = True
    if not seen.all():
        raise RuntimeError(f"mining gather lost {int((~seen).sum())} samples; this is a bug in clusterflow")
    return full


class MiningGroup:
    """A gloo group with the mining timeout: ranks wait in it while rank 0 searches, which can
    take far longer than the default process-group timeout."""

    def __init__(self, timeout_s: int) -> None:
        from clusterflow import dist

        self.group = None
        if dist._initialized():
            import torch.distributed as tdist

            self.group = tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def broadcast_object(self, obj: Any) -> Any:
        if self.group is None:
            return obj
        import torch.distributed as tdist

        box = [obj]
        tdist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def broadcast_labels(self, labels: np.ndarray | None, n: int) -> np.ndarray:
        if self.group is None:
            assert labels is not None
            return labels
        import torch
        import torch.distributed as tdist

        t = torch.from_numpy(labels) if labels is not None else torch.empty(n, dtype=torch.int64)
        tdist.broadcast(t, src=0, group=self.group)
        return t.numpy()


def _search_everywhere(indices: np.ndarray, emb: np.ndarray, n: int, cfg: Any, device: Any, preemption: Any,
                       timings: dict[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """mining.search=all: this rank's rows' k-NN over the whole set, from knn.distributed_search."""
    from clusterflow import dist
    from clusterflow.knn import distributed_search
    from clusterflow.sampler import shard_range

    world = dist.world()
    offsets = [shard_range(n, r, world).start for r in range(world)] + [n]
    mine_ = np.arange(offsets[dist.rank()], offsets[dist.rank() + 1])
    order = np.argsort(indices, kind="stable")
    if not np.array_equal(indices[order], mine_):
        raise RuntimeError("mining shards are not the contiguous blocks the distributed search needs; this is a bug in clusterflow")
    return distributed_search(normalize(emb[order]), offsets, cfg.k, device, query_batch=cfg.query_batch,
                              should_abort=lambda: preemption.requested, timings=timings)


def mine(task: Any, model: Any, cfg: Any, device: Any, amp_dtype: Any, group: MiningGroup,
         preemption: Any, epoch: int, progress_bar: bool = True) -> dict[str, Any] | None:
    """One round. Returns {"labels", "stats"} on every rank, or None when a preemption signal cut
    it short (the caller saves and exits; the round is redone on restart)."""
    from clusterflow import dist

    rank, world = dist.rank(), dist.world()
    dataset = task.embed_dataset()
    n = len(dataset)
    phases: dict[str, Any] = {}
    bar = None
    if rank == 0 and progress_bar:
        from tqdm import tqdm

        bar = tqdm(total=n, desc=f"mining epoch {epoch}: embed", unit="img", leave=False, mininterval=1.0)
    t0 = time.perf_counter()
    indices, emb = embed_shard(task, model, dataset, rank, world, cfg.embed_batch, device, amp_dtype, bar)
    phases["embed"] = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    rates = dist.gather_object(len(indices) / max(phases["embed"], 1e-9))
    if preemption.agree(device) != "":
        return None
    dim = int(dist.broadcast_object(emb.shape[1] if rank == 0 else None))
    timings: dict[str, Any] = {}
    t1 = time.perf_counter()
    spread = cfg.search == "all" and world > 1
    if spread:
        # Every rank searches its own block; only the k-NN lists travel to rank 0.
        local = _search_everywhere(indices, emb, n, cfg, device, preemption, timings)
        if local is None:
            return None  # every rank saw the abort at the same query block
        rows = np.sort(indices)  # the search returns this rank's rows in index order
        result = (gather_to_main(rows, local[0], n, cfg.k), gather_to_main(rows, local[1], n, cfg.k, np.int64))
        phases["gather"] = time.perf_counter() - t1 - timings["index"] - timings["search"]
    else:
        full = gather_to_main(indices, emb, n, dim)
        phases["gather"] = time.perf_counter() - t1
    labels, stats = None, None
    if rank == 0:
        if not spread:
            assert full is not None
            x = normalize(full)
            result = knn_graph(x, cfg.k, index=cfg.index, engine=cfg.engine, query_batch=cfg.query_batch,
                               should_abort=lambda: preemption.requested, timings=timings, nlist=cfg.nlist,
                               nprobe=cfg.nprobe, hnsw_m=cfg.hnsw_m, ef_search=cfg.ef_search)
        if result is not None:
            t2 = time.perf_counter()
            graph = mutual_edges(*result, cfg.threshold)
            labels = clusters_from_graph(graph, cfg.singletons, cfg.max_cluster_size)
            phases.update(index=timings["index"], search=timings["search"], cluster=time.perf_counter() - t2)
            stats = {"epoch": epoch, **cluster_stats(labels), "engine": timings["engine"], "num_samples": n,
                     "mutual_edges": int(graph.nnz // 2)}
            truth = task.ground_truth()
            if truth is not None:
                from clusterflow.cluster_metrics import quality

                stats.update(quality(labels, truth))
            log.info("mining epoch %d: %s engine, %d clusters, %d singletons, largest %d",
                     epoch, timings["engine"], stats["num_clusters"], stats["num_singletons"], stats["largest_cluster"])
    stats = group.broadcast_object(stats)  # waits, on the mining timeout, for rank 0's search
    if stats is None:
        return None  # rank 0 aborted the search on a signal
    t3 = time.perf_counter()
    labels = group.broadcast_labels(labels, n)
    phases["broadcast"] = time.perf_counter() - t3
    phases["total"] = sum(v for k, v in phases.items() if k != "total")
    stats["seconds"] = phases
    stats["embed_per_s_rank"] = [float(r) for r in rates] if rates else []
    stats["embed_per_s_total"] = n / max(phases["embed"], 1e-9)
    return {"labels": labels, "stats": stats}
