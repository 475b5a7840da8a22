"""The exact torch k-NN engine returns, for every row, its k nearest others by one fp32 dot product
per pair (products rounded, then summed along the row), ties by the smaller id, whatever splits
the work: the lists equal that definition computed over all pairs at once, and are bitwise the
same in one process (any query batch, database chunk or number of devices) and on 2 and 3 gloo
ranks, spread (``mining.search=all``) or sharded. The data hold what makes a matmul's rounding
decide a list: groups of exact duplicates and of rows within rounding of each other, larger than
the engine's margin of candidates, so the engine's re-check of uncertain rows runs."""

import numpy as np
import pytest
import torch
from multirank import SharedRanks

K = 8


def _data(n=300, d=32):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, d)).astype(np.float32)
    x[10:80] = x[3]  # 71 identical rows
    near = x[150] + (1e-7 * rng.standard_normal((60, d))).astype(np.float32)
    x[150:210] = near  # 60 rows within rounding of one another
    x[rng.permutation(n)] = x.copy()  # spread the groups over every shard
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _definition(x, k):
    """Every pair's products rounded, then summed along the row: the engine's similarity, here
    over all pairs at once; each row's k best others, ties by the smaller id."""
    t = torch.from_numpy(x)
    n = len(x)
    sims = (t.unsqueeze(1) * t.unsqueeze(0)).sum(-1).numpy()
    ids, out = np.arange(n), []
    for i in range(n):
        order = [j for j in np.lexsort((ids, -sims[i])) if j != i][:k]
        out.append((sims[i, order], order))
    return np.array([s for s, _ in out]), np.array([o for _, o in out])


def _offsets(n, world):
    return [n * r // world for r in range(world + 1)]


def _spread(x, k):
    from clusterflow.distributed import comm as dist
    from clusterflow.mining.knn.torch_engine import distributed_search

    offsets = _offsets(len(x), dist.world())
    lo, hi = offsets[dist.rank()], offsets[dist.rank() + 1]
    return distributed_search(x[lo:hi], offsets, k, "cpu", query_batch=37, db_chunk=50)


def _sharded(x, k):
    from clusterflow.distributed import comm as dist
    from clusterflow.mining.knn import KnnParams
    from clusterflow.mining.knn.sharded import sharded_search

    offsets = _offsets(len(x), dist.world())
    lo, hi = offsets[dist.rank()], offsets[dist.rank() + 1]
    return sharded_search(
        x[lo:hi], offsets, KnnParams(k=k, engine="torch", query_batch=29), "torch"
    )


@pytest.fixture(scope="module")
def ranks():
    x = _data()
    calls = {}
    for world in (2, 3):
        calls["spread", world] = (world, _spread, (x, K))
        calls["sharded", world] = (world, _sharded, (x, K))
    return SharedRanks(calls)


def test_one_process_equals_the_definition_at_every_split():
    from clusterflow.mining.knn import SearchHooks
    from clusterflow.mining.knn.torch_engine import torch_search

    x = _data()
    want_s, want_i = _definition(x, K)
    timings = {}
    got_s, got_i = torch_search(x, K, device="cpu", hooks=SearchHooks(timings=timings))
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_s, want_s)
    assert timings["rechecked"] > 0  # the near-ties made the engine search rows again
    for query_batch, db_chunk, device in ((13, 41, "cpu"), (64, 7, ["cpu", "cpu"])):
        s, i = torch_search(x, K, query_batch=query_batch, db_chunk=db_chunk, device=device)
        np.testing.assert_array_equal(i, want_i)
        assert s.tobytes() == want_s.tobytes()


@pytest.mark.parametrize("how", ["spread", "sharded"])
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_equal_one_process_bitwise(ranks, how, world):
    from clusterflow.mining.knn.torch_engine import torch_search

    want_s, want_i = torch_search(_data(), K, device="cpu")
    parts = ranks[how, world]
    got_s = np.concatenate([p[0] for p in parts])
    got_i = np.concatenate([p[1] for p in parts])
    np.testing.assert_array_equal(got_i, want_i)
    assert got_s.tobytes() == want_s.tobytes()


def test_tile_top_keeps_the_top_scores():
    """A CPU tile's top-c search by groups' maxima gives torch.topk's values (columns of equal
    scores may differ), ties and the columns past the last whole group included."""
    from clusterflow.mining.knn.torch_engine import _GROUP, _tile_top

    g = torch.Generator().manual_seed(0)
    for rows, n, c in ((7, 4096, 13), (5, 4 * 64 * 7 + 3, 7), (3, 1000, 3), (4, 300, 13)):
        for s in (torch.randn(rows, n, generator=g), 3 * torch.randn(rows, n, generator=g)):
            s[:, 100:140] = s[:, 100:101]  # a run of equal scores
            s[0, n - 1] = s.max() + 1  # the best score in the last column
            for scores in (s, s.round()):  # and many ties
                v, i = _tile_top(scores, c)
                want = torch.topk(scores, c, dim=1).values
                assert torch.equal(v, want), (rows, n, c)
                assert torch.equal(torch.gather(scores, 1, i), v)
                assert all(len(set(r)) == c for r in i.tolist())
    assert 4096 // _GROUP >= 64 * 13  # the first shape takes the grouped search


def test_neighbour_sets_equal_a_bare_matmul_and_topk():
    """Against what a researcher writes (an fp32 matmul of every row, the diagonal dropped,
    topk): the same neighbour set for every row whose k-th and (k+1)-th scores differ by more
    than rounding; on data large enough for the engine's tiles and grouped top-c search."""
    from clusterflow.mining.knn.torch_engine import torch_search

    rng = np.random.default_rng(3)
    centres = rng.standard_normal((100, 64)).astype(np.float32)
    x = centres[rng.integers(0, 100, 5000)] + 0.8 * rng.standard_normal((5000, 64))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    k = 10
    _, ids = torch_search(x, k, device="cpu")
    t = torch.from_numpy(x)
    scores = t @ t.T
    scores.fill_diagonal_(-float("inf"))
    top_s, top_i = torch.topk(scores, k + 1, dim=1)
    clear = (top_s[:, k - 1] - top_s[:, k]) > 1e-5
    assert int(clear.sum()) >= 0.99 * len(x)
    same = [set(a) == set(b) for a, b in zip(ids.tolist(), top_i[:, :k].tolist())]
    assert all(s for s, c in zip(same, clear.tolist()) if c)
