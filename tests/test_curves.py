"""Threshold curves and the automatic threshold (clusterflow.mining.curves) against clustering at
one fixed threshold, as mutual_knn_clusters does (``today``)."""

import math

import numpy as np
import pytest

from clusterflow.mining import curves
from clusterflow.mining.clustering import (
    clusters_from_graph,
    mutual_edges,
    mutual_knn_clusters,
    normalize,
    number_by_smallest_member,
)
from clusterflow.mining.knn import KnnParams, search
from clusterflow.mining.quality import Agreement, quality


def faiss_search(x, k):
    return search(x, KnnParams(k=k, engine="faiss"))


def torch_search(x, k):
    return search(x, KnnParams(k=k, engine="torch"))


def blobs(n=400, d=16, centers=30, spread=0.4, seed=0):
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((centers, d))
    y = rng.integers(0, centers, n)
    return (c[y] + spread * rng.standard_normal((n, d))).astype(np.float32), y


def with_ties(seed=0):
    """Small integer vectors: many exactly equal similarities, and duplicate rows."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-2, 3, (300, 6)).astype(np.float32)
    return np.concatenate([x, x[:40], x[:10]]), None


def digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x - x.mean(0)).astype(np.float32), y


def today(sims, ids, t):
    """What mutual_knn_clusters does once it has the k-NN lists."""
    graph = mutual_edges(sims, ids, t)
    return clusters_from_graph(graph), graph.nnz // 2


def sweep_labels(sims, ids, grid):
    g = curves.mutual_graph(sims, ids)
    return [
        number_by_smallest_member(comp) for _, _, _, _, comp in curves._sweep(g, grid, labels=True)
    ]


@pytest.mark.parametrize("search", [faiss_search, torch_search])
@pytest.mark.parametrize("data,k", [(blobs, 5), (blobs, 20), (with_ties, 8), (digits, 10)])
def test_curve_equals_mutual_knn_clusters_at_every_grid_point(search, data, k):
    x = normalize(data()[0])
    sims, ids = search(x, k)
    curve = curves.threshold_curve(sims, ids)
    assert len(curve.thresholds) > 20
    labels = sweep_labels(sims, ids, curve.thresholds)
    for i, t in enumerate(curve.thresholds.tolist()):
        want, edges = today(sims, ids, t)
        sizes = np.bincount(want)
        assert curve.num_clusters[i] == len(sizes) and curve.mutual_edges[i] == edges, t
        assert (
            curve.num_singletons[i] == (sizes == 1).sum()
            and curve.largest_cluster[i] == sizes.max()
        ), t
        np.testing.assert_array_equal(labels[i], want)
    assert curve.mutual_edges[0] == 0 and curve.mutual_edges[-1] == today(sims, ids, -np.inf)[1]


def test_the_public_function_agrees_with_the_curve():
    emb, _ = blobs(seed=2)
    sims, ids = faiss_search(normalize(emb), 10)
    curve = curves.threshold_curve(sims, ids)
    for t in curve.thresholds[::7].tolist():
        assert mutual_knn_clusters(emb, 10, t).max() + 1 == curve.row(t)["num_clusters"]


def random_lists(n, k, seed):
    """Arbitrary "k-NN lists": random ids (with -1 and repeats), random similarities with ties,
    exact zeros, negatives and a NaN, not from any geometry; a hard case for the mutual filter
    and the sweep. No row lists itself (the engines never do)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(-1, n, (n, k))
    near = (
        np.arange(n)[:, None] + rng.integers(-3, 4, (n, k))
    ) % n  # mostly close ids, so many pairs are mutual
    ids = np.where(rng.random((n, k)) < 0.7, near, ids)
    ids[ids == np.arange(n)[:, None]] = -1
    sims = np.round(rng.uniform(-0.5, 1.0, (n, k)) * 20) / 20  # steps of 0.05: ties and exact zeros
    sims = sims.astype(np.float32)
    sims[0, 0] = np.nan
    sims[ids < 0] = -np.inf
    return sims, ids


def brute_force(sims, ids, t):
    """The definition the slow obvious way: each listed neighbour once, with its best similarity
    (a NaN never passes); edge i-j iff each lists the other with a similarity >= t."""
    best = [{} for _ in range(len(ids))]
    for i, row in enumerate(ids):
        for j, s in zip(row.tolist(), sims[i].tolist()):
            if j >= 0 and j != i and not math.isnan(s):
                best[i][j] = max(best[i].get(j, -np.inf), s)
    # compared as float32, like numpy
    passes = lambda i, j: j in best[i] and np.float32(best[i][j]) >= t
    edges = sorted(
        (i, j) for i in range(len(ids)) for j in best[i] if i < j and passes(i, j) and passes(j, i)
    )
    parent = list(range(len(ids)))

    def root(a):
        while parent[a] != a:
            a = parent[a]
        return a

    for i, j in edges:
        parent[root(i)] = root(j)
    return number_by_smallest_member(np.array([root(i) for i in range(len(ids))])), len(edges)


