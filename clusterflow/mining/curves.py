"""Threshold curves of the mutual k-NN graph, and the automatic threshold.

One round's k-NN lists hold every threshold's clustering at once. The mutual edges
(``mutual_graph.py``, the one definition ``clustering.mutual_edges`` uses too) come sorted by
similarity; lowering the threshold only adds edges, so the components at every threshold of a grid
come from one sweep that merges each band of new edges into the components of the band before
(``scipy.sparse.csgraph.connected_components`` on the small graph of the current components: a
union-find in C, one call per grid point). Per grid point the curve holds the number of clusters,
singletons, the largest cluster, the kept edges and the modularity of the components on the whole
mutual graph; with ground truth also NMI and ARI.

``auto_threshold`` picks the grid threshold of highest modularity: the rule Newman and Girvan
(Phys. Rev. E 69, 026113, 2004) use to choose a level of a dendrogram, with the weighted
modularity of Newman (Phys. Rev. E 70, 056131, 2004); the dendrogram here is the single-linkage
tree of the mutual graph that the sweep walks down. docs/mining.md says why this rule.

A numeric threshold is handed back as it came (``resolve_threshold``): the labels at it are
``clustering.mutual_edges``'s, and the curve agrees with them at every grid point (tested):
thresholds are compared with the similarities as ``mutual_graph.edges_at`` compares them, a
Python float against float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from clusterflow.mining.mutual_graph import MutualGraph, mutual_graph
from clusterflow.mining.quality import Agreement


def kept_edges(graph: MutualGraph, threshold: float) -> int:
    """How many edges have ``w >= threshold``, with numpy's comparison rules (a Python float is
    compared in float32, as ``mutual_edges`` compares ``sims >= threshold``)."""
    return _count_at_least(graph.w[::-1], threshold)


def _count_at_least(ascending: np.ndarray, threshold: float) -> int:
    dtype = np.result_type(ascending, threshold)
    a = ascending.astype(dtype, copy=False)
    return len(a) - int(np.searchsorted(a, np.asarray(threshold).astype(dtype), side="left"))


def default_thresholds(graph: MutualGraph, step: float = 0.0025) -> np.ndarray:
    """Multiples of ``step`` (rounded, so they print as typed) spanning the edges' similarities,
    descending: the first keeps no edge, the last keeps them all. The step is the resolution of
    ``auto_threshold``: modularity can peak in a band of 0.0025 just before two large clusters
    merge (the digits, k=10, in docs/mining.md)."""
    if len(graph.w) == 0:
        return np.array([1.0])
    return grid_between(float(graph.w[0]), float(graph.w[-1]), step)


def grid_between(strongest: float, weakest: float, step: float = 0.0025) -> np.ndarray:
    """``default_thresholds`` of a graph whose edges' similarities span ``weakest..strongest``."""
    top = math.floor(strongest / step) + 1
    bottom = math.floor(weakest / step) - 1  # one step of margin for the rounding
    return np.round(np.arange(top, bottom - 1, -1) * step, 10)


def merge_similarities(graph: MutualGraph) -> np.ndarray:
    """The similarity of every merge, strongest first (float32, at most N-1): the edge weights of
    a maximum spanning forest (Kruskal, scipy's ``minimum_spanning_tree`` on the edges' ranks, so
    ties and float rounding cannot reorder them). At any threshold t, not only on a grid, the
    number of clusters is N minus the merges >= t (``clusters_at``)."""
    if len(graph.w) == 0:
        return np.zeros(0, np.float32)
    rank = np.arange(1, len(graph.w) + 1, dtype=np.float64)  # graph.w is sorted: rank 1 = strongest
    # scipy.sparse takes ~0.4 s to import: only mining needs it, not the first step
    from scipy import sparse
    from scipy.sparse.csgraph import minimum_spanning_tree

    forest = minimum_spanning_tree(
        sparse.csr_matrix((rank, (graph.u, graph.v)), shape=(graph.n, graph.n))
    )
    return graph.w[np.sort(forest.data).astype(np.int64) - 1]


