"""k nearest neighbours by inner product on L2-normalised rows: FAISS or an exact torch engine.

Both return, for every row, its ``k`` nearest *other* rows (self excluded) as ``(sims, ids)``
arrays of shape (N, k), most similar first; missing neighbours (N <= k) are id -1, sim -inf.
Queries are processed in batches of ``query_batch`` to bound memory, and ``should_abort`` is
polled between batches so a preemption signal can cut a long search short.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import numpy as np

log = logging.getLogger("clusterflow.knn")


def faiss_available() -> bool:
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


def choose_engine(requested: str) -> tuple[str, str]:
    """Which engine runs, and why (logged with every mining round)."""
    import torch

    if requested == "faiss":
        if not faiss_available():
            raise RuntimeError("mining.engine=faiss but faiss is not installed; pip install faiss-cpu, or set mining.engine=torch")
        return "faiss", "asked for by mining.engine"
    if requested == "torch":
        return "torch", "asked for by mining.engine"
    if faiss_available():
        import faiss

        if torch.cuda.is_available() and not hasattr(faiss, "StandardGpuResources"):
            return "torch", "CUDA is available but this faiss build has no GPU support; the exact torch engine uses the GPU"
        return "faiss", "faiss is installed" + (" with GPU support" if hasattr(faiss, "StandardGpuResources") else " (CPU build)")
    return "torch", "faiss is not installed"


def _drop_self(sims: np.ndarray, ids: np.ndarray, start: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Remove each query's own id from its k+1 results, keeping k."""
    q = np.arange(start, start + ids.shape[0])[:, None]
    is_self = ids == q
    # Rows where self was not returned (duplicates outranked it): drop the last column instead.
    no_self = ~is_self.any(1)
    is_self[no_self, -1] = True
    keep = ~is_self
    return sims[keep].reshape(len(ids), k), ids[keep].reshape(len(ids), k)


