"""The mutual k-NN graph: the one definition of a mutual edge in clusterflow.

Edge i-j exists iff j is among i's k nearest others and i is among j's; it is kept at threshold
t iff both directed similarities (i's listing of j and j's listing of i) are >= t, compared as
numpy compares a float32 array with the threshold. Everything that needs mutual edges starts
here: the components at one threshold (``clustering.mutual_edges``), the curves over every
threshold (``curves.py``) and FINCH's modularity (``finch.py``), so they cannot drift apart.

Two cases a sparse-matrix product would get wrong are handled here (tests in
tests/test_curves.py): an edge whose similarity is exactly 0.0 is kept (scipy's sparse multiply
discards explicit zeros), and a neighbour listed twice in one row (an approximate index may do
that) counts once, with its higher similarity, never summed. A NaN similarity never passes a
threshold; a row listing itself adds nothing (the engines never do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from scipy import sparse


@dataclass(frozen=True)
class MutualGraph:
    """Every mutual pair once (u < v), strongest first. ``w`` is the lower of the two directed
    similarities, so the edge is kept at threshold t iff ``w >= t``."""

    n: int
    u: np.ndarray  # int64 (E,)
    v: np.ndarray  # int64 (E,)
    w: np.ndarray  # (E,), the similarities' float dtype, descending
    w_uv: np.ndarray  # (E,): u's listing of v
    # (E,): v's listing of u (not always bitwise w_uv: FAISS may sum in another order)
    w_vu: np.ndarray


def mutual_graph(sims: np.ndarray, ids: np.ndarray, block: int = 65536) -> MutualGraph:
    """The mutual edges of k-NN lists ``(sims, ids)`` (N, k), as ``clusterflow.mining.knn``
    returns them.

    No sort of the N*k entries: entry i -> j (i < j) is mutual iff i is in row j, which one
    comparison of row j with i finds (O(N k^2), in blocks of rows to bound memory), and the same
    comparison says where, for the similarity j -> i. One argsort of the E edges orders them.
    """
    ids = np.asarray(ids)
    n, _k = ids.shape
    sims = np.asarray(sims)
    sims = sims if sims.dtype.kind == "f" else sims.astype(np.float32)
    narrow = np.int32 if n < 2**31 else np.int64  # half the bytes for the row gathers
    ids, sims = _one_listing_per_neighbour(ids.astype(narrow), sims)
    us, vs, fwd, back = [], [], [], []
    for start in range(0, n, block):
        row_ids = ids[start : start + block]
        rows = np.arange(start, start + len(row_ids), dtype=narrow)[:, None]
        r, c = np.nonzero(row_ids > rows)  # from the smaller end; -1 and self excluded
        j = row_ids[r, c]
        hit_row, hit_col = np.nonzero(ids[j] == rows[r])  # where row j lists i: at most once
        r, c, j = r[hit_row], c[hit_row], j[hit_row]
        (
            us.append(r + start),
            vs.append(j),
            fwd.append(sims[start + r, c]),
            back.append(sims[j, hit_col]),
        )
    u, v, w_uv, w_vu = (np.concatenate(a) for a in (us, vs, fwd, back))
    w = np.minimum(w_uv, w_vu)
    keep = ~np.isnan(w)  # a NaN similarity is never >= any threshold
    order = np.flatnonzero(keep)[np.argsort(-w[keep], kind="stable")]  # ties: in the order found
    return MutualGraph(
        n, u[order].astype(np.int64), v[order].astype(np.int64), w[order], w_uv[order], w_vu[order]
    )


def _one_listing_per_neighbour(ids: np.ndarray, sims: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keep the first listing of a repeated neighbour, with the higher similarity of its
    listings (a NaN listing never wins), and blank the others (-1). Exact engines never repeat,
    so only rows with a repeat pay for the per-row work, and the arrays are copied only then."""
    srt = np.sort(ids, axis=1)
    repeats = np.flatnonzero(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(1))
    if len(repeats) == 0:
        return ids, sims
    ids, sims = ids.copy(), sims.copy()
    for i in repeats:
        uniq, first, inverse = np.unique(ids[i], return_index=True, return_inverse=True)
        best = np.full(len(uniq), np.nan, sims.dtype)
        np.fmax.at(best, inverse, sims[i])
        ids[i] = -1
        ids[i, first] = uniq
        sims[i, first] = best
    return ids, sims


def edges_at(graph: MutualGraph, threshold: float) -> sparse.csr_matrix:
    """Symmetric (N, N) float32 matrix of the edges kept at ``threshold``: (u, v) holds u's
    listing of v and (v, u) v's listing of u, explicit zeros included."""
    keep = graph.w >= threshold
    u, v = graph.u[keep], graph.v[keep]
    data = np.concatenate([graph.w_uv[keep], graph.w_vu[keep]]).astype(np.float32)
    # scipy.sparse takes ~0.4 s to import: only mining needs it, not the first step
    from scipy import sparse

    return sparse.csr_matrix(
        (data, (np.concatenate([u, v]), np.concatenate([v, u]))), shape=(graph.n, graph.n)
    )
