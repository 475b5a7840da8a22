"""Threshold curves and the automatic threshold across ranks (``mining.search=sharded``).

The same sweep as ``curves._sweep``, with the graph spread over the ranks (``sharded_graph``):
down the grid, each threshold's band of new edges is hooked into the forest of the threshold
before (``sharded_graph.components`` from that forest: only the band's edges are looked at), and
the mutual edges not yet inside one component are checked again (those that are leave the list,
as in ``_sweep``). Per grid point, the owner of each root sums its component's size and volume
(and, with ground truth, its row of the contingency table), and one all-reduce gives the point.

The counts (clusters, singletons, largest, kept edges) equal ``curves.threshold_curve`` on the
gathered lists exactly; modularity, NMI and ARI are sums taken in another order, equal to the last
few bits (so ``auto`` picks the same grid point unless two points' modularities agree to about
1e-15).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from clusterflow.distributed import comm as dist
from clusterflow.mining.curves import Curve, _count_at_least, grid_between
from clusterflow.mining.sharded_graph import (
    ShardedGraph,
    _send,
    components,
    fetch_ends,
    owner,
)


def sharded_grid(graph: ShardedGraph) -> np.ndarray:
    """``curves.default_thresholds`` of the whole graph (collective)."""
    has = len(graph.w) > 0
    ends = dist.all_reduce_dict(
        {
            "any": float(has),
            "top": float(graph.w[0]) if has else -np.inf,
            "neg_bottom": -float(graph.w[-1]) if has else -np.inf,
        },
        op="max",
    )
    if not ends["any"]:
        return np.array([1.0])
    return grid_between(ends["top"], -ends["neg_bottom"])


def sharded_curve(
    graph: ShardedGraph,
    truth: np.ndarray | None = None,
    thresholds: np.ndarray | None = None,
    tick: Callable[[], None] | None = None,
) -> Curve:
    """The curve of the mutual k-NN components over ``thresholds`` (default: ``sharded_grid``);
    collective. ``truth``: ground-truth labels of every sample (N,), for NMI and ARI.
    ``tick()``: once per grid point (the heartbeat)."""
    offsets, lo, hi = graph.offsets, graph.lo, graph.hi
    n = offsets[-1]
    grid = sharded_grid(graph) if thresholds is None else np.asarray(thresholds, np.float64)
    weight = np.maximum(graph.w, 0).astype(np.float64)
    total = float(dist.all_reduce_sum([weight.sum()])[0])
    ends = np.concatenate([graph.u, graph.v])
    got, vols = _send(owner(ends, offsets), ends, np.concatenate([weight, weight]))
    volume = np.bincount(got - lo, vols, minlength=hi - lo)
    code, classes = _truth_codes(truth, lo, hi)
    ascending = np.ascontiguousarray(graph.w[::-1])
    parent = np.arange(lo, hi, dtype=np.int64)
    out_u, out_v, out_w = graph.u, graph.v, weight  # edges not yet inside one component
    inside, done = 0.0, 0
    rows = []
    for t in grid:
        kept = _count_at_least(ascending, float(t))  # a Python float, as a config value arrives
        if rows and not dist.any_rank(kept > done):
            rows.append(rows[-1])  # no new edge anywhere: the point before, as it was
            continue
        parent, _ = components(graph.u[done:kept], graph.v[done:kept], offsets, parent)
        done = kept
        pu, pv = fetch_ends(parent, out_u, out_v, offsets)
        same = pu == pv
        inside += float(out_w[same].sum())
        out_u, out_v, out_w = out_u[~same], out_v[~same], out_w[~same]
        point = _point(parent, volume, code, classes, offsets=offsets, total=total, n=n)
        sums = dist.all_reduce_sum([kept, inside, *point[:-1]])
        largest = dist.all_reduce_dict({"largest": point[-1]}, op="max")["largest"]
        rows.append((sums, largest))
        if tick is not None:
            tick()
    return _curve(grid, rows, total, n, classes)


def _truth_codes(
    truth: np.ndarray | None, lo: int, hi: int
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """This rank's samples' ground-truth class (0..K-1) and every class's size."""
    if truth is None:
        return None, None
    _, codes = np.unique(np.asarray(truth), return_inverse=True)
    return codes[lo:hi].astype(np.int64), np.bincount(codes).astype(np.float64)


