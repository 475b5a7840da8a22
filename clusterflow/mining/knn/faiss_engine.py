"""The FAISS k-NN engine: flat (exact), ivf or hnsw; sharded over every local GPU with a GPU
build."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from clusterflow.mining.knn.common import Blocks, KnnParams, k_others

if TYPE_CHECKING:
    import faiss  # optional (the cpu or gpu extra): imported where an index is built


def build_faiss_index(x: np.ndarray, params: KnnParams) -> faiss.Index:
    import faiss

    d = x.shape[1]
    if params.index == "flat":
        idx = faiss.IndexFlatIP(d)
    elif params.index == "ivf":
        # faiss wants >= 39 training points per list.
        nlist = max(1, min(params.nlist, x.shape[0] // 39 or 1))
        quant = faiss.IndexFlatIP(d)
        idx = faiss.IndexIVFFlat(quant, d, nlist, faiss.METRIC_INNER_PRODUCT)
        idx.train(x)
        idx.nprobe = min(params.nprobe, nlist)
    elif params.index == "hnsw":
        idx = faiss.IndexHNSWFlat(d, params.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        idx.hnsw.efSearch = params.ef_search
    else:
        raise ValueError(f"unknown index {params.index!r}")
    if (
        params.use_gpu
        and hasattr(faiss, "index_cpu_to_all_gpus")
        and faiss.get_num_gpus() > 0
        and params.index != "hnsw"
    ):
        idx = faiss.index_cpu_to_all_gpus(idx)  # shards the database over every local GPU
    idx.add(x)
    return idx


def faiss_search(
    x: np.ndarray,
    params: KnnParams,
    should_abort: Callable[[], bool] | None = None,
    timings: dict | None = None,
    blocks: Blocks | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    import faiss

    # All cores for the search, then the previous setting back: the OpenMP runtime is shared
    # with torch, and a changed thread count changes float summation order in training (a
    # resumed run would then drift from an uninterrupted one in the last bits).
    previous = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(os.cpu_count() or 1)
    try:
        return _faiss_search(x, params, should_abort, timings, blocks)
    finally:
        faiss.omp_set_num_threads(previous)


def _faiss_search(
    x: np.ndarray,
    params: KnnParams,
    should_abort: Callable[[], bool] | None,
    timings: dict | None,
    blocks: Blocks | None,
) -> tuple[np.ndarray, np.ndarray] | None:
    t0 = time.perf_counter()
    # Built on the first block to compute: a resumed search may have none left.
    idx, built = None, 0.0
    k, qb = params.k, params.query_batch
    kk = min(k + 1, x.shape[0])
    sims = np.empty((x.shape[0], k), np.float32)
    ids = np.empty((x.shape[0], k), np.int64)
    for start in range(0, x.shape[0], qb):
        done = blocks.get(start, min(qb, x.shape[0] - start)) if blocks is not None else None
        if done is None:
            if should_abort and should_abort():
                return None
            if idx is None:
                t1 = time.perf_counter()
                idx = build_faiss_index(x, params)
                built = time.perf_counter() - t1
            done = k_others(*idx.search(x[start : start + qb], kk), start, k)
            if blocks is not None:
                blocks.put(start, *done)
        sims[start : start + len(done[0])], ids[start : start + len(done[0])] = done
    if timings is not None:
        timings["index"] = built
        timings["search"] = time.perf_counter() - t0 - built
    return sims, ids
