import numpy as np
import pytest
from scipy import sparse
from scipy.sparse.csgraph import connected_components

from clusterflow.mining import cluster_stats, mutual_knn_clusters
from clusterflow.mining.quality import quality


def reference(emb, k, threshold):
    """The contract, written the slow obvious way."""
    x = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    sim = x @ x.T
    n = len(x)
    np.fill_diagonal(sim, -np.inf)
    nn = [set(np.argsort(-sim[i], kind="stable")[:k]) for i in range(n)]
    edges = [(i, j) for i in range(n) for j in nn[i] if i in nn[j] and sim[i, j] >= threshold]
    g = sparse.coo_matrix(
        (np.ones(len(edges)), ([e[0] for e in edges], [e[1] for e in edges])), shape=(n, n)
    )
    _, lab = connected_components(g, directed=False)
    order = {}
    out = np.empty(n, np.int64)
    for i in range(n):
        out[i] = order.setdefault(lab[i], len(order))
    return out


def blobs(n=400, d=16, centers=30, spread=0.4, seed=0):
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((centers, d))
    y = rng.integers(0, centers, n)
    return (c[y] + spread * rng.standard_normal((n, d))).astype(np.float32), y


@pytest.mark.parametrize("engine", ["faiss", "torch"])
@pytest.mark.parametrize("k,threshold", [(1, 0.0), (5, 0.5), (10, 0.8), (20, -1.0)])
def test_matches_brute_force_definition(engine, k, threshold):
    emb, _ = blobs()
    got = mutual_knn_clusters(emb, k, threshold, engine=engine)
    assert got.dtype == np.int64 and got.shape == (len(emb),)
    np.testing.assert_array_equal(got, reference(emb, k, threshold))


def test_numbered_by_smallest_member():
    emb, _ = blobs(seed=3)
    lab = mutual_knn_clusters(emb, 5, 0.3)
    firsts = [np.flatnonzero(lab == c)[0] for c in range(lab.max() + 1)]
    assert firsts == sorted(firsts) and lab[0] == 0


def test_k_larger_than_n_and_tiny_inputs():
    emb = np.eye(3, dtype=np.float32) + 0.01
    assert mutual_knn_clusters(emb, 10, 0.0).tolist() == reference(emb, 2, 0.0).tolist()
    assert mutual_knn_clusters(np.ones((1, 4), np.float32), 3, 0.0).tolist() == [0]


def test_singletons_ignored_get_minus_one():
    emb, _ = blobs(seed=1)
    base = mutual_knn_clusters(emb, 5, 0.9)
    ign = mutual_knn_clusters(emb, 5, 0.9, singletons="ignore")
    sizes = np.bincount(base)
    assert ((ign == -1) == (sizes[base] == 1)).all()
    kept = ign[ign >= 0]
    assert set(kept.tolist()) == set(range(kept.max() + 1))


def test_max_cluster_size_splits_chains():
    rng = np.random.default_rng(0)
    t = np.linspace(0, 3, 300)
    chain = np.stack([np.cos(t), np.sin(t), 0.01 * rng.standard_normal(300)], 1).astype(
        np.float32
    )  # one long arc
    whole = mutual_knn_clusters(chain, 4, 0.0)
    assert np.bincount(whole).max() > 250  # one giant chained component
    split = mutual_knn_clusters(chain, 4, 0.0, max_cluster_size=50)
    assert np.bincount(split).max() <= 50


def test_ivf_and_hnsw_run_and_mostly_agree():
    emb, _ = blobs(n=2000, centers=50)
    exact = mutual_knn_clusters(emb, 10, 0.5)
    for index in ("ivf", "hnsw"):
        approx = mutual_knn_clusters(emb, 10, 0.5, index=index, nlist=16, nprobe=8)
        assert quality(approx, exact)["ari"] > 0.9


def test_torch_engine_bf16_candidates_rerank_is_exact():
    from clusterflow.mining import normalize
    from clusterflow.mining.knn import KnnParams
    from clusterflow.mining.knn.faiss_engine import faiss_search
    from clusterflow.mining.knn.torch_engine import torch_search

    x = normalize(blobs(n=600, d=32)[0])
    s1, i1 = faiss_search(x, KnnParams(k=8))
    s2, i2 = torch_search(x, 8, candidate_dtype="bf16", db_chunk=128, query_batch=100)
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_allclose(s1, s2, atol=1e-5)


def test_torch_engine_splits_query_batches_over_several_devices():
    """What every local GPU does on a GPU node, with two CPU "devices": the same exact result,
    and a signal still stops the search between query batches."""
    from clusterflow.mining import normalize
    from clusterflow.mining.knn import SearchHooks
    from clusterflow.mining.knn.torch_engine import torch_search

    x = normalize(blobs(n=601, d=32)[0])
    one = torch_search(x, 8, db_chunk=128, query_batch=50, device="cpu")
    two = torch_search(x, 8, db_chunk=128, query_batch=50, device=["cpu", "cpu"])
    np.testing.assert_array_equal(one[1], two[1])
    np.testing.assert_array_equal(one[0], two[0])
    calls = []
    assert (
        torch_search(
            x,
            8,
            query_batch=50,
            device=["cpu", "cpu"],
            hooks=SearchHooks(lambda: calls.append(1) or len(calls) > 3),
        )
        is None
    )


def test_quality_metrics_known_values():
    truth = np.array([0, 0, 0, 1, 1, 1])
    perfect = quality(np.array([5, 5, 5, 2, 2, 2]), truth)
    assert perfect["pairwise_f"] == 1 and perfect["bcubed_f"] == 1 and perfect["ari"] == 1
    single = quality(np.arange(6), truth)
    assert single["pairwise_f"] == 0 and single["bcubed_precision"] == 1
    assert single["nmi"] > single["pairwise_f"]  # NMI flatters over-segmentation
    ign = quality(np.array([-1, -1, 0, 1, 1, 1]), truth)
    assert ign == quality(np.array([7, 8, 0, 1, 1, 1]), truth)
    # BCubed by hand for a 2+1 / 3 split: precision 1, recall (2*2/3 + 1/3 + 3*1)/6
    b = quality(np.array([0, 0, 1, 2, 2, 2]), truth)
    assert b["bcubed_precision"] == pytest.approx(1.0)
    assert b["bcubed_recall"] == pytest.approx((4 / 3 + 1 / 3 + 3) / 6)


def test_stats():
    s = cluster_stats(np.array([0, 0, 1, 2, 2, 2, -1]))
    assert s["num_clusters"] == 4 and s["num_singletons"] == 2 and s["largest_cluster"] == 3
