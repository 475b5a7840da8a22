"""FINCH, the first-neighbour clustering hierarchy (Sarfraz, Sharma, Stiefelhagen, CVPR 2019),
on the k-NN lists a mining round already has.

Level 0 links every sample to its first neighbour (column 0 of the round's ``ids``: no new
search) and takes the connected components. Each next level does the same to the clusters of
the level before, represented by their mean direction (the normalised sum of their L2-normalised
rows), with a k=1 search over the means by one of ``clusterflow.mining.knn``'s engines. It stops,
as the authors' code does, when a level would leave one cluster or merge only one pair; that
level is not kept. No threshold, no k.

Written here rather than taken from ``finch-clust`` (MIT): that package can take level 0's first
neighbours (``initial_rank``) but searches every later level itself, with a dense N x N distance
matrix up to 20,000 clusters (1.6 GB in float32) and pynndescent (numba) or a FAISS IVF-PQ index
beyond, approximate and not our engines; the algorithm itself is a few lines.

Which level: the one whose cluster count is closest to ``num_clusters`` when given, else the one
of highest mean silhouette (cosine; exact per row, on a fixed sample of rows). Not modularity,
the criterion of ``curves.auto_threshold``: consecutive FINCH levels differ by merges of whole
clusters, and modularity's resolution limit (Fortunato and Barthelemy, PNAS 2007) then prefers
the coarser level: on the demo's embeddings it picks 65 clusters for 200 identities (NMI 0.87)
where the silhouette picks 228 (NMI 0.99); docs/mining.md has the table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from clusterflow.mining import knn
from clusterflow.mining.curves import modularity
from clusterflow.mining.knn import KnnParams
from clusterflow.mining.mutual_graph import MutualGraph, mutual_graph

Search = Callable[[np.ndarray, int], "tuple[np.ndarray, np.ndarray] | None"]


def first_neighbour_components(first: np.ndarray) -> np.ndarray:
    """Components of the graph with an edge from every i to ``first[i]`` (-1: none), numbered
    0..C-1 in order of each component's smallest member (scipy labels components in the order it
    meets their first node; the tests check this)."""
    n = len(first)
    to = np.where(first >= 0, first, np.arange(n))
    # scipy.sparse takes ~0.4 s to import: only mining needs it, not the first step
    from scipy import sparse
    from scipy.sparse.csgraph import connected_components

    graph = sparse.coo_matrix((np.ones(n, np.int8), (np.arange(n), to)), shape=(n, n))
    return connected_components(graph, directed=False)[1].astype(np.int64)


def mean_directions(x: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per cluster, the normalised sum of its rows: the direction of its mean (float32 (C, d))."""
    c = int(labels.max()) + 1
    # scipy.sparse takes ~0.4 s to import: only mining needs it, not the first step
    from scipy import sparse

    member = sparse.csr_matrix(
        (np.ones(len(labels), np.float32), (labels, np.arange(len(labels)))), shape=(c, len(labels))
    )
    sums = np.asarray(member @ x, dtype=np.float32)
    return sums / np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-12)


def default_search(params: KnnParams | None = None) -> Search:
    """The search over the cluster means: ``knn.search`` with ``params`` (a mining round passes
    its own; default: exact, FAISS flat or torch) and the k each level asks for."""

    base = params or KnnParams(k=1)

    def search(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray] | None:
        return knn.search(x, dataclasses.replace(base, k=k))

    return search


