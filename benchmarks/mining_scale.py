"""How the mining search modes scale: per-rank peak host memory and time of one round's search and
clustering for mining.search = rank0, all and sharded, on real gloo ranks, side by side in one
run on the same data, with the labels compared for equality.

    python benchmarks/mining_scale.py                          # N = 100k and 200k, d=128, 2 ranks
    python benchmarks/mining_scale.py --n 100000 --world 2 4   # 2 and 4 ranks
    python benchmarks/mining_scale.py --n 50000 --recall       # also ivf/hnsw shards against flat

Each rank makes only its own rows (blobs, generated per block of rows from the block's seed, so
every mode and world size sees the same data), then runs what a round runs after the embed:
rank0: rows gathered to rank 0, the search, the curve and the labels there, labels broadcast;
all: the search spread (torch engine), the k-NN lists gathered to rank 0, which clusters;
sharded: the search, graph, curve and labels across ranks, labels gathered and broadcast.
rank0 and sharded use FAISS flat (``--engine``); all is the exact torch engine by definition.
"Peak" is the rank's peak resident memory during that part minus its resident memory before it
(its own shard is already made), from ``getrusage`` (a high-water mark of the whole process: the
mode runs in a fresh process per rank).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

BLOCK = 8192


def rows(lo: int, hi: int, n: int, d: int, seed: int = 0) -> np.ndarray:
    """Rows lo:hi of the blobs (one centre per 50 rows on average), made block by block."""
    centres = np.random.default_rng(seed).standard_normal((max(2, n // 50), d)).astype(np.float32)
    out = []
    for b in range(lo // BLOCK, -(-hi // BLOCK)):
        rng = np.random.default_rng((seed, b))
        start = b * BLOCK
        m = min(BLOCK, n - start)
        block = centres[rng.integers(0, len(centres), m)] + 0.8 * rng.standard_normal(
            (m, d)
        ).astype(np.float32)
        out.append(block[max(lo - start, 0) : hi - start])
    return np.concatenate(out)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one_mode(mode: str, n: int, d: int, k: int, threshold: float, engine: str, qb: int):
    """What one rank measures for one mode: (seconds, peak MB over its start, its labels)."""
    import torch

    from clusterflow.distributed import comm as dist
    from clusterflow.distributed.sampler import shard_range
    from clusterflow.mining import curves, knn
    from clusterflow.mining.clustering import clusters_from_graph, normalize
    from clusterflow.mining.knn.sharded import sharded_search
    from clusterflow.mining.knn.torch_engine import distributed_search
    from clusterflow.mining.mutual_graph import edges_at, mutual_graph
    from clusterflow.mining.sharded_curves import sharded_resolve
    from clusterflow.mining.sharded_graph import mutual_edges, sharded_clusters

    world, rank = dist.world(), dist.rank()
    offsets = [shard_range(n, r, world).start for r in range(world)] + [n]
    lo, hi = offsets[rank], offsets[rank + 1]
    x = normalize(rows(lo, hi, n, d))
    idx = np.arange(lo, hi)
    dist.barrier()
    base = _rss_mb()
    t0 = time.perf_counter()
    params = knn.KnnParams(k=k, engine=engine, query_batch=qb)

    def cluster_on_rank0(sims, ids):
        graph = mutual_graph(sims, ids)
        t, _ = curves.resolve_threshold(sims, ids, threshold, graph=graph)
        return clusters_from_graph(edges_at(graph, t))

    if mode == "rank0":
        full = dist.gather_rows(idx, x, n, d)
        labels = cluster_on_rank0(*knn.search(full, params)) if full is not None else None
        del full
    elif mode == "all":
        sims, ids = distributed_search(x, offsets, k, torch.device("cpu"), query_batch=qb)
        s_all = dist.gather_rows(idx, sims, n, k)
        i_all = dist.gather_rows(idx, ids, n, k, np.int64)
        labels = cluster_on_rank0(s_all, i_all) if s_all is not None else None
        del s_all, i_all
    else:
        lists = sharded_search(x, offsets, params, knn.choose_engine(engine)[0])
        graph = mutual_edges(*lists, offsets)
        t, _ = sharded_resolve(graph, threshold)
        local, _ = sharded_clusters(graph, t)
        full = dist.gather_rows(idx, local[:, None], n, 1, np.int64)
        labels = full[:, 0] if full is not None else None
    labels = dist.broadcast_object(labels)
    seconds = time.perf_counter() - t0
    return seconds, _peak_mb() - base, labels if rank == 0 else None


def recall(n: int, d: int, k: int, qb: int, index: str):
    """Recall@k of this rank's lists with ivf or hnsw shards against flat shards."""
    from clusterflow.distributed import comm as dist
    from clusterflow.distributed.sampler import shard_range
    from clusterflow.mining.clustering import normalize
    from clusterflow.mining.knn import KnnParams
    from clusterflow.mining.knn.sharded import sharded_search

    world, rank = dist.world(), dist.rank()
    offsets = [shard_range(n, r, world).start for r in range(world)] + [n]
    x = normalize(rows(offsets[rank], offsets[rank + 1], n, d))
    _, exact = sharded_search(x, offsets, KnnParams(k=k, query_batch=qb), "faiss")
    t0 = time.perf_counter()
    _, found = sharded_search(x, offsets, KnnParams(k=k, index=index, query_batch=qb), "faiss")
    seconds = time.perf_counter() - t0
    hits = sum(len(set(a) & set(b)) for a, b in zip(exact, found))
    return hits, exact.size, seconds


