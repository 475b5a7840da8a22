"""Mining rounds that resume (clusterflow/mining/rounds.py): the files a round keeps, searches that
continue from their finished query blocks, and real 2-rank runs signalled or killed in the middle
of a round, which end with the labels, stats and weights of an uninterrupted run."""

import json
import os
import re

import launch
import numpy as np
import pytest
import torch
from conftest import REPO
from multirank import run_ranks

from clusterflow.mining.clustering import normalize
from clusterflow.mining.knn import KnnParams, SearchHooks, search
from clusterflow.mining.rounds import RoundFiles, forget_rounds


def data(n=301, d=16, seed=0):
    return normalize(np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32))


# -- the files -------------------------------------------------------------------------------------


def test_shard_round_trip_and_key(tmp_path):
    idx, rows = np.arange(5, 12), data(7)
    files = RoundFiles(str(tmp_path), 3, 1, "key-a")
    assert files.load_shard() is None
    files.save_shard(idx, rows, 1.5)
    got = RoundFiles(str(tmp_path), 3, 1, "key-a").load_shard()
    assert (
        got[0].tolist() == idx.tolist()
        and got[1].dtype == np.float32
        and np.array_equal(got[1], rows)
        and got[2] == 1.5
    )
    assert RoundFiles(str(tmp_path), 3, 1, "key-b").load_shard() is None  # another model or setting
    shard = tmp_path / "epoch-3" / "rank1" / "shard" / "step-0" / "shard.pt"
    shard.write_bytes(shard.read_bytes()[:-3] + b"xyz")  # bit rot
    assert RoundFiles(str(tmp_path), 3, 1, "key-a").load_shard() is None


def test_blocks_are_committed_on_flush_and_read_back(tmp_path):
    files = RoundFiles(str(tmp_path), 1, 0, "k")
    blocks = files.search_blocks(every_s=3600)
    a = (np.ones((4, 2), np.float32), np.arange(8).reshape(4, 2))
    blocks.put(0, *a)
    assert (
        RoundFiles(str(tmp_path), 1, 0, "k").search_blocks().get(0, 4) is None
    )  # not committed yet
    blocks.flush()
    blocks.put(4, a[0][:3], a[1][:3])
    blocks.flush()
    again = RoundFiles(str(tmp_path), 1, 0, "k").search_blocks()
    assert (
        np.array_equal(again.get(0, 4)[1], a[1])
        and again.get(4, 3) is not None
        and again.reused == 2
    )
    assert again.get(4, 4) is None  # another block size: not this block
    assert RoundFiles(str(tmp_path), 1, 0, "other").search_blocks().get(0, 4) is None
    blocks = files.search_blocks(every_s=0)  # every put is due
    blocks.put(8, *a)
    assert RoundFiles(str(tmp_path), 1, 0, "k").search_blocks().get(8, 4) is not None


def test_forget_rounds(tmp_path):
    for epoch in (1, 2, 3):
        RoundFiles(str(tmp_path / "mining"), epoch, 0, "k").save_shard(np.arange(2), data(2), 0.1)
    assert forget_rounds(str(tmp_path / "mining"), 2) == ["epoch-1", "epoch-2"]
    assert os.listdir(tmp_path / "mining") == ["epoch-3"]
    forget_rounds(str(tmp_path / "mining"), 3)
    assert not (tmp_path / "mining").exists()
    assert forget_rounds(str(tmp_path / "mining"), 3) == []


# -- searches that continue ------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["faiss", "torch"])
def test_a_search_cut_short_continues_from_its_blocks(tmp_path, engine):
    x = data()
    params = KnnParams(k=7, engine=engine, query_batch=40)
    want = search(x, params)
    files = RoundFiles(str(tmp_path), 1, 0, "k")
    blocks, calls = files.search_blocks(every_s=3600), []
    assert search(x, params, lambda: len(calls.append(1) or calls) > 3, blocks=blocks) is None
    blocks.flush()
    resumed = files.search_blocks()
    computed = []
    got = search(x, params, lambda: computed.append(1) and False, blocks=resumed)
    assert resumed.reused == 3 and len(computed) == 8 - 3  # 301 rows: 8 blocks of 40
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    resumed.flush()
    done = files.search_blocks()
    again = search(x, params, lambda: pytest.fail("nothing is left to search"), blocks=done)
    assert done.reused == 8 and np.array_equal(again[1], want[1])