def clusters_at(n: int, merges: np.ndarray, threshold: float) -> int:
    """Number of clusters at ``threshold`` from ``merge_similarities`` (compared as
    ``kept_edges``)."""
    return n - _count_at_least(merges[::-1], threshold)


@dataclass
class Curve:
    """Per threshold (descending): what the mutual k-NN components look like there."""

    thresholds: np.ndarray  # float64 (G,), descending
    num_clusters: np.ndarray  # int64 (G,)
    num_singletons: np.ndarray  # int64 (G,)
    largest_cluster: np.ndarray  # int64 (G,)
    mutual_edges: np.ndarray  # int64 (G,): edges kept at the threshold
    modularity: np.ndarray  # float64 (G,): of the components, on the whole mutual graph
    nmi: np.ndarray | None = None  # float64 (G,), with ground truth
    ari: np.ndarray | None = None

    def auto(self) -> float:
        return auto_threshold(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain lists, for a round's stats (JSON) and TensorBoard."""
        out = {
            name: getattr(self, name).tolist()
            for name in (
                "thresholds",
                "num_clusters",
                "num_singletons",
                "largest_cluster",
                "mutual_edges",
                "modularity",
            )
        }
        if self.nmi is not None:
            out.update(nmi=self.nmi.tolist(), ari=self.ari.tolist())
        return out

    def row(self, threshold: float) -> dict[str, Any]:
        """One grid point as a dict (the threshold must be on the grid)."""
        hits = np.flatnonzero(self.thresholds == threshold)
        if len(hits) == 0:
            raise ValueError(f"threshold {threshold!r} is not on this curve's grid")
        return {name: values[hits[0]] for name, values in self.to_dict().items()}


def auto_threshold(curve: Curve) -> float:
    """The grid threshold whose components have the highest modularity (the highest such
    threshold on a tie), as a Python float: ``mutual_edges`` at that value gives the curve's
    clusters there."""
    return float(curve.thresholds[int(np.argmax(curve.modularity))])


def resolve_threshold(
    sims: np.ndarray,
    ids: np.ndarray,
    threshold: float | str,
    truth: np.ndarray | None = None,
    graph: MutualGraph | None = None,
) -> tuple[float, Curve]:
    """What a mining round calls: (the threshold to cluster at, the round's curve).

    ``threshold``: a number, handed back unchanged (the same object), or ``"auto"``.
    """
    if isinstance(threshold, str) and threshold != "auto":
        raise ValueError(f"threshold must be a number or 'auto', got {threshold!r}")
    curve = threshold_curve(sims, ids, truth=truth, graph=graph)
    return (curve.auto() if isinstance(threshold, str) else threshold), curve


def thin(curve: dict[str, Any], keep: float | None, points: int = 41) -> dict[str, Any]:
    """At most ``points`` evenly spaced grid points of a ``Curve.to_dict()``, both ends and the
    threshold ``keep`` (when on the grid) included: the curve as status.json carries it."""
    count = len(curve["thresholds"])
    if count <= points:
        return curve
    rows = set(np.linspace(0, count - 1, points).round().astype(int).tolist())
    rows.update(i for i, t in enumerate(curve["thresholds"]) if t == keep)
    rows = sorted(rows)
    return {name: [values[i] for i in rows] for name, values in curve.items()}


def _sweep(graph: MutualGraph, thresholds: np.ndarray, labels: bool = False):
    """Yield (threshold, kept edges, component sizes, modularity, component of every node or
    None) for each threshold, descending.

    Modularity is Newman's weighted one, Q = sum over components c of W_in(c)/W - (vol(c)/2W)^2,
    on the whole mutual graph with edge weight max(similarity, 0). Edges not yet inside one
    component stay "pending", in component space: a band's edges merge components, and pending
    edges that a merge put inside one component leave the list, so a step costs
    O(components + pending edges), plus O(N) when ``labels`` asks for every node's component.
    """
    # scipy.sparse takes ~0.4 s to import: only mining needs it, not the first step
    from scipy import sparse
    from scipy.sparse.csgraph import connected_components

    n = graph.n
    weight = np.maximum(graph.w, 0).astype(np.float64)
    total = float(weight.sum())
    comp = np.arange(n) if labels else None
    size = np.ones(n, np.int64)
    volume = np.bincount(graph.u, weight, minlength=n) + np.bincount(graph.v, weight, minlength=n)
    pa, pb, pw, pidx = graph.u, graph.v, weight, np.arange(len(weight))
    inside = 0.0  # weight of the mutual graph's edges that lie inside one component
    ascending = np.ascontiguousarray(graph.w[::-1])
    for t in thresholds:
        kept = _count_at_least(ascending, float(t))  # a Python float, as a config value arrives
        cut = int(np.searchsorted(pidx, kept))  # pending edges in the new band: a prefix
        if cut:
            c = len(size)
            band = sparse.coo_matrix((np.ones(cut, np.int8), (pa[:cut], pb[:cut])), shape=(c, c))
            nc, lab = connected_components(band, directed=False)
            if labels:
                comp = lab[comp]
            size = np.bincount(lab, weights=size, minlength=nc).astype(np.int64)
            volume = np.bincount(lab, weights=volume, minlength=nc)
            ra, rb = lab[pa[cut:]], lab[pb[cut:]]
            apart = ra != rb
            inside += float(pw[:cut].sum()) + float(pw[cut:][~apart].sum())
            pa, pb, pw, pidx = ra[apart], rb[apart], pw[cut:][apart], pidx[cut:][apart]
        q = inside / total - float(np.square(volume / (2 * total)).sum()) if total > 0 else 0.0
        yield t, kept, size, q, comp


def threshold_curve(
    sims: np.ndarray,
    ids: np.ndarray,
    thresholds: np.ndarray | None = None,
    truth: np.ndarray | None = None,
    graph: MutualGraph | None = None,
) -> Curve:
    """The curve of the mutual k-NN components over ``thresholds`` (default:
    ``default_thresholds``).

    ``sims, ids``: the k-NN lists the engines return. ``truth``: optional ground-truth labels
    (N,); NMI and ARI are then computed at every grid point. ``graph``: a ``mutual_graph`` of the
    same lists, when the caller has it already.
    """
    graph = mutual_graph(sims, ids) if graph is None else graph
    grid = (
        default_thresholds(graph)
        if thresholds is None
        else np.asarray(thresholds, dtype=np.float64)
    )
    if (
        grid.ndim != 1
        or len(grid) == 0
        or np.any(np.diff(grid) >= 0)
        or not np.all(np.isfinite(grid))
    ):
        raise ValueError(
            f"thresholds must be a non-empty, finite, strictly descending 1-d array, got {grid!r}"
        )
    rows = []
    scores: list[tuple[float, float]] = []
    agreement = Agreement(truth) if truth is not None else None
    for t, kept, size, q, comp in _sweep(graph, grid, labels=truth is not None):
        rows.append((len(size), int((size == 1).sum()), int(size.max()), kept, q))
        if agreement is not None:
            scores.append(agreement(comp))
    cols = list(zip(*rows))
    curve = Curve(grid, *(np.array(c, np.int64) for c in cols[:4]), np.array(cols[4], np.float64))
    if truth is not None:
        curve.nmi, curve.ari = (np.array(c, np.float64) for c in zip(*scores))
    return curve


def modularity(graph: MutualGraph, labels: np.ndarray) -> float:
    """Weighted modularity of any partition (labels (N,), -1 = own singleton) on the whole
    mutual graph, as the curve computes it for the components (also reported for FINCH's levels)."""
    labels = np.asarray(labels, dtype=np.int64)
    labels = np.where(labels >= 0, labels, labels.max(initial=-1) + 1 + np.arange(len(labels)))
    weight = np.maximum(graph.w, 0).astype(np.float64)
    total = float(weight.sum())
    if total <= 0:
        return 0.0
    _, comp = np.unique(labels, return_inverse=True)
    inside = float(weight[comp[graph.u] == comp[graph.v]].sum())
    volume = np.bincount(comp[graph.u], weight, minlength=comp.max() + 1) + np.bincount(
        comp[graph.v], weight, minlength=comp.max() + 1
    )
    return inside / total - float(np.square(volume / (2 * total)).sum())