def finch_levels(
    x: np.ndarray, ids: np.ndarray, search: Search | None = None, max_levels: int = 64
) -> list[np.ndarray]:
    """The FINCH partitions, finest first: int64 (N,) labels each, numbered by smallest member.

    ``x``: the L2-normalised rows the k-NN lists were computed on (float32 (N, d)); ``ids``: their
    k-NN lists (N, k), nearest first, as ``clusterflow.mining.knn`` returns them;
    ``search(x, k)``: the engine for the cluster means (default: ``default_search()``).
    """
    x = np.asarray(x, dtype=np.float32)
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.shape[1] < 1 or len(ids) != len(x):
        raise ValueError(
            f"ids must be the (N, k>=1) k-NN lists of the {len(x)} rows, got shape {ids.shape}"
        )
    search = default_search() if search is None else search
    levels = [first_neighbour_components(ids[:, 0])]
    while len(levels) < max_levels:
        current = levels[-1]
        count = int(current.max()) + 1
        if count <= 2:
            break  # the next level is one cluster
        result = search(mean_directions(x, current), 1)
        if result is None:
            raise RuntimeError("the k-NN search over the cluster means was aborted")
        merged = first_neighbour_components(result[1][:, 0])
        if merged.max() == 0 or merged.max() + 1 >= count - 1:
            break  # one cluster left, or only one pair merged: the authors stop and drop it
        levels.append(merged[current])
    return levels


def silhouette(x: np.ndarray, labels: np.ndarray, sample: int = 4000, seed: int = 0) -> float:
    """Mean cosine silhouette (Rousseeuw 1987) of ``sample`` rows drawn without replacement (all
    rows when N <= sample), each exact against the whole data: on L2-normalised rows the mean
    cosine distance from x_i to a cluster c is 1 - x_i . sum(c) / |c|, so one product with the
    cluster sums gives a(i) and b(i). A singleton scores 0, as in the definition."""
    n = len(labels)
    rows = (
        np.arange(n)
        if n <= sample
        else np.sort(np.random.default_rng(seed).choice(n, sample, replace=False))
    )
    count = np.bincount(labels).astype(np.float64)
    if len(count) < 2:
        return 0.0
    # scipy.sparse takes ~0.4 s to import: only mining needs it, not the first step
    from scipy import sparse

    member = sparse.csr_matrix(
        (np.ones(n, np.float32), (labels, np.arange(n))), shape=(len(count), n)
    )
    # float32 (C, d): no float64 copy of x.
    sums = np.asarray(member @ np.asarray(x, dtype=np.float32))
    block = max(1, (1 << 24) // len(count))  # at most 16M scores (64 MB) at a time
    scores = []
    for start in range(0, len(rows), block):
        r = rows[start : start + block]
        own, xr = labels[r], x[r].astype(np.float64)
        dots = (x[r] @ sums.T).astype(np.float64)  # (rows, clusters)
        others = 1 - dots / count
        others[np.arange(len(r)), own] = np.inf
        b = others.min(1)
        # Singletons (0/0) and a = b = 0 score 0, as in scikit-learn.
        with np.errstate(invalid="ignore", divide="ignore"):
            a = 1 - (dots[np.arange(len(r)), own] - np.einsum("ij,ij->i", xr, xr)) / (
                count[own] - 1
            )
            s = np.nan_to_num((b - a) / np.maximum(a, b))
        scores.append(np.where(count[own] > 1, s, 0.0))
    return float(np.concatenate(scores).mean())


def finch_clusters(
    x: np.ndarray,
    sims: np.ndarray,
    ids: np.ndarray,
    num_clusters: int | None = None,
    search: Search | None = None,
    graph: MutualGraph | None = None,
) -> tuple[np.ndarray, dict]:
    """FINCH labels for a mining round: (int64 (N,) labels, info).

    The level returned: the one whose cluster count is closest to ``num_clusters`` when given
    (the finer on a tie), else the one of highest ``silhouette`` (the finer on a tie).
    ``info``: ``level`` (its index), and per level, finest first: ``num_clusters``,
    ``silhouette`` and ``modularity`` on the mutual k-NN graph of ``(sims, ids)``.
    """
    levels = finch_levels(x, ids, search)
    graph = mutual_graph(sims, ids) if graph is None else graph
    counts = [int(level.max()) + 1 for level in levels]
    shapes = [silhouette(x, level) for level in levels]
    if num_clusters is not None:
        chosen = int(np.argmin([abs(c - num_clusters) for c in counts]))
    else:
        chosen = int(np.argmax(shapes))
    return levels[chosen], {
        "level": chosen,
        "num_clusters": counts,
        "silhouette": shapes,
        "modularity": [modularity(graph, level) for level in levels],
    }
