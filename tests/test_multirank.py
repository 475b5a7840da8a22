"""Real gloo processes: collectives, exact sharding of the embedding, mining end to end."""

import numpy as np
import pytest
from multirank import SharedRanks


def _collectives():
    from clusterflow.distributed import comm as dist

    r = dist.rank()
    summed = dist.all_reduce_dict({"a": r + 1, "b": 1.0})
    mean = dist.all_reduce_dict({"a": r}, op="mean")
    mx = dist.any_rank(r == 2)
    obj = dist.broadcast_object({"from": r})
    gathered = dist.gather_object(r * 10)
    return summed, mean, mx, obj, gathered


def test_collectives_on_three_ranks(ranks):
    res = ranks["collectives"]
    for r, (summed, mean, mx, obj, gathered) in enumerate(res):
        assert summed == {"a": 6.0, "b": 3.0}
        assert mean == {"a": 1.0}
        assert mx is True and obj == {"from": 0}
        assert gathered == ([0, 10, 20] if r == 0 else None)


class IndexTask:
    """Embeds each sample as (index, 1): lets the test see exactly which rows arrived where."""

    def __init__(self, n):
        self.n = n

    def embed_dataset(self):
        import torch

        return [{"x": torch.tensor([float(i), 1.0]), "index": i} for i in range(self.n)]

    def embed(self, model, batch):
        return batch["x"]


def _embed_and_gather(n, batch, workers):
    import torch

    from clusterflow.config.sections import DataConfig
    from clusterflow.distributed import comm as dist
    from clusterflow.mining.stage import embed_shard

    task = IndexTask(n)
    idx, emb = embed_shard(
        task,
        torch.nn.Identity(),
        task.embed_dataset(),
        batch,
        torch.device("cpu"),
        None,
        data=DataConfig(num_workers=workers, pin_memory=True),
    )
    full = dist.gather_rows(idx, emb, n, 2)
    return idx.tolist(), None if full is None else full[:, 0].tolist()


EMBED_CASES = [(1001, 64, 0), (1001, 64, 2), (10, 4, 0), (2, 8, 0)]


@pytest.mark.parametrize("n,batch,workers", EMBED_CASES)
def test_every_index_embedded_exactly_once(ranks, n, batch, workers):
    res = ranks["embed", n, batch, workers]
    seen = sorted(i for idx, _ in res for i in idx)
    assert seen == list(range(n))  # no duplicate padding, nothing lost
    shards = [idx for idx, _ in res]
    assert all(s == list(range(s[0], s[0] + len(s))) for s in shards if s)  # contiguous
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert res[0][1] == [float(i) for i in range(n)]  # rank 0 placed every row by its index
    assert res[1][1] is None and res[2][1] is None  # other ranks hold only their shard


def _context(mining):
    """The job a Miner runs in: the ``mining`` section given, no progress bar, no rounds kept on
    disk, and ranks wait for rank 0's search on ``mining.timeout_s`` (no watchdog)."""
    from clusterflow import config, rundir
    from clusterflow.observe.context import JobContext

    cfg = config.load(
        None,
        given={
            "mining": {**mining, "resume": False},
            "train": {"progress_bar": False},
            "dist": {"stall_s": 0},
        },
    )
    return JobContext(cfg, rundir.RunPaths(cfg.run.dir))


def _mine(params, search="rank0"):
    import torch

    from clusterflow.distributed import comm as dist
    from clusterflow.mining.stage import Miner
    from clusterflow.tasks.pseudo_id import PseudoIDTask
    from clusterflow.train.preemption import Preemption, StopAgreement

    torch.manual_seed(0)
    task = PseudoIDTask(seed=0, **params)
    model = task.build_model()
    mining = {"k": 5, "threshold": 0.5, "embed_batch": 97, "search": search, "timeout_s": 60}
    out = Miner(_context(mining), torch.device("cpu"), None, StopAgreement(Preemption())).run(
        task, model, epoch=1
    )
    return out.labels.tolist(), {k: out.stats[k] for k in ("num_clusters", "nmi")}, dist.world()


MINE_PARAMS = {"identities": 50, "samples_per_identity": 7}


