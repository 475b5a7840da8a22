"""The mutual k-NN graph and its components across ranks (``mining.search=sharded``): each rank
holds the k-NN lists of its own contiguous rows only, and no rank ever holds an array of N rows
by k or by d.

- **Mutual edges** (``mutual_edges``): for every listing i -> j with i < j, the owner of i asks
  the owner of j (one all-to-all of the candidate edges), who checks whether row j lists i and
  keeps the edge with both directed similarities. An edge lives with the owner of its larger end.
  The definition is ``mutual_graph.py``'s, a repeated neighbour and NaN included.
- **Components** (``components``): min-label hooking with pointer jumping, each node's parent
  stored by the node's owner. Every round, each edge whose ends have different roots hooks the
  larger root onto the smaller one (the owner of a root takes the smallest offer), then pointers
  jump until every node points at its root. A parent is never larger than its node, so the root of
  a component is its smallest member: the canonical numbering needs no further pass. The rounds
  are few (each halves the roots a component has, or better); each is a couple of all-to-alls of
  the edges' ends.
- **max_cluster_size**: the edges and members of a too-large component go to the owner of its
  smallest member, which splits it exactly as ``clustering._split_large`` does.
- **Labels** (``number``): a root's label is its rank among all kept roots (ranks hold
  increasing ranges, so an exclusive sum of the counts of roots gives it); every node asks its
  root's owner.

Labels equal ``clusters_from_graph(edges_at(mutual_graph(sims, ids), t), ...)`` on the gathered
lists exactly (a partition does not depend on the order edges are found in).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from clusterflow.distributed import comm as dist
from clusterflow.mining.clustering import _split_large
from clusterflow.mining.mutual_graph import _one_listing_per_neighbour


@dataclass(frozen=True)
class ShardedGraph:
    """This rank's share of the mutual graph: the edges whose larger end ``v`` it owns."""

    offsets: tuple[int, ...]  # rank r owns nodes offsets[r]:offsets[r+1]
    u: np.ndarray  # int64 (E,), u < v
    v: np.ndarray  # int64 (E,)
    w: np.ndarray  # (E,): min(w_uv, w_vu), the edge is kept at t iff w >= t
    w_uv: np.ndarray  # u's listing of v
    w_vu: np.ndarray  # v's listing of u

    @property
    def lo(self) -> int:
        return self.offsets[dist.rank()]

    @property
    def hi(self) -> int:
        return self.offsets[dist.rank() + 1]


def owner(ids: np.ndarray, offsets: Sequence[int]) -> np.ndarray:
    """The rank that owns each (global) node id."""
    return np.searchsorted(np.asarray(offsets), ids, side="right") - 1


def _by_owner(dest: np.ndarray, *arrays: np.ndarray) -> list[list[np.ndarray]]:
    """Each array cut into one part per rank, by ``dest`` (the rank of each entry)."""
    order = np.argsort(dest, kind="stable")
    cuts = np.searchsorted(dest[order], np.arange(dist.world() + 1))
    return [[a[order][cuts[r] : cuts[r + 1]] for r in range(dist.world())] for a in arrays]


def _send(dest: np.ndarray, *arrays: np.ndarray) -> list[np.ndarray]:
    """Every entry to rank ``dest``; what this rank receives, each array concatenated. The arrays
    travel together, as the bytes of one row per entry (one all-to-all)."""
    cols = [np.ascontiguousarray(a).reshape(len(a), int(np.prod(a.shape[1:]))) for a in arrays]
    packed = np.concatenate([c.view(np.uint8) for c in cols], axis=1) if cols else None
    (parts,) = _by_owner(dest, packed)
    got = np.concatenate(dist.exchange(parts))
    out, at = [], 0
    for a, c in zip(arrays, cols):
        width = c.shape[1] * c.dtype.itemsize
        col = np.ascontiguousarray(got[:, at : at + width]).view(c.dtype)
        out.append(col.reshape(len(got), *a.shape[1:]))
        at += width
    return out


