"""FINCH over our k-NN lists (clusterflow.mining.finch) against a brute-force reference."""

import itertools

import numpy as np
import pytest

from clusterflow.mining.clustering import normalize, number_by_smallest_member
from clusterflow.mining.finch import default_search, finch_clusters, finch_levels, silhouette
from clusterflow.mining.knn import KnnParams, search
from clusterflow.mining.quality import quality


def faiss_search(x, k):
    return search(x, KnnParams(k=k, engine="faiss"))


def torch_search(x, k):
    return search(x, KnnParams(k=k, engine="torch"))


def reference(x):
    """FINCH the slow obvious way: dense cosine similarities, first neighbour by argmax (ties to
    the smaller index), union-find, float64 means; the authors' stopping rule."""

    def first_neighbour_partition(v):
        v = v / np.linalg.norm(v, axis=1, keepdims=True)
        sim = v @ v.T
        np.fill_diagonal(sim, -np.inf)
        parent = list(range(len(v)))

        def root(i):
            while parent[i] != i:
                i = parent[i]
            return i

        for i, j in enumerate(np.argmax(sim, 1)):
            parent[root(i)] = root(j)
        return number_by_smallest_member(np.array([root(i) for i in range(len(v))]))

    x = x.astype(np.float64)
    levels = [first_neighbour_partition(x)]
    while levels[-1].max() + 1 > 2:
        current = levels[-1]
        means = np.stack([x[current == c].mean(0) for c in range(current.max() + 1)])
        merged = first_neighbour_partition(means)
        if merged.max() == 0 or merged.max() + 1 >= current.max():
            break
        levels.append(merged[current])
    return levels


def blobs(n=500, d=12, centers=40, spread=0.5, seed=0):
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((centers, d))
    y = rng.integers(0, centers, n)
    return normalize((c[y] + spread * rng.standard_normal((n, d))).astype(np.float32)), y


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("engine", ["torch", "faiss"])
def test_levels_match_brute_force(seed, engine):
    x, _ = blobs(seed=seed)
    search = torch_search if engine == "torch" else faiss_search
    ids = search(x, 5)[1]
    got = finch_levels(x, ids, default_search(KnnParams(k=1, engine=engine)))
    want = reference(x)
    assert len(got) == len(want) >= 3
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_duplicate_rows():
    x, _ = blobs(n=200, seed=3)
    x = np.concatenate([x, x[:50]])
    got = finch_levels(x, torch_search(x, 3)[1], default_search(KnnParams(k=1, engine="torch")))
    for g, w in zip(got, reference(x)):
        np.testing.assert_array_equal(g, w)


def test_level_zero_uses_the_round_lists_and_later_levels_search_only_the_means():
    x, _ = blobs()
    ids = torch_search(x, 4)[1]
    seen = []

    def search(means, k):
        seen.append((len(means), k))
        return torch_search(means, k)

    levels = finch_levels(x, ids, search)
    assert [n for n, _ in seen][: len(levels) - 1] == [
        int(level.max()) + 1 for level in levels[:-1]
    ]
    assert all(k == 1 for _, k in seen) and seen[0][0] < len(x)


def test_levels_are_numbered_by_smallest_member_and_nested():
    x, _ = blobs(seed=5)
    levels = finch_levels(x, torch_search(x, 5)[1])
    for fine, coarse in itertools.pairwise(levels):
        assert coarse.max() < fine.max()
        # nested: each fine cluster sits inside one coarse cluster
        assert all(len(np.unique(coarse[fine == c])) == 1 for c in range(fine.max() + 1))
    for level in levels:
        np.testing.assert_array_equal(level, number_by_smallest_member(level))


def test_level_choice():
    x, _y = blobs(n=800, seed=6)
    sims, ids = torch_search(x, 10)
    labels, info = finch_clusters(x, sims, ids)
    assert info["level"] == int(np.argmax(info["silhouette"])) and len(info["modularity"]) == len(
        info["silhouette"]
    )
    np.testing.assert_array_equal(labels, finch_levels(x, ids)[info["level"]])
    for want in (1, 37, 10**6):
        labels, info = finch_clusters(x, sims, ids, num_clusters=want)
        counts = info["num_clusters"]
        assert labels.max() + 1 == counts[int(np.argmin([abs(c - want) for c in counts]))]


def test_silhouette_is_sklearns():
    from sklearn.metrics import silhouette_score

    x, y = blobs(n=600)
    noisy = np.random.default_rng(0).integers(0, 12, 600)
    noisy[:3] = [12, 13, 14]  # singletons score 0
    for labels in (y, noisy):
        labels = np.unique(labels, return_inverse=True)[1]
        assert silhouette(x, labels) == pytest.approx(
            silhouette_score(x, labels, metric="cosine"), abs=1e-6
        )
    assert silhouette(x, np.zeros(600, int)) == 0.0
    sample = silhouette(x, y, sample=200)
    assert sample == silhouette(x, y, sample=200) and abs(sample - silhouette(x, y)) < 0.1


def test_on_the_digits_and_the_demo_identities():
    """Measured in docs/mining.md: the chosen level has 23 clusters and NMI 0.81 on the digits,
    and 210 clusters (NMI 0.95) on the demo's identities (200), where modularity would pick 63."""
    from sklearn.datasets import load_digits

    raw, y = load_digits(return_X_y=True)
    x = normalize((raw - raw.mean(0)).astype(np.float32))
    sims, ids = faiss_search(x, 10)
    labels, _ = finch_clusters(x, sims, ids)
    assert quality(labels, y)["nmi"] > 0.75
    again, _ = finch_clusters(x, sims, ids)
    np.testing.assert_array_equal(labels, again)
    from clusterflow.tasks.pseudo_id import IdentityWorld, SyntheticIdentities

    ds = SyntheticIdentities(0, IdentityWorld(200, 64, 8, 16, 0.5, 0.1), 20, augment=False)
    x = normalize(ds.base)
    sims, ids = faiss_search(x, 10)
    labels, _info = finch_clusters(x, sims, ids)
    assert 100 < labels.max() + 1 < 400 and quality(labels, ds.labels)["nmi"] > 0.9


def test_single_sample_and_bad_lists():
    x = normalize(np.ones((1, 4), np.float32))
    assert finch_levels(x, np.full((1, 3), -1))[0].tolist() == [0]
    with pytest.raises(ValueError, match="k-NN lists"):
        finch_levels(x, np.zeros((2, 1), int))