@pytest.mark.parametrize("seed", range(6))
def test_sweep_and_mutual_edges_match_brute_force_on_random_graphs(seed):
    sims, ids = random_lists(120, 6, seed)
    ids[5, :2] = [9, 9]  # one neighbour listed twice
    ids[9, 0], sims[5, :2], sims[9, 0] = (
        5,
        [0.0, np.nan],
        0.0,
    )  # mutual at exactly 0.0 (its other listing NaN)
    grid = np.round(np.arange(1.0, -0.6, -0.05), 2)
    curve = curves.threshold_curve(sims, ids, grid)
    labels = sweep_labels(sims, ids, grid)
    for i, t in enumerate(grid.tolist()):
        want, edges = brute_force(sims, ids, t)
        np.testing.assert_array_equal(labels[i], want)
        np.testing.assert_array_equal(today(sims, ids, t)[0], want)
        assert curve.mutual_edges[i] == edges == today(sims, ids, t)[1], t


def test_thresholds_compare_like_mutual_edges_in_float32():
    """0.7 is not a float32: float32(0.7) < 0.7. A similarity equal to float32(0.7) passes
    `sims >= 0.7` in mutual_edges (float32 comparison); the curve must count it too."""
    s = np.float32(0.7)
    assert float(s) < 0.7
    ids = np.array([[1], [0], [3], [2]])
    sims = np.array([[s], [s], [np.nextafter(s, np.float32(0))], [0.9]], np.float32)
    curve = curves.threshold_curve(sims, ids, np.array([0.8, 0.7, 0.6]))
    assert (
        curve.mutual_edges.tolist()
        == [0, 1, 2]
        == [today(sims, ids, t)[1] for t in (0.8, 0.7, 0.6)]
    )
    assert curves.kept_edges(curves.mutual_graph(sims, ids), 0.7) == 1


def test_mutual_graph_keeps_the_lower_of_the_two_directed_similarities():
    ids = np.array([[1, 2], [0, 2], [1, 0]])
    sims = np.array([[0.9, 0.5], [0.8, 0.7], [0.6, 0.4]], np.float32)
    g = curves.mutual_graph(sims, ids)
    assert sorted(zip(g.u.tolist(), g.v.tolist(), g.w.tolist())) == [
        (0, 1, pytest.approx(0.8)),
        (0, 2, pytest.approx(0.4)),
        (1, 2, pytest.approx(0.6)),
    ]
    assert g.w.tolist() == sorted(g.w.tolist(), reverse=True)


def test_nmi_and_ari_along_the_curve_are_those_of_the_labels():
    emb, y = blobs(seed=4)
    sims, ids = torch_search(normalize(emb), 10)
    curve = curves.threshold_curve(sims, ids, truth=y)
    for i in (5, len(curve.thresholds) // 2, len(curve.thresholds) - 1):
        q = quality(today(sims, ids, curve.thresholds[i].item())[0], y)
        assert curve.nmi[i] == pytest.approx(q["nmi"]) and curve.ari[i] == pytest.approx(q["ari"])


def test_modularity_along_the_curve_is_that_of_the_labels():
    emb, _ = blobs(seed=5)
    sims, ids = faiss_search(normalize(emb), 10)
    g = curves.mutual_graph(sims, ids)
    curve = curves.threshold_curve(sims, ids, graph=g)
    for i in range(0, len(curve.thresholds), 9):
        assert curve.modularity[i] == pytest.approx(
            curves.modularity(g, today(sims, ids, curve.thresholds[i].item())[0]), abs=1e-9
        )
    assert curves.modularity(g, np.zeros(len(emb), int)) == pytest.approx(0.0, abs=1e-12)


def test_auto_on_the_digits_reaches_nmi_070():
    """Done-when of issue 18: threshold 0.6 gives NMI 0.26 here (one component of 1,594);
    k-means with the true k=10 gives 0.74."""
    x, y = digits()
    sims, ids = faiss_search(normalize(x), 10)
    t, curve = curves.resolve_threshold(sims, ids, "auto")
    labels, _ = today(sims, ids, t)
    assert quality(labels, y)["nmi"] >= 0.70
    assert quality(today(sims, ids, 0.6)[0], y)["nmi"] < 0.3
    assert t == curve.thresholds[np.argmax(curve.modularity)] and 0.7 < t < 0.9


def test_auto_on_noise_invents_no_giant_cluster():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2000, 32)).astype(np.float32)
    sims, ids = faiss_search(normalize(x), 10)
    t, curve = curves.resolve_threshold(sims, ids, "auto")
    sizes = np.bincount(today(sims, ids, t)[0])
    assert sizes.max() < 0.25 * len(x) and len(sizes) > 100
    assert curve.largest_cluster[-1] == len(x)  # the lowest threshold would have made one