def fetch(values: np.ndarray, idx: np.ndarray, offsets: Sequence[int]) -> np.ndarray:
    """``values`` (this rank's nodes' entries) at the global ids ``idx``, asked of their owners
    (collective: every rank calls it, with its own ``idx``)."""
    lo = offsets[dist.rank()]
    uniq, inv = np.unique(idx, return_inverse=True)
    cuts = np.searchsorted(uniq, np.asarray(offsets))
    asking = [uniq[cuts[r] : cuts[r + 1]] for r in range(dist.world())]
    asked = dist.exchange(asking)
    answers = dist.exchange([values[a - lo] for a in asked], rows=[len(a) for a in asking])
    return np.concatenate(answers)[inv] if len(idx) else values[:0]


def fetch_ends(
    values: np.ndarray, u: np.ndarray, v: np.ndarray, offsets: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """``fetch`` at both ends of the edges ``u - v`` in one request."""
    both = fetch(values, np.concatenate([u, v]), offsets)
    return both[: len(u)], both[len(u) :]


def mutual_edges(sims: np.ndarray, ids: np.ndarray, offsets: Sequence[int]) -> ShardedGraph:
    """The mutual edges of every rank's lists (``sims, ids``: this rank's rows, global ids, as
    ``knn.sharded.sharded_search`` returns them); collective."""
    offsets = tuple(int(o) for o in offsets)
    lo = offsets[dist.rank()]
    sims = np.asarray(sims)
    sims = sims if sims.dtype.kind == "f" else sims.astype(np.float32)
    ids, sims = _one_listing_per_neighbour(np.asarray(ids, np.int64), sims)
    rows = np.arange(lo, lo + len(ids))[:, None]
    r, c = np.nonzero(ids > rows)  # from the smaller end; -1 and self excluded
    i, j, s_ij = rows[r, 0], ids[r, c], sims[r, c]
    i, j, s_ij = _send(owner(j, offsets), i, j, s_ij)
    hit = ids[j - lo] == i[:, None]  # does row j list i? at most once
    found = hit.any(1)
    s_ji = sims[j - lo, hit.argmax(1)]
    u, v, w_uv, w_vu = i[found], j[found], s_ij[found], s_ji[found]
    w = np.minimum(w_uv, w_vu)
    keep = ~np.isnan(w)  # a NaN similarity is never >= any threshold
    order = np.flatnonzero(keep)[np.argsort(-w[keep], kind="stable")]
    return ShardedGraph(offsets, u[order], v[order], w[order], w_uv[order], w_vu[order])


def _shortcut(parent: np.ndarray, offsets: Sequence[int]) -> int:
    """Pointer jumping until every node points at its root (in place); the rounds it took."""
    rounds = 0
    while True:
        grand = fetch(parent, parent, offsets)
        if not dist.any_rank(bool((grand != parent).any())):
            return rounds
        parent[:] = grand
        rounds += 1


def components(
    u: np.ndarray,
    v: np.ndarray,
    offsets: Sequence[int],
    parent: np.ndarray | None = None,
    tick: Callable[[], None] | None = None,
) -> tuple[np.ndarray, int]:
    """Each of this rank's nodes' root (the smallest member of its component) over the edges
    ``u - v`` (this rank's share; collective), and the hooking rounds it took. ``parent``: a
    forest to start from (the roots of a subset of these edges: a curve's previous threshold).
    ``tick()``: once per round (the heartbeat)."""
    rank = dist.rank()
    lo, hi = offsets[rank], offsets[rank + 1]
    parent = np.arange(lo, hi, dtype=np.int64) if parent is None else parent.copy()
    rounds = 0
    while True:
        pu, pv = fetch_ends(parent, u, v, offsets)
        apart = pu != pv
        if not dist.any_rank(bool(apart.any())):
            return parent, rounds
        big, small = np.maximum(pu, pv)[apart], np.minimum(pu, pv)[apart]
        big, small = _send(owner(big, offsets), big, small)
        np.minimum.at(parent, big - lo, small)
        _shortcut(parent, offsets)
        rounds += 1
        if tick is not None:
            tick()


def root_sizes(root: np.ndarray, offsets: Sequence[int]) -> np.ndarray:
    """For each of this rank's nodes, the size of the component it is the root of (0 for a node
    that is not a root)."""
    lo, hi = offsets[dist.rank()], offsets[dist.rank() + 1]
    (got,) = _send(owner(root, offsets), root)
    return np.bincount(got - lo, minlength=hi - lo).astype(np.int64)


def split_large(
    graph: ShardedGraph, threshold: float, root: np.ndarray, max_size: int
) -> np.ndarray:
    """Roots after splitting every component larger than ``max_size`` as
    ``clustering._split_large`` does; each such component is split by the owner of its smallest
    member, which receives its members and kept edges."""
    offsets, lo = graph.offsets, graph.lo
    large = root_sizes(root, offsets) > max_size
    if not dist.any_rank(bool(large.any())):
        return root
    in_large = fetch(large, root, offsets)
    nodes = np.arange(lo, graph.hi, dtype=np.int64)
    m_ids, m_root = _send(owner(root[in_large], offsets), nodes[in_large], root[in_large])
    keep = graph.w >= threshold
    e_root = fetch(root, graph.v[keep], offsets)
    e_large = fetch(large, e_root, offsets)
    sel = np.flatnonzero(keep)[e_large]
    e_u, e_v, e_uv, e_vu, e_root = _send(
        owner(e_root[e_large], offsets),
        graph.u[sel],
        graph.v[sel],
        graph.w_uv[sel],
        graph.w_vu[sel],
        e_root[e_large],
    )
    new_ids, new_roots = [], []
    for r in np.unique(m_root):
        members = np.sort(m_ids[m_root == r])
        mine = e_root == r
        a, b = np.searchsorted(members, e_u[mine]), np.searchsorted(members, e_v[mine])
        data = np.concatenate([e_uv[mine], e_vu[mine]]).astype(np.float32)
        # scipy.sparse takes ~0.4 s to import: only mining needs it, not the first step
        from scipy import sparse

        sub = sparse.csr_matrix(
            (data, (np.concatenate([a, b]), np.concatenate([b, a]))),
            shape=(len(members), len(members)),
        )
        pieces = _split_large(sub, np.zeros(len(members), np.int64), max_size)
        smallest = np.full(pieces.max() + 1, len(members))
        np.minimum.at(smallest, pieces, np.arange(len(members)))
        new_ids.append(members)
        new_roots.append(members[smallest[pieces]])
    ids = np.concatenate(new_ids) if new_ids else np.zeros(0, np.int64)
    roots = np.concatenate(new_roots) if new_roots else np.zeros(0, np.int64)
    ids, roots = _send(owner(ids, offsets), ids, roots)
    root = root.copy()
    root[ids - lo] = roots
    return root


def number(root: np.ndarray, offsets: Sequence[int], singletons: str = "cluster") -> np.ndarray:
    """Labels 0..C-1 in order of each cluster's smallest member (its root); with
    ``singletons="ignore"``, -1 for clusters of one and the others numbered among themselves."""
    rank = dist.rank()
    lo, hi = offsets[rank], offsets[rank + 1]
    kept = root == np.arange(lo, hi)
    if singletons == "ignore":
        kept &= root_sizes(root, offsets) > 1
    counts = np.zeros(dist.world())
    counts[rank] = kept.sum()
    start = int(dist.all_reduce_sum(counts)[:rank].sum())
    label = np.full(hi - lo, -1, np.int64)
    label[kept] = start + np.arange(int(kept.sum()))
    return fetch(label, root, offsets)


def sharded_clusters(
    graph: ShardedGraph,
    threshold: float,
    singletons: str = "cluster",
    max_cluster_size: int = 0,
    tick: Callable[[], None] | None = None,
) -> tuple[np.ndarray, dict[str, int]]:
    """This rank's nodes' labels at ``threshold`` (collective), and how the work went
    (``hooking_rounds``, ``mutual_edges`` kept, on every rank)."""
    keep = graph.w >= threshold
    root, rounds = components(graph.u[keep], graph.v[keep], graph.offsets, tick=tick)
    if max_cluster_size:
        root = split_large(graph, threshold, root, max_cluster_size)
    kept = int(dist.all_reduce_sum([keep.sum()])[0])
    return number(root, graph.offsets, singletons), {"hooking_rounds": rounds, "mutual_edges": kept}