def test_mining_end_to_end_same_labels_whatever_world_size(ranks):
    one = ranks["mine", 1][0]
    three = ranks["mine", 3]
    two = ranks["mine", 2]
    spread = ranks["mine all", 3]  # the k-NN search itself spread over the 3 ranks
    for labels, stats, world in three + two + spread:
        assert labels == one[0] and stats == one[1]
    from clusterflow.tasks.pseudo_id import PseudoIDTask

    assert len(one[0]) == 350 and one[1]["num_clusters"] > 1
    assert isinstance(
        PseudoIDTask(identities=50, samples_per_identity=7).ground_truth(), np.ndarray
    )


def _mine_with(mining):
    import torch

    from clusterflow.mining.stage import Miner
    from clusterflow.tasks.pseudo_id import PseudoIDTask
    from clusterflow.train.preemption import Preemption, StopAgreement

    torch.manual_seed(0)
    task = PseudoIDTask(seed=0, identities=40, samples_per_identity=6)
    ctx = _context(dict(k=5, embed_batch=97, timeout_s=60, **mining))
    out = Miner(ctx, torch.device("cpu"), None, StopAgreement(Preemption())).run(
        task, task.build_model(), epoch=1
    )
    s = out.stats
    return (
        out.labels.tolist(),
        {
            k: s.get(k)
            for k in ("method", "threshold", "threshold_rule", "finch", "num_clusters", "nmi")
        },
        s["curve"],
    )


MINING_CASES = [
    {"threshold": "auto"},
    {"method": "finch"},
    {"threshold": "auto", "search": "all", "engine": "torch"},
]


@pytest.mark.parametrize("case", range(len(MINING_CASES)), ids=lambda i: f"mining{i}")
def test_auto_threshold_and_finch_rounds_give_the_same_labels_whatever_world_size(ranks, case):
    """The round's curve, its auto threshold and FINCH's levels come from rank 0's k-NN lists, which
    are the same for 1 and 2 ranks (the spread search: as the exact torch engine finds them; FAISS
    may differ in the last bits of a similarity, and the auto threshold sees them)."""
    one = ranks["mine with", case, 1][0]
    assert ranks["mine with", case, 2] == [one, one]
    _labels, stats, curve = one
    assert (
        stats["num_clusters"] > 1
        and len(curve["thresholds"]) > 20
        and len(curve["nmi"]) == len(curve["thresholds"])
    )
    if stats["method"] == "finch":
        assert (
            stats["threshold"] is None
            and stats["finch"]["num_clusters"][stats["finch"]["level"]] == stats["num_clusters"]
        )
    else:
        assert (
            stats["threshold_rule"] == "auto"
            and stats["threshold"] == curve["thresholds"][int(np.argmax(curve["modularity"]))]
        )


def _knn_data(n):
    from clusterflow.mining import normalize

    x = normalize(np.random.default_rng(3).standard_normal((n, 16)).astype(np.float32))
    if n > 7:
        x[7] = x[3]  # an exact duplicate: ties must break by the smaller id, as in one process
    return x


def _distributed_knn(n, k, query_batch, abort_at):
    import torch

    from clusterflow.distributed import comm as dist
    from clusterflow.distributed.sampler import shard_range
    from clusterflow.mining.knn import SearchHooks
    from clusterflow.mining.knn.torch_engine import distributed_search

    x = _knn_data(n)
    world, rank = dist.world(), dist.rank()
    offsets = [shard_range(n, r, world).start for r in range(world)] + [n]
    calls = []
    out = distributed_search(
        x[offsets[rank] : offsets[rank + 1]],
        offsets,
        k,
        torch.device("cpu"),
        query_batch=query_batch,
        db_chunk=16,
        hooks=SearchHooks(lambda: rank == 1 and (calls.append(1) or len(calls)) > abort_at),
    )
    return None if out is None else (out[0].tolist(), out[1].tolist())


KNN_CASES = [(101, 6), (5, 6)]  # k >= n: fewer neighbours than asked, padded like one process