def test_auto_beats_06_on_demo_like_identities():
    from clusterflow.tasks.pseudo_id import IdentityWorld, SyntheticIdentities

    ds = SyntheticIdentities(0, IdentityWorld(200, 64, 8, 16, 0.5, 0.1), 20, augment=False)
    sims, ids = faiss_search(normalize(ds.base), 10)
    t, _ = curves.resolve_threshold(sims, ids, "auto")
    auto, fixed = (quality(today(sims, ids, v)[0], ds.labels) for v in (t, 0.6))
    assert auto["nmi"] > fixed["nmi"] + 0.05 and auto["ari"] > fixed["ari"]


def test_numeric_thresholds_pass_through_unchanged():
    sims, ids = faiss_search(normalize(blobs()[0]), 5)
    for value in (0.6, np.float32(0.6), -1.0):
        t, curve = curves.resolve_threshold(sims, ids, value)
        assert t is value and len(curve.thresholds) > 1
    with pytest.raises(ValueError, match="'0.6x'"):
        curves.resolve_threshold(sims, ids, "0.6x")
    with pytest.raises(ValueError, match="descending"):
        curves.threshold_curve(sims, ids, np.array([0.5, 0.6]))


def test_no_mutual_edge_at_all():
    sims = np.full((3, 2), -np.inf, np.float32)
    ids = np.full((3, 2), -1)
    t, curve = curves.resolve_threshold(sims, ids, "auto")
    assert curve.num_clusters.tolist() == [3] and today(sims, ids, t)[0].tolist() == [0, 1, 2]


def test_deterministic():
    emb, y = blobs(seed=7)
    sims, ids = faiss_search(normalize(emb), 10)
    a, b = (curves.threshold_curve(sims, ids, truth=y).to_dict() for _ in range(2))
    assert a == b


