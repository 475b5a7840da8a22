"""Mining benchmark: phases of mutual_knn_clusters, and its cost against a raw FAISS flat search.

    python benchmarks/mining.py                     # 200k x 128, k=20
    python benchmarks/mining.py --n 1200000 --d 512
    python benchmarks/mining.py --n 50000 --embed   # also embedding throughput, 1 and 2 gloo ranks

Everything is measured side by side in one run on the same data; the printed ratios are the claim.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from clusterflow.mining import mutual_knn_clusters, normalize


def data(n: int, d: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((max(2, n // 20), d)).astype(np.float32)
    return centers[rng.integers(0, len(centers), n)] + 0.5 * rng.standard_normal((n, d)).astype(
        np.float32
    )


def raw_faiss(x: np.ndarray, k: int) -> float:
    import faiss

    t0 = time.perf_counter()
    xn = normalize(x)
    idx = faiss.IndexFlatIP(x.shape[1])
    idx.add(xn)
    idx.search(xn, k + 1)
    return time.perf_counter() - t0


def embed_throughput(n: int, world: int) -> float:
    """Samples/s of the mining embedding phase on `world` gloo ranks (demo encoder, CPU)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from multirank import run_ranks

    return run_ranks(world, _embed_rate, n)[0]


def _embed_rate(n: int) -> float:
    import torch

    from clusterflow.distributed import comm as dist
    from clusterflow.mining.stage import embed_shard
    from clusterflow.tasks.pseudo_id import PseudoIDTask

    task = PseudoIDTask(identities=n // 20, samples_per_identity=20)
    model = task.build_model()
    ds = task.embed_dataset()
    dist.barrier()
    t0 = time.perf_counter()
    idx, emb = embed_shard(task, model, ds, 1024, torch.device("cpu"), None)
    dist.gather_rows(idx, emb, len(ds), emb.shape[1])
    return len(ds) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=200_000)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--threshold", type=float, default=0.5)
    p.add_argument(
        "--sklearn-n",
        type=int,
        default=50_000,
        help="rows for the scikit-learn baseline (it is slow)",
    )
    p.add_argument(
        "--embed", action="store_true", help="also measure embedding throughput with 1 and 2 ranks"
    )
    a = p.parse_args()
    x = data(a.n, a.d)
    print(f"N={a.n} d={a.d} k={a.k} threshold={a.threshold} cores={os.cpu_count()}")
    # Warm up both sides on a small slice first: the first call pays one-off imports (torch, scipy's
    # csgraph, faiss's thread pool: about 1.7 s here), which a job has already paid when it mines.
    raw_faiss(x[:1000], a.k)
    mutual_knn_clusters(x[:1000], a.k, a.threshold, engine="faiss")
    mutual_knn_clusters(x[:1000], a.k, a.threshold, engine="torch")
    t_raw = raw_faiss(x, a.k)
    timings: dict = {}
    t0 = time.perf_counter()
    labels = mutual_knn_clusters(x, a.k, a.threshold, engine="faiss", timings=timings)
    t_ours = time.perf_counter() - t0
    print(f"raw faiss flat search (normalise + add + search k+1): {t_raw:8.2f} s")
    print(
        f"mutual_knn_clusters (faiss flat):                     {t_ours:8.2f} s   ratio "
        f"{t_ours / t_raw:.3f}x"
    )
    for k in ("normalize", "index", "search", "cluster"):
        print(f"   {k:10s} {timings[k]:8.3f} s")
    print(f"   clusters {labels.max() + 1}")
    t0 = time.perf_counter()
    mutual_knn_clusters(x, a.k, a.threshold, engine="torch")
    t_torch = time.perf_counter() - t0
    print(
        f"mutual_knn_clusters (exact torch engine):             {t_torch:8.2f} s   ratio "
        f"{t_torch / t_raw:.3f}x"
    )
    from sklearn.neighbors import NearestNeighbors

    m = min(a.sklearn_n, a.n)
    xs = normalize(x[:m])
    t0 = time.perf_counter()
    NearestNeighbors(n_neighbors=a.k + 1, algorithm="brute", metric="cosine").fit(xs).kneighbors(xs)
    t_sk = time.perf_counter() - t0
    t_raw_m = raw_faiss(x[:m], a.k)
    print(
        f"naive baseline, scikit-learn brute on {m} rows:       {t_sk:8.2f} s   vs raw faiss on "
        f"the same rows {t_raw_m:.2f} s ({t_sk / t_raw_m:.1f}x)"
    )
    if a.embed:
        for w in (1, 2):
            print(
                f"embedding throughput, {w} rank(s): {embed_throughput(min(a.n, 100_000), w):,.0f} "
                "samples/s"
            )


if __name__ == "__main__":
    main()