@pytest.mark.parametrize("n,k", KNN_CASES)
def test_distributed_knn_equals_one_process(ranks, n, k):
    from clusterflow.mining.knn.torch_engine import torch_search

    x = _knn_data(n)
    want_s, want_i = torch_search(x, k, query_batch=10, db_chunk=16, device="cpu")
    parts = ranks["knn", n, k]
    got_s = np.concatenate([np.array(p[0], dtype=np.float32).reshape(-1, k) for p in parts])
    got_i = np.concatenate([np.array(p[1], dtype=np.int64).reshape(-1, k) for p in parts])
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_s, want_s)


def test_distributed_knn_abort_on_one_rank_stops_every_rank(ranks):
    assert ranks["knn abort"] == [
        None,
        None,
        None,
    ]  # no hang, no partial result


def _supcon_big_ids():
    import torch

    from clusterflow.distributed import comm as dist
    from clusterflow.tasks.losses import supcon_loss

    torch.manual_seed(dist.rank())
    z = torch.nn.functional.normalize(torch.randn(2, 4), dim=1)
    ids = torch.tensor(
        [2**24 + 2 * dist.rank(), 2**24 + 2 * dist.rank() + 1]
    )  # all distinct: no anchor has a positive
    _, metrics = supcon_loss(z, ids)
    return float(metrics["anchors_with_pos"])


@pytest.mark.parametrize("world", [1, 2])
def test_supcon_ids_past_2_pow_24_stay_distinct(ranks, world):
    """2**24 + 1 is not a float32: ids that travel as floats collide with their neighbours."""
    assert ranks["supcon", world] == [0.0] * world


def _uneven_supcon_grad():
    """One step of the contrastive loss on a global batch of 52 samples split as the trainer
    splits it (18, 17, 17 on 3 ranks), weighted by each rank's share, gradients averaged over
    ranks as DDP does: the gradient of the whole batch on one rank."""
    import torch

    from clusterflow.distributed import comm as dist
    from clusterflow.distributed.sampler import shard_range, share, split
    from clusterflow.tasks.losses import supcon_loss

    torch.manual_seed(0)
    x, ids = torch.randn(52, 6), torch.arange(52) % 13
    model = torch.nn.Linear(6, 4)
    part = shard_range(52, dist.rank(), dist.world())
    grads = []
    for weight in (share(len(part), dist.world(), 1, 52), 1.0):
        model.zero_grad()
        with dist.batch_rows(split(52, dist.world())):
            z = torch.nn.functional.normalize(model(x[part.start : part.stop]), dim=1)
            loss, _ = supcon_loss(z, ids[part.start : part.stop])
            (loss * weight).backward()
        grads.append((dist.all_reduce_tensor(model.weight.grad.clone()) / dist.world()).numpy())
    return grads


def test_uneven_ranks_weighted_by_their_share_give_the_whole_batch_gradient(ranks):
    import numpy as np

    ((one, _),), three = ranks["uneven", 1], ranks["uneven", 3]
    for weighted, unweighted in three:
        np.testing.assert_allclose(weighted, one, rtol=1e-5, atol=1e-6)
        assert np.abs(unweighted - one).max() > 1e-4  # the weights are what makes them equal


@pytest.fixture(scope="module")
def ranks():
    """Every call of this module, each on its own world size, with one spawn per world size (the
    abort of a search last: its ranks leave the search early)."""
    calls = {"collectives": (3, _collectives, ())}
    calls.update({("embed", *c): (3, _embed_and_gather, c) for c in EMBED_CASES})
    for world in (1, 3, 2):
        calls["mine", world] = (world, _mine, (MINE_PARAMS,))
    calls["mine all", 3] = (3, _mine, (MINE_PARAMS, "all"))
    for case, mining in enumerate(MINING_CASES):
        for world in (1, 2):
            calls["mine with", case, world] = (world, _mine_with, (mining,))
    for n, k in KNN_CASES:
        calls["knn", n, k] = (3, _distributed_knn, (n, k, 10, 10**9))
    for world in (1, 2):
        calls["supcon", world] = (world, _supcon_big_ids, ())
    for world in (1, 3):
        calls["uneven", world] = (world, _uneven_supcon_grad, ())
    calls["knn abort"] = (3, _distributed_knn, (101, 6, 10, 2))
    return SharedRanks(calls)