def _spread(n, k, root, abort_rank, abort_after):
    from clusterflow.distributed import comm as dist
    from clusterflow.distributed.sampler import shard_range
    from clusterflow.mining.knn.torch_engine import distributed_search

    x, world, rank = data(n), dist.world(), dist.rank()
    offsets = [shard_range(n, r, world).start for r in range(world)] + [n]
    blocks, calls, timings = RoundFiles(root, 1, rank, "k").search_blocks(every_s=3600), [], {}
    out = distributed_search(
        x[offsets[rank] : offsets[rank + 1]],
        offsets,
        k,
        "cpu",
        query_batch=16,
        db_chunk=16,
        hooks=SearchHooks(
            lambda: rank == abort_rank and len(calls.append(1) or calls) > abort_after,
            timings,
            blocks,
        ),
    )
    blocks.flush()
    return None if out is None else (out[0].tolist(), out[1].tolist()), timings["blocks_skipped"]


def test_the_spread_search_continues_from_every_ranks_blocks(tmp_path):
    n, k = 101, 6
    want = search(data(n), KnnParams(k=k, engine="torch", query_batch=16))
    # 34 + 34 + 33 rows, 3 blocks of up to 16 each; rank 2 says stop before the 5th block of all:
    # rank 0's 3 blocks and rank 1's first are finished, each kept by its owner
    first = run_ranks(3, _spread, n, k, str(tmp_path), 2, 4)
    assert [r[0] for r in first] == [None, None, None]
    second = run_ranks(3, _spread, n, k, str(tmp_path), -1, 0)
    assert [r[1] for r in second] == [4, 4, 4]
    got_s = np.concatenate([np.array(r[0][0], np.float32).reshape(-1, k) for r in second])
    got_i = np.concatenate([np.array(r[0][1], np.int64).reshape(-1, k) for r in second])
    np.testing.assert_array_equal(got_i, want[1])
    np.testing.assert_array_equal(got_s, want[0])


# -- real runs: 2 ranks, signalled and killed in a round -------------------------------------------

ROUND = [
    "cluster.tasks_per_node=2",
    "mining.query_batch=32",
]  # 192 samples: 6 query blocks on rank 0, 3 per rank spread


def last_state(run_dir):
    from clusterflow.storage.store import CheckpointStore
    from clusterflow.storage.tensors import TORCH

    state = (
        CheckpointStore(os.path.join(run_dir, "checkpoints"), codec=TORCH)
        .latest()
        .load("train_state.pt")["train"]
    )
    return state["labels"].numpy(), state["mining_history"]


def what_a_round_found(history):
    """A round's stats without how it ran (timings, what was read back)."""
    return [
        {
            k: v
            for k, v in m.items()
            if k not in ("seconds", "embed_per_s_rank", "embed_per_s_total", "resumed")
        }
        for m in history
    ]