def _point(
    parent: np.ndarray,
    volume: np.ndarray,
    code: np.ndarray | None,
    classes: np.ndarray | None,
    *,
    offsets: tuple[int, ...],
    total: float,
    n: int,
) -> list[float]:
    """This rank's roots' partial sums at one grid point: clusters, singletons, the sum of
    (vol/2W)^2, then with truth the mutual information, the entropy of the clusters, the pairs
    within clusters and within table cells; and the largest cluster last."""
    lo, hi = offsets[dist.rank()], offsets[dist.rank() + 1]
    send = [parent, volume] + ([code] if code is not None else [])
    got = _send(owner(parent, offsets), *send)
    size = np.bincount(got[0] - lo, minlength=hi - lo).astype(np.float64)
    cvol = np.bincount(got[0] - lo, got[1], minlength=hi - lo)
    square = float(np.square(cvol / (2 * total)).sum()) if total > 0 else 0.0
    roots = size > 0
    out = [float(roots.sum()), float((size == 1).sum()), square]
    if code is not None and len(got[0]) == 0:
        out += [0.0, 0.0, 0.0, 0.0]
    elif code is not None:
        a = size[roots]
        cells, nij = np.unique(np.stack([got[0], got[2]], 1), axis=0, return_counts=True)
        nij = nij.astype(np.float64)
        a_of = size[cells[:, 0] - lo]
        mi = float(
            (nij / n * (np.log(nij * n) - np.log(a_of) - np.log(classes[cells[:, 1]]))).sum()
        )
        p = a / n
        out += [mi, float(-(p * np.log(p)).sum()), float((a * (a - 1) / 2).sum())]
        out += [float((nij * (nij - 1) / 2).sum())]
    return out + [float(size.max(initial=0))]


def _curve(grid: np.ndarray, rows: list, total: float, n: int, classes: np.ndarray | None) -> Curve:
    """The reduced grid points as a ``Curve`` (NMI and ARI as ``quality.Agreement`` defines
    them, limit cases included)."""
    cols = np.array([sums for sums, _ in rows])
    largest = np.array([lg for _, lg in rows], np.int64)
    kept, inside, clusters, singles, square = (cols[:, c] for c in range(5))
    modularity = inside / total - square if total > 0 else np.zeros(len(grid))
    curve = Curve(
        grid,
        clusters.astype(np.int64),
        singles.astype(np.int64),
        largest,
        kept.astype(np.int64),
        modularity,
    )
    if classes is None:
        return curve
    p = classes[classes > 0] / n
    h_b = float(-(p * np.log(p)).sum())
    pairs_b = float((classes * (classes - 1) / 2).sum())
    nmi, ari = [], []
    for _, _, count, _, _, mi, h_a, pairs_a, pairs_ij in cols:
        mi = max(mi, 0.0)
        if count == len(classes) == 1:
            nmi.append(1.0)
        else:
            nmi.append(0.0 if mi == 0 else mi / ((h_a + h_b) / 2))
        expected = pairs_a * pairs_b / (n * (n - 1) / 2) if n > 1 else 0.0
        spread = (pairs_a + pairs_b) / 2 - expected
        ari.append(1.0 if spread == 0 else (pairs_ij - expected) / spread)
    curve.nmi, curve.ari = np.array(nmi), np.array(ari)
    return curve


def sharded_resolve(
    graph: ShardedGraph,
    threshold: float | str,
    truth: np.ndarray | None = None,
    tick: Callable[[], None] | None = None,
) -> tuple[float, Curve]:
    """``curves.resolve_threshold`` across ranks: (the threshold to cluster at, the curve); a
    number is handed back unchanged, ``"auto"`` is the grid point of highest modularity."""
    if isinstance(threshold, str) and threshold != "auto":
        raise ValueError(f"threshold must be a number or 'auto', got {threshold!r}")
    curve = sharded_curve(graph, truth, tick=tick)
    return (curve.auto() if isinstance(threshold, str) else threshold), curve
