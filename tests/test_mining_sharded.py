"""mining.search=sharded on real gloo ranks: every rank searches its own shard, the mutual edges
and the components are found across ranks, and the labels equal ``mutual_knn_clusters`` on the
gathered embeddings."""

import numpy as np
import pytest
from multirank import SharedRanks

from clusterflow.mining import mutual_knn_clusters


def _data(n, d=16, seed=0, ties=False):
    """Blobs with exact duplicates (ties) and, with ``ties``, integer rows (many equal
    similarities)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((max(2, n // 20), d))
    x = centres[rng.integers(0, len(centres), n)] + 0.35 * rng.standard_normal((n, d))
    if ties:
        x = np.round(x)
    x = x.astype(np.float32)
    x[5::17] = x[3]  # duplicates of one row: ties at similarity 1
    return x


def _sharded(x, offsets, k, threshold, engine, index="flat", qb=7, singletons="cluster", mcs=0):
    from clusterflow.distributed import comm as dist
    from clusterflow.mining import normalize
    from clusterflow.mining.knn import KnnParams
    from clusterflow.mining.knn.sharded import sharded_search
    from clusterflow.mining.sharded_graph import mutual_edges, sharded_clusters

    lo, hi = offsets[dist.rank()], offsets[dist.rank() + 1]
    params = KnnParams(k=k, engine=engine, index=index, query_batch=qb)
    sims, ids = sharded_search(normalize(x[lo:hi]), offsets, params, engine)
    graph = mutual_edges(sims, ids, offsets)
    labels, info = sharded_clusters(graph, threshold, singletons, mcs)
    return sims, ids, labels, info


def _gathered(parts):
    return [np.concatenate([p[i] for p in parts]) for i in range(3)]


CASES = [
    # world, shard sizes, k, threshold, singletons, max cluster size
    (2, [60, 41], 6, 0.5, "cluster", 0),
    (3, [30, 4, 50], 6, 0.7, "ignore", 0),  # a shard smaller than k
    (4, [25, 0, 31, 27], 5, 0.3, "cluster", 12),  # an empty shard; giant components split
    (3, [40, 33, 29], 8, 0.0, "ignore", 9),
]


@pytest.mark.parametrize("world,sizes,k,threshold,singletons,mcs", CASES)
@pytest.mark.parametrize("ties", [False, True])
def test_sharded_torch_labels_equal_one_process(
    ranks, world, sizes, k, threshold, singletons, mcs, ties
):
    from clusterflow.mining import normalize
    from clusterflow.mining.knn.torch_engine import torch_search

    x = _data(sum(sizes), ties=ties)
    parts = ranks["torch", world, tuple(sizes), k, threshold, singletons, mcs, ties]
    sims, ids, labels = _gathered(parts)
    want_s, want_i = torch_search(normalize(x), k, device="cpu")
    np.testing.assert_array_equal(ids, want_i)
    np.testing.assert_array_equal(sims, want_s)
    want = mutual_knn_clusters(
        x, k, threshold, engine="torch", singletons=singletons, max_cluster_size=mcs
    )
    np.testing.assert_array_equal(labels, want)
    assert parts[0][3]["mutual_edges"] > 0 and len(set(want.tolist())) > 2


def test_sharded_faiss_flat_equals_faiss_on_all_rows(ranks):
    """Duplicates included (ties above the k-th place). Equal similarities that straddle the k-th
    place are kept by FAISS's heap in an order no merge can reproduce (the torch engine's is a
    total order: the tests above); blocks of at least 20 rows keep FAISS on its BLAS path."""
    from clusterflow.mining import normalize
    from clusterflow.mining.knn import KnnParams, search

    x = _data(150)
    parts = ranks["faiss flat"]
    sims, ids, labels = _gathered(parts)
    want_s, want_i = search(normalize(x), KnnParams(k=6, engine="faiss"))
    np.testing.assert_array_equal(ids, want_i)
    np.testing.assert_array_equal(sims, want_s)
    want = mutual_knn_clusters(x, 6, 0.5, engine="faiss", singletons="ignore", max_cluster_size=15)
    np.testing.assert_array_equal(labels, want)


def test_sharded_approximate_indexes_find_most_neighbours(ranks):
    from clusterflow.mining import normalize
    from clusterflow.mining.knn import KnnParams, search

    x = _data(400, d=8)
    _, want = search(normalize(x), KnnParams(k=5, engine="torch"))
    for index in ("ivf", "hnsw"):
        parts = ranks["faiss", index]
        _, ids, _ = _gathered(parts)
        recall = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(ids, want)])
        assert recall > 0.9, (index, recall)


def _sharded_curve(x, offsets, k, truth):
    from clusterflow.distributed import comm as dist
    from clusterflow.mining import normalize
    from clusterflow.mining.knn import KnnParams
    from clusterflow.mining.knn.sharded import sharded_search
    from clusterflow.mining.sharded_curves import sharded_resolve
    from clusterflow.mining.sharded_graph import mutual_edges, sharded_clusters

    lo, hi = offsets[dist.rank()], offsets[dist.rank() + 1]
    lists = sharded_search(normalize(x[lo:hi]), offsets, KnnParams(k=k, query_batch=9), "torch")
    graph = mutual_edges(*lists, offsets)
    threshold, curve = sharded_resolve(graph, "auto", truth)
    labels, _ = sharded_clusters(graph, threshold, "ignore", 0)
    return threshold, curve.to_dict(), labels


CURVE_CASES = [(2, [70, 53]), (3, [40, 3, 77]), (4, [30, 31, 0, 45])]


@pytest.mark.parametrize("world,sizes", CURVE_CASES)
def test_sharded_curve_and_auto_threshold_equal_one_process(ranks, world, sizes):
    from clusterflow.mining import curves, normalize
    from clusterflow.mining.knn.torch_engine import torch_search

    x = _data(sum(sizes), ties=world == 3)
    truth = np.arange(len(x)) % 7
    parts = ranks["curve", world, tuple(sizes)]
    lists = torch_search(normalize(x), 6, device="cpu")
    t_want, want = curves.resolve_threshold(*lists, "auto", truth)
    labels = mutual_knn_clusters(x, 6, "auto", engine="torch", singletons="ignore")
    for threshold, got, _ in parts:
        assert threshold == t_want
        for name in ("thresholds", "num_clusters", "num_singletons", "largest_cluster"):
            assert got[name] == want.to_dict()[name], name
        assert got["mutual_edges"] == want.to_dict()["mutual_edges"]
        for name in ("modularity", "nmi", "ari"):
            np.testing.assert_allclose(got[name], want.to_dict()[name], rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(np.concatenate([p[2] for p in parts]), labels)


@pytest.fixture(scope="module")
def ranks():
    """Every gloo call of this module, on the data its test builds, with one spawn per world
    size."""
    calls = {}
    for ties in (False, True):
        for world, sizes, k, threshold, singletons, mcs in CASES:
            x, offsets = _data(sum(sizes), ties=ties), list(np.cumsum([0, *sizes]))
            args = (x, offsets, k, threshold, "torch", "flat", 7, singletons, mcs)
            key = ("torch", world, tuple(sizes), k, threshold, singletons, mcs, ties)
            calls[key] = (world, _sharded, args)
    x = _data(150)
    calls["faiss flat"] = (
        3,
        _sharded,
        (x, [0, 50, 90, 150], 6, 0.5, "faiss", "flat", 20, "ignore", 15),
    )
    x = _data(400, d=8)
    for index in ("ivf", "hnsw"):
        calls["faiss", index] = (2, _sharded, (x, [0, 200, 400], 5, 0.5, "faiss", index, 64))
    for world, sizes in CURVE_CASES:
        x, offsets = _data(sum(sizes), ties=world == 3), list(np.cumsum([0, *sizes]))
        truth = np.arange(len(x)) % 7
        calls["curve", world, tuple(sizes)] = (world, _sharded_curve, (x, offsets, 6, truth))
    return SharedRanks(calls)