def main() -> None:
    from multirank import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[100_000, 200_000])
    ap.add_argument("--world", type=int, nargs="+", default=[2])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--engine", default="faiss", help="rank0 and sharded: faiss or torch")
    ap.add_argument("--query-batch", type=int, default=4096)
    ap.add_argument("--modes", nargs="+", default=["rank0", "all", "sharded"])
    ap.add_argument("--recall", action="store_true", help="ivf/hnsw shards against flat")
    a = ap.parse_args()
    print(f"d={a.d}, k={a.k}, threshold {a.threshold}, engine {a.engine} (all: torch)")
    print("| N | ranks | mode | seconds | peak MB rank 0 | peak MB other ranks (max) | labels |")
    print("|---|---|---|---|---|---|---|")
    for n in a.n:
        for world in a.world:
            found = {}
            for mode in a.modes:
                out = run_ranks(
                    world,
                    one_mode,
                    mode,
                    n,
                    a.d,
                    a.k,
                    a.threshold,
                    a.engine,
                    a.query_batch,
                    timeout=7200,
                    pg_timeout=7200,
                )
                found[mode] = out[0][2]
                same = (
                    "reference"
                    if mode == a.modes[0]
                    else "equal"
                    if np.array_equal(found[mode], found[a.modes[0]])
                    else f"{int((found[mode] != found[a.modes[0]]).sum())} differ"
                )
                print(
                    f"| {n:,} | {world} | {mode} | {max(o[0] for o in out):.1f} | "
                    f"{out[0][1]:.0f} | {max((o[1] for o in out[1:]), default=0):.0f} | {same} |",
                    flush=True,
                )
    if a.recall:
        print("\n| N | ranks | index | recall@k against flat shards | seconds |")
        print("|---|---|---|---|---|")
        for n in a.n:
            for world in a.world:
                for index in ("ivf", "hnsw"):
                    out = run_ranks(
                        world,
                        recall,
                        n,
                        a.d,
                        a.k,
                        a.query_batch,
                        index,
                        timeout=7200,
                        pg_timeout=7200,
                    )
                    hits, total = sum(o[0] for o in out), sum(o[1] for o in out)
                    print(
                        f"| {n:,} | {world} | {index} | {hits / total:.4f} | "
                        f"{max(o[2] for o in out):.1f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