def weights(run_dir):
    return torch.load(os.path.join(run_dir, "model.pt"), weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    runs = {}
    for search_on in ("rank0", "all", "sharded"):
        d = str(tmp_path_factory.mktemp(search_on) / "run")
        assert launch.run(
            2, "configs/tiny.yaml", [f"run.dir={d}", *ROUND, f"mining.search={search_on}"], d
        ) == [0, 0]
        runs[search_on] = d
    return runs


def signalled(run_dir, search_on, at, attempts, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.join(REPO, "tests"))
    over = [
        f"run.dir={run_dir}",
        *ROUND,
        f"mining.search={search_on}",
        "task.target=testtasks:SignalInMining",
        f"task.params.run_dir={run_dir}",
        f"task.params.at={at}",
    ]
    return [launch.run(2, "configs/tiny.yaml", over, run_dir) for _ in range(attempts)]


def rank0_log(run_dir):
    names = sorted(f for f in os.listdir(os.path.join(run_dir, "logs")) if f.startswith("rank0."))
    return "".join(open(os.path.join(run_dir, "logs", name)).read() for name in names)


def same_run(run_dir, plain):
    labels, history = last_state(run_dir)
    want_labels, want_history = last_state(plain)
    np.testing.assert_array_equal(labels, want_labels)
    assert what_a_round_found(history) == what_a_round_found(want_history) and len(history) == 2
    a, b = weights(run_dir), weights(plain)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not os.path.exists(
        os.path.join(run_dir, "mining")
    )  # every round's files gone once its labels were committed
    return history


def test_signals_in_the_embed_and_in_the_search_of_a_rank0_round(
    uninterrupted, tmp_path, monkeypatch
):
    """Attempt 0: SIGTERM on both ranks while they embed (round 1): the shards are committed, then
    the run stops. Attempt 1 reads them back, searches 3 of the 6 query blocks and gets SIGTERM.
    Attempt 2 reads the shards and the 3 blocks back and searches the other 3."""
    d = str(tmp_path / "run")
    assert (
        signalled(d, "rank0", "0:*:embed:1:TERM,1:0:block:3:TERM", 3, monkeypatch) == [[0, 0]] * 3
    )
    history = same_run(d, uninterrupted["rank0"])
    assert history[0]["resumed"] == {"embeddings": True, "search_blocks": 3}
    assert history[1]["resumed"] == {"embeddings": False, "search_blocks": 0}
    log = rank0_log(d)
    assert (
        len(re.findall(r"rank 0 read its 96 embeddings back", log)) == 2
        and len(re.findall("mining after epoch 1:", log)) == 1
    )


def test_a_signal_in_the_search_spread_over_every_rank(uninterrupted, tmp_path, monkeypatch):
    """Rank 1 gets SIGTERM after its 2nd query block (rank 0's 3 came first): every rank stops at
    the next block, keeps what it finished, and the resumed round searches 1 block."""
    d = str(tmp_path / "run")
    assert signalled(d, "all", "0:1:block:2:TERM", 2, monkeypatch) == [[0, 0]] * 2
    history = same_run(d, uninterrupted["all"])
    assert history[0]["resumed"] == {"embeddings": True, "search_blocks": 5}


def test_a_stop_in_a_sharded_search_saves_and_stops(uninterrupted, tmp_path, monkeypatch):
    """SIGTERM on rank 1 after its 2nd query block of a sharded round (a preemption's signal):
    every rank stops at the next hop as on any other stop (exit 0, stopped outside Slurm), and the
    resumed round searches only the blocks not yet finished."""
    d = str(tmp_path / "run")
    at = "0:1:block:2:TERM"
    first = signalled(d, "sharded", at, 1, monkeypatch)
    state = json.load(open(os.path.join(d, "status.json")))["state"]
    assert first == [[0, 0]] and state == "stopped", (first, state)  # as a TERM elsewhere
    assert signalled(d, "sharded", at, 1, monkeypatch) == [[0, 0]]
    history = same_run(d, uninterrupted["sharded"])
    assert history[0]["resumed"]["embeddings"] and history[0]["resumed"]["search_blocks"] >= 2


def test_a_kill_during_the_embed_redoes_the_round(uninterrupted, tmp_path, monkeypatch):
    d = str(tmp_path / "run")
    assert signalled(d, "rank0", "0:*:embed:1:KILL", 2, monkeypatch) == [[-9, -9], [0, 0]]
    history = same_run(d, uninterrupted["rank0"])
    assert history[0]["resumed"] == {"embeddings": False, "search_blocks": 0}


def test_each_round_shows_its_curve_in_tensorboard_and_status(uninterrupted):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from clusterflow.manage.status import collect, render
    from clusterflow.rundir.paths import RunPaths

    d = uninterrupted["rank0"]
    acc = EventAccumulator(os.path.join(d, "tb"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    assert [(i.width, i.height) for i in acc.Images("mining/curve")] == [
        (760, 500)
    ] * 2  # one figure per round
    assert [e.value for e in acc.Scalars("mining/threshold")] == [0.5, 0.5]
    rounds = collect(RunPaths(d))["mining"]
    assert [(r["threshold"], r["threshold_rule"], r["method"]) for r in rounds] == [
        (0.5, "fixed", "mutual_knn")
    ] * 2
    assert (
        "curve" not in rounds[0] and 20 < len(rounds[1]["curve"]["thresholds"]) <= 42
    )  # thinned, the last round only
    assert set(rounds[1]["curve"]) == {
        "thresholds",
        "num_clusters",
        "num_singletons",
        "largest_cluster",
        "mutual_edges",
        "modularity",
        "nmi",
        "ari",
    }
    text = render(collect(RunPaths(d)))
    assert (
        "threshold    0.5 (fixed); per round: 0.5, 0.5" in text
        and "(0.5 keeps every mutual edge)" in text
    )
