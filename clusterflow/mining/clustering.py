"""Pseudo-labels from embeddings: the pure functions of the mining stage (no collectives, no I/O).

``mutual_knn_clusters`` is the contract (docs/mining.md): cosine similarity on L2-normalised rows;
edge i-j kept iff j is among i's k nearest others, i among j's, and similarity >= threshold;
labels are connected components numbered 0..C-1 in order of each component's smallest member.
``threshold="auto"`` picks the threshold from the round's curve (``curves.auto_threshold``).
The mining stage runs the same pieces: ``normalize`` -> ``knn.search`` -> ``mutual_graph`` ->
``clusters_from_graph(edges_at(graph, threshold))``. The mutual edges are defined once, in
``mutual_graph.py``.
"""

from __future__ import annotations

import time
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from clusterflow.mining import curves, knn
from clusterflow.mining.mutual_graph import edges_at, mutual_graph

if TYPE_CHECKING:
    from scipy import sparse


def normalize(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


def tie_warning(sims: np.ndarray, ids: np.ndarray, atol: float = 1e-5) -> str | None:
    """Why the clusters from these k-NN lists are arbitrary, or None: when every listed
    neighbour is at cosine similarity 1 (all embeddings identical, a collapsed model), nothing
    tells one neighbour from another, and which edges are mutual is decided by tie-breaking."""
    listed = sims[ids >= 0]
    if listed.size == 0 or float(listed.min()) < 1.0 - atol:
        return None
    return (
        f"all {len(sims)} samples' k nearest neighbours are at cosine similarity 1: the "
        "embeddings are identical (a collapsed model?), so the clusters are made by tie-breaking, "
        "not found; lower train.lr, or check the task's embed()"
    )


def mutual_edges(sims: np.ndarray, ids: np.ndarray, threshold: float) -> sparse.csr_matrix:
    """Symmetric sparse matrix of the mutual k-NN edges with similarity >= threshold (each
    direction holds its own listing's similarity)."""
    return edges_at(mutual_graph(sims, ids), threshold)


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
        (m, graph[m][:, m].tocsr())
        for m in (
            np.flatnonzero(labels == c)
            for c, size in enumerate(np.bincount(labels))
            if size > max_size
        )
    ]
    while stack:
        members, sub = stack.pop()
        if sub.nnz == 0:
            continue
        sub = sub.copy()
        sub.data[sub.data <= np.quantile(sub.data, 0.25)] = 0
        sub.eliminate_zeros()
        # scipy.sparse takes ~0.4 s to import: only mining needs it, not the first step
        from scipy.sparse.csgraph import connected_components

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


def clusters_from_graph(
    graph: sparse.csr_matrix, singletons: str = "cluster", max_cluster_size: int = 0
) -> np.ndarray:
    # scipy.sparse takes ~0.4 s to import: only mining needs it, not the first step
    from scipy.sparse.csgraph import connected_components

    _, labels = connected_components(graph, directed=False)
    if max_cluster_size:
        labels = _split_large(graph, labels, max_cluster_size)
    labels = number_by_smallest_member(labels)
    return ignore_singletons(labels) if singletons == "ignore" else labels


def ignore_singletons(labels: np.ndarray) -> np.ndarray:
    """Label -1 for every cluster of one sample; the others renumbered by smallest member."""
    sizes = np.bincount(labels)
    labels = np.where(sizes[labels] == 1, -1, labels)
    kept = labels >= 0
    if kept.any():
        labels[kept] = number_by_smallest_member(labels[kept])
    return labels


def clusters_from_knn(
    sims: np.ndarray,
    ids: np.ndarray,
    threshold: float | str,
    singletons: str = "cluster",
    max_cluster_size: int = 0,
) -> tuple[np.ndarray, int]:
    """Labels from k-NN lists (mutual edges >= threshold, then components), and the number of
    mutual edges kept. ``threshold="auto"``: the one ``curves.auto_threshold`` picks."""
    graph = mutual_graph(sims, ids)
    if isinstance(threshold, str):
        threshold, _ = curves.resolve_threshold(sims, ids, threshold, graph=graph)
    edges = edges_at(graph, threshold)
    return clusters_from_graph(edges, singletons, max_cluster_size), int(edges.nnz // 2)


def mutual_knn_clusters(
    embeddings: np.ndarray,
    k: int,
    threshold: float | str,
    *,
    singletons: str = "cluster",
    max_cluster_size: int = 0,
    timings: dict | None = None,
    **knn_args: str | int | bool,
) -> np.ndarray:
    """Pseudo-labels from the mutual k-NN graph (see the module docstring for the definition).

    ``embeddings``: float32 (N, d). Returns int64 (N,). ``threshold``: a cosine similarity, or
    ``"auto"`` (the threshold of highest modularity on the round's curve, docs/mining.md). With
    ``singletons="ignore"`` samples without any kept edge get -1; ``max_cluster_size`` splits
    giant chained components. ``knn_args``: how the neighbours are found, the fields of
    :class:`clusterflow.mining.knn.KnnParams` but ``k`` (engine, index, query_batch and the
    FAISS knobs nlist, nprobe, hnsw_m, ef_search, use_gpu; each defaults to KnnParams');
    ``timings`` receives seconds per phase and the engine used.
    """

    emb = np.asarray(embeddings)
    if emb.ndim != 2 or emb.shape[0] == 0:
        raise ValueError(f"embeddings must be a non-empty (N, d) array, got shape {emb.shape}")
    if isinstance(threshold, str) and threshold != "auto":
        raise ValueError(f"threshold must be a number or 'auto', got {threshold!r}")
    params = knn.KnnParams(k=k, **knn_args)  # type: ignore[arg-type]
    timings = {} if timings is None else timings
    t0 = time.perf_counter()
    x = normalize(emb)
    timings["normalize"] = time.perf_counter() - t0
    result = knn.search(x, params, timings=timings)
    assert result is not None  # no abort callback here
    t1 = time.perf_counter()
    why = tie_warning(*result)
    if why:
        warnings.warn(why, UserWarning, stacklevel=2)
    labels, _ = clusters_from_knn(*result, threshold, singletons, max_cluster_size)
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
        "size_histogram": {
            f"{lo}-{hi - 1}" if hi - 1 != lo else str(lo): int(h)
            for lo, hi, h in zip(edges[:-1], edges[1:], hist)
        },
    }
