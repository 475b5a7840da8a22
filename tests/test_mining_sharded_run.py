"""mining.search=sharded in real runs (2 ranks, tests/launch.py): the weights, labels and round
stats of a run whose mining rounds ran across ranks equal those of the same run searched on
rank 0 (exact engine)."""

import os

import launch
import numpy as np
import pytest
import torch

from clusterflow.storage.store import CheckpointStore
from clusterflow.storage.tensors import TORCH

RUN = ["cluster.tasks_per_node=2", "mining.engine=torch", "mining.query_batch=32"]


def _run(run_dir, *over):
    codes = launch.run(2, "configs/tiny.yaml", [*RUN, f"run.dir={run_dir}", *over], run_dir)
    assert codes == [0, 0], open(os.path.join(run_dir, "logs", "rank0.attempt0.log")).read()
    state = (
        CheckpointStore(os.path.join(run_dir, "checkpoints"), codec=TORCH)
        .latest()
        .load("train_state.pt")
    )
    weights = torch.load(os.path.join(run_dir, "model.pt"), weights_only=True)
    return weights, state["train"]["labels"].numpy(), state["train"]["mining_history"]


@pytest.mark.parametrize("threshold", ["0.5", "auto"])
def test_a_sharded_run_ends_with_the_weights_of_a_rank0_run(tmp_path, threshold):
    over = [f"mining.threshold={threshold}", "mining.singletons=ignore"]
    want_w, want_labels, want_rounds = _run(str(tmp_path / "rank0"), *over)
    got_w, labels, rounds = _run(str(tmp_path / "sharded"), "mining.search=sharded", *over)
    np.testing.assert_array_equal(labels, want_labels)
    assert got_w.keys() == want_w.keys() and all(torch.equal(got_w[k], want_w[k]) for k in got_w)
    assert len(rounds) == len(want_rounds) == 2
    for got, want in zip(rounds, want_rounds):
        for key in ("num_clusters", "num_singletons", "largest_cluster", "size_histogram"):
            assert got[key] == want[key], key
        for key in ("threshold", "threshold_rule", "mutual_edges", "nmi", "ari"):
            assert got[key] == want[key], key
        assert got["curve"]["num_clusters"] == want["curve"]["num_clusters"]
        np.testing.assert_allclose(got["curve"]["modularity"], want["curve"]["modularity"])
        assert "sharded over 2 ranks" in got["engine"] and got["hooking_rounds"] >= 1


def test_a_rank_killed_in_the_exchange_resumes_from_the_finished_blocks(tmp_path, monkeypatch):
    """Rank 1 is SIGKILLed right after its 2nd of 3 query blocks (192 samples, 32 per block),
    while rank 0 waits for it in the ring: rank 0 fails, the relaunch reads both ranks' embeddings
    and 2 blocks each back, searches the last round and ends as an uninterrupted run."""
    from conftest import REPO
    from test_mining_resume import same_run

    over = ["cluster.tasks_per_node=2", "mining.query_batch=32", "mining.engine=torch"]
    over += ["mining.search=sharded"]
    plain = str(tmp_path / "plain")
    assert launch.run(2, "configs/tiny.yaml", [f"run.dir={plain}", *over], plain) == [0, 0]
    d = str(tmp_path / "killed")
    monkeypatch.setenv("PYTHONPATH", os.path.join(REPO, "tests"))
    over += [
        f"run.dir={d}",
        "task.target=testtasks:SignalInMining",
        f"task.params.run_dir={d}",
        "task.params.at=0:1:block:2:KILL",
        "task.params.commit_every_s=0",
    ]
    first = launch.run(2, "configs/tiny.yaml", over, d)
    assert first[1] == -9 and first[0] != 0, first
    assert launch.run(2, "configs/tiny.yaml", over, d) == [0, 0]
    history = same_run(d, plain)
    assert history[0]["resumed"] == {"embeddings": True, "search_blocks": 2}
    assert history[1]["resumed"] == {"embeddings": False, "search_blocks": 0}