def test_fast_nmi_ari_are_sklearns_limit_cases_included():
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    rng = np.random.default_rng(0)
    cases = [
        (rng.integers(0, 5, 300), rng.integers(0, 7, 300)),
        (np.zeros(50), np.zeros(50)),
        (np.zeros(50), np.arange(50)),
        (np.arange(50), np.arange(50)),
        (np.arange(50) % 3, np.zeros(50)),
        (np.array([3]), np.array([0])),
        (rng.integers(0, 40, 1000), rng.integers(0, 40, 1000) // 2),
    ]
    for truth, labels in cases:
        labels = np.unique(labels, return_inverse=True)[1]
        got = Agreement(truth)(labels)
        want = (normalized_mutual_info_score(truth, labels), adjusted_rand_score(truth, labels))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # quality(): label -1 is a singleton of its own, as sklearn sees fresh labels
    truth = rng.integers(0, 30, 2000)
    pred = np.where(rng.random(2000) < 0.2, -1, truth // 2)
    own = pred.copy()
    own[own < 0] = 1000 + np.arange((own < 0).sum())
    q = quality(pred, truth)
    want = (normalized_mutual_info_score(truth, own), adjusted_rand_score(truth, own))
    np.testing.assert_allclose((q["nmi"], q["ari"]), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("data,k", [(blobs, 10), (with_ties, 8)])
def test_cluster_counts_at_every_breakpoint(data, k):
    sims, ids = faiss_search(normalize(data()[0]), k)
    g = curves.mutual_graph(sims, ids)
    merges = curves.merge_similarities(g)
    assert np.all(np.diff(merges) <= 0)
    # at a sample of the breakpoints, exactly, and just above each (one float32 step)
    points = merges[:: max(1, len(merges) // 150)]
    for t in points.tolist() + np.nextafter(points, np.float32(2)).tolist() + [2.0, -2.0]:
        assert curves.clusters_at(g.n, merges, t) == today(sims, ids, t)[0].max() + 1, t
    curve = curves.threshold_curve(sims, ids, graph=g)
    assert [
        curves.clusters_at(g.n, merges, t) for t in curve.thresholds.tolist()
    ] == curve.num_clusters.tolist()


# -- the one mutual-edge definition (clusterflow/mining/mutual_graph.py) -------------------------


def mutual_edges_before_issue_18(sims, ids, threshold):
    """clustering.mutual_edges as a sparse matrix product, the implementation before issue 18: the
    reference for the bitwise comparison below."""
    from scipy import sparse

    n, k = ids.shape
    rows = np.repeat(np.arange(n, dtype=np.int64), k)
    cols = ids.ravel()
    keep = (cols >= 0) & (sims.ravel() >= threshold)
    rows, cols, vals = rows[keep], cols[keep], sims.ravel()[keep]
    a = sparse.csr_matrix((np.ones(len(rows), np.int8), (rows, cols)), shape=(n, n))
    w = sparse.csr_matrix((vals.astype(np.float32), (rows, cols)), shape=(n, n))
    return w.multiply(a.multiply(a.T)).tocsr()


def test_a_mutual_edge_of_similarity_zero_is_kept():
    """Two orthogonal rows are each other's only neighbour at similarity exactly 0.0: kept at
    threshold 0 by the definition (the sparse multiply of mutual_edges_before_issue_18 drops it:
    two clusters)."""
    x = np.array([[1, 0], [0, 1], [5, 5], [5, 5.001]], np.float32)
    assert mutual_knn_clusters(x[:2], 1, 0.0, engine="torch").tolist() == [0, 0]
    sims, ids = np.array([[0.0], [0.0], [0.5], [0.5]], np.float32), np.array([[1], [0], [3], [2]])
    graph = mutual_edges(sims, ids, 0.0)
    assert (
        graph.nnz == 4
        and graph[0, 1] == 0.0
        and clusters_from_graph(graph).tolist() == [0, 0, 1, 1]
    )
    assert mutual_edges_before_issue_18(sims, ids, 0.0).nnz == 2  # the defect


def test_a_neighbour_listed_twice_counts_once_with_its_best_similarity():
    sims = np.array([[0.3, 0.4], [0.35, -np.inf]], np.float32)
    ids = np.array([[1, 1], [0, -1]])
    assert mutual_edges(sims, ids, 0.3).toarray().tolist() == [
        [0, np.float32(0.4)],
        [np.float32(0.35), 0],
    ]
    assert mutual_edges_before_issue_18(sims, ids, 0.3)[0, 1] == pytest.approx(
        1.4
    )  # the defect: (0.3 + 0.4) x 2
    assert mutual_edges(sims, ids, 0.36).nnz == 0  # 1 lists 0 at 0.35 only


@pytest.mark.parametrize(
    "data,k,engine",
    [(blobs, 10, "faiss"), (blobs, 20, "torch"), (with_ties, 8, "faiss"), (digits, 10, "faiss")],
)
def test_every_other_result_is_bitwise_what_it_was(data, k, engine):
    """Without zeros, repeats or self listings, the matrix (structure and values) is the one
    mutual_edges_before_issue_18 builds, at every threshold: labels, edge counts and
    max_cluster_size's splits (which read the values) are the same."""
    x = normalize(data()[0])
    sims, ids = search(x, KnnParams(k=k, engine=engine))
    for t in (-1.0, 0.0, 0.3, 0.5, 0.6, 0.7, 0.8225, 0.9, np.float32(0.7), np.float64(0.7)):
        new, old = mutual_edges(sims, ids, t), mutual_edges_before_issue_18(sims, ids, t)
        new.sort_indices(), old.sort_indices()
        assert new.dtype == old.dtype == np.float32 and new.shape == old.shape
        np.testing.assert_array_equal(new.indptr, old.indptr)
        np.testing.assert_array_equal(new.indices, old.indices)
        np.testing.assert_array_equal(new.data, old.data)
        for size in (0, 40):
            np.testing.assert_array_equal(
                clusters_from_graph(new, max_cluster_size=size),
                clusters_from_graph(old, max_cluster_size=size),
            )


def test_auto_threshold_in_the_public_function():
    x, y = digits()
    labels = mutual_knn_clusters(x, 10, "auto")
    assert quality(labels, y)["nmi"] >= 0.70
    with pytest.raises(ValueError, match="'automatic'"):
        mutual_knn_clusters(x, 10, "automatic")


def test_thin_keeps_the_ends_and_the_chosen_threshold():
    sims, ids = faiss_search(normalize(digits()[0]), 10)
    t, curve = curves.resolve_threshold(sims, ids, "auto")
    full = curve.to_dict()
    small = curves.thin(full, t, points=10)
    assert len(full["thresholds"]) > 100 and 10 <= len(small["thresholds"]) <= 11
    assert (
        small["thresholds"][0] == full["thresholds"][0]
        and small["thresholds"][-1] == full["thresholds"][-1]
    )
    assert t in small["thresholds"] and set(small) == set(full)
    i = small["thresholds"].index(t)
    assert {name: values[i] for name, values in small.items()} == curve.row(t)
    assert curves.thin(small, t, points=50) == small
