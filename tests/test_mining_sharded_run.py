"""mining.search=sharded in real runs (submit --local, 2 ranks): the weights, labels and round
stats of a run whose mining rounds ran across ranks equal those of the same run searched on
rank 0 (exact engine)."""

import os

import numpy as np
import pytest
import torch
from conftest import run_cli

from clusterflow.storage.store import CheckpointStore

RUN = ["configs/tiny.yaml", "--local", "mining.engine=torch", "mining.query_batch=32"]


def _run(run_dir, *over):
    res = run_cli("clusterflow.submit", *RUN, f"run.dir={run_dir}", *over)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    state = CheckpointStore(os.path.join(run_dir, "checkpoints")).latest().load("train_state.pt")
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