def _k_others(best_s: Any, best_i: Any, start: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top k+1 (or fewer, when the set is that small) of queries ``start..`` (numpy arrays or
    tensors), as numpy padded to k+1 columns, without each query itself: its k nearest others."""
    s_np, i_np = (t.cpu().numpy() if hasattr(t, "cpu") else t for t in (best_s, best_i))
    missing = k + 1 - s_np.shape[1]
    if missing > 0:
        s_np = np.pad(s_np, ((0, 0), (0, missing)), constant_values=-np.inf)
        i_np = np.pad(i_np, ((0, 0), (0, missing)), constant_values=-1)
    return _drop_self(s_np, i_np, start, k)


def build_faiss_index(x: np.ndarray, index: str = "flat", nlist: int = 1024, nprobe: int = 16,
                      hnsw_m: int = 32, ef_search: int = 128, use_gpu: bool = True):
    import faiss

    d = x.shape[1]
    if index == "flat":
        idx = faiss.IndexFlatIP(d)
    elif index == "ivf":
        nlist = max(1, min(nlist, x.shape[0] // 39 or 1))  # faiss wants >= 39 training points per list
        quant = faiss.IndexFlatIP(d)
        idx = faiss.IndexIVFFlat(quant, d, nlist, faiss.METRIC_INNER_PRODUCT)
        idx.train(x)
        idx.nprobe = min(nprobe, nlist)
    elif index == "hnsw":
        idx = faiss.IndexHNSWFlat(d, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        idx.hnsw.efSearch = ef_search
    else:
        raise ValueError(f"unknown index {index!r}")
    if use_gpu and hasattr(faiss, "index_cpu_to_all_gpus") and faiss.get_num_gpus() > 0 and index != "hnsw":
        idx = faiss.index_cpu_to_all_gpus(idx)  # shards the database over every local GPU
    idx.add(x)
    return idx


def faiss_search(x: np.ndarray, k: int, query_batch: int = 65536, should_abort: Callable[[], bool] | None = None,
                 timings: dict | None = None, **index_args) -> tuple[np.ndarray, np.ndarray] | None:
    import faiss

    # All cores for the search, then the previous setting back: the OpenMP runtime is shared
    # with torch, and a changed thread count changes float summation order in training (a
    # resumed run would then drift from an uninterrupted one in the last bits).
    previous = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(os.cpu_count() or 1)
    try:
        return _faiss_search(x, k, query_batch, should_abort, timings, **index_args)
    finally:
        faiss.omp_set_num_threads(previous)


def _faiss_search(x, k, query_batch, should_abort, timings, **index_args):
    import time

    t0 = time.perf_counter()
    idx = build_faiss_index(x, **index_args)
    t1 = time.perf_counter()
    kk = min(k + 1, x.shape[0])
    sims = np.empty((x.shape[0], k), np.float32)
    ids = np.empty((x.shape[0], k), np.int64)
    for start in range(0, x.shape[0], query_batch):
        if should_abort and should_abort():
            return None
        s, i = _k_others(*idx.search(x[start : start + query_batch], kk), start, k)
        sims[start : start + len(s)], ids[start : start + len(s)] = s, i
    if timings is not None:
        timings["index"] = t1 - t0
        timings["search"] = time.perf_counter() - t1
    return sims, ids


def _sorted_top(best_s: Any, best_i: Any, keep: int) -> tuple[Any, Any]:
    """The ``keep`` best per row: similarity descending, ties by the smaller id (a stable sort)."""
    import torch

    order = torch.argsort(best_i, dim=1)
    best_s, best_i = torch.gather(best_s, 1, order), torch.gather(best_i, 1, order)
    order = torch.argsort(-best_s, dim=1, stable=True)
    return torch.gather(best_s, 1, order)[:, :keep], torch.gather(best_i, 1, order)[:, :keep]


def _topk_block(q32: Any, q_c: Any, db32: Any, db_c: Any, cand: int, keep: int, db_chunk: int, id_offset: int) -> tuple[Any, Any]:
    """Exact top-``keep`` of the query block against the database block (ids shifted by
    ``id_offset``): ``cand`` candidates per query scored in the candidate dtype, re-ranked in fp32."""
    import torch

    n = db32.shape[0]
    best_s, best_i = None, None
    for ds in range(0, n, db_chunk):
        s = q_c @ db_c[ds : ds + db_chunk].T
        sv, si = torch.topk(s.float(), min(cand, s.shape[1]), dim=1)
        si = si + ds
        if best_s is None:
            best_s, best_i = sv, si
        else:
            best_s, order = torch.topk(torch.cat([best_s, sv], 1), min(cand, best_s.shape[1] + sv.shape[1]), dim=1)
            best_i = torch.gather(torch.cat([best_i, si], 1), 1, order)
    # Re-rank the candidates in fp32 with one dot product per pair: exact when candidates were
    # scored in bf16, and independent of the block shapes (a matmul's summation order changes
    # with them), so one device, several devices and several ranks give bitwise the same result.
    best_s = (q32.unsqueeze(1) * db32[best_i]).sum(-1)
    best_s, best_i = _sorted_top(best_s, best_i, keep)
    return best_s, best_i + id_offset


def torch_search(x: np.ndarray, k: int, query_batch: int = 65536, should_abort: Callable[[], bool] | None = None,
                 timings: dict | None = None, device: str | list[str] | None = None, db_chunk: int = 262144,
                 candidate_dtype: str = "auto") -> tuple[np.ndarray, np.ndarray] | None:
    """Exact k-NN with chunked matrix products and top-k.

    On GPU the candidates are scored in bf16 (fast tensor cores), on CPU in fp32; ``2k + 16`` of
    them are kept per query and re-ranked in fp32, so the returned neighbours and similarities
    are the fp32 ones. Ties are broken by the smaller id, like a stable sort.

    ``device`` may name several devices: by default every visible GPU (else the CPU). Each holds a
    copy of the database and takes every n-th query batch, on its own thread (CUDA kernels and
    copies release the GIL), so the search scales with the GPUs of rank 0's node.
    """
    import threading
    import time

    import torch

    t0 = time.perf_counter()
    if device is None:
        devices = [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())] or [torch.device("cpu")]
    else:
        devices = [torch.device(d) for d in ([device] if isinstance(device, str) else device)]
    if candidate_dtype == "auto":
        candidate_dtype = "bf16" if devices[0].type == "cuda" else "fp32"
    replicas = []
    for dev in devices:
        db32 = torch.from_numpy(np.ascontiguousarray(x)).to(dev)
        replicas.append((db32, db32.to(torch.bfloat16) if candidate_dtype == "bf16" else db32))
    n = x.shape[0]
    kk = min(k + 1, n)
    cand = min(n, 2 * kk + 16)  # a margin over k+1, so near-ties at the cut are re-ranked exactly
    # Bound one score block (queries x database chunk) to 2**26 floats (256 MB in fp32).
    db_chunk = min(db_chunk, 65536)
    query_batch = max(1, min(query_batch, (1 << 26) // db_chunk))
    t1 = time.perf_counter()
    sims_out = np.full((n, k), -np.inf, np.float32)
    ids_out = np.full((n, k), -1, np.int64)
    starts = list(range(0, n, query_batch))
    aborted = threading.Event()
    failures: list[BaseException] = []

    def one_block(qs: int, db32: Any, db_c: Any) -> None:
        best_s, best_i = _topk_block(db32[qs : qs + query_batch], db_c[qs : qs + query_batch], db32, db_c, cand, kk, db_chunk, 0)
        s_np, i_np = _k_others(best_s, best_i, qs, k)
        sims_out[qs : qs + len(s_np)], ids_out[qs : qs + len(s_np)] = s_np, i_np  # disjoint rows per block

    def worker(slot: int) -> None:
        db32, db_c = replicas[slot]
        try:
            for qs in starts[slot :: len(replicas)]:
                if aborted.is_set() or (should_abort and should_abort()):
                    aborted.set()
                    return
                one_block(qs, db32, db_c)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failures.append(exc)
            aborted.set()

    if len(replicas) == 1:
        worker(0)
    else:
        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(replicas))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if failures:
        raise failures[0]
    if aborted.is_set():
        return None
    if timings is not None:
        timings["index"] = t1 - t0
        timings["search"] = time.perf_counter() - t1
    return sims_out, ids_out


def distributed_search(x_local: np.ndarray, offsets: list[int], k: int, device: Any, query_batch: int = 65536,
                       db_chunk: int = 65536, should_abort: Callable[[], bool] | None = None,
                       timings: dict | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """Exact k-NN spread over every rank (collective: all ranks call it).

    Rank r holds rows ``offsets[r]:offsets[r+1]`` of the normalised database. Each rank in turn
    broadcasts its rows as query blocks; every rank scores a block against its own rows (bf16
    candidates re-ranked in fp32 on GPU, fp32 on CPU) and the partial top-k are all-gathered and
    merged by the block's owner. Returns this rank's rows' (sims, ids), k nearest others each, or
    None on every rank when any rank's ``should_abort`` said so (checked before each block).
    """
    import time

    import torch
    import torch.distributed as tdist

    from clusterflow import dist

    t0 = time.perf_counter()
    rank, world = dist.rank(), dist.world()
    n, d = offsets[-1], x_local.shape[1]
    dev = torch.device(device)
    db32 = torch.from_numpy(np.ascontiguousarray(x_local, dtype=np.float32)).to(dev)
    db_c = db32.to(torch.bfloat16) if dev.type == "cuda" else db32
    kk = min(k + 1, n)
    cand = min(n, 2 * kk + 16)
    db_chunk = min(db_chunk, 65536)
    query_batch = max(1, min(query_batch, (1 << 26) // db_chunk))
    sims_out = np.full((len(x_local), k), -np.inf, np.float32)
    ids_out = np.full((len(x_local), k), -1, np.int64)
    t1 = time.perf_counter()
    for owner in range(world):
        lo, hi = offsets[owner], offsets[owner + 1]
        for qs in range(lo, hi, query_batch):
            if dist.any_rank(bool(should_abort and should_abort()), device=dev):
                return None
            m = min(query_batch, hi - qs)
            q = db32[qs - lo : qs - lo + m].contiguous() if rank == owner else torch.empty((m, d), dtype=torch.float32, device=dev)
            tdist.broadcast(q, src=owner)
            s = torch.full((m, kk), -torch.inf, device=dev)
            i = torch.full((m, kk), -1, dtype=torch.int64, device=dev)
            if len(x_local):
                ps, pi = _topk_block(q, q.to(db_c.dtype), db32, db_c, cand, kk, db_chunk, offsets[rank])
                s[:, : ps.shape[1]], i[:, : pi.shape[1]] = ps, pi  # a block with fewer than kk rows pads with -inf
            all_s = [torch.empty_like(s) for _ in range(world)]
            all_i = [torch.empty_like(i) for _ in range(world)]
            tdist.all_gather(all_s, s)
            tdist.all_gather(all_i, i)
            if rank != owner:
                continue
            best_s, best_i = _sorted_top(torch.cat(all_s, 1), torch.cat(all_i, 1), kk)
            s_np, i_np = _k_others(best_s, best_i, qs, k)
            sims_out[qs - lo : qs - lo + m], ids_out[qs - lo : qs - lo + m] = s_np, i_np
    if timings is not None:
        timings["index"] = t1 - t0
        timings["search"] = time.perf_counter() - t1
        timings["engine"] = f"torch (exact, distributed over {world} ranks)"
    return sims_out, ids_out
