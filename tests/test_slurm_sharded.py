"""mining.search=sharded on the real local two-node Slurm cluster: the mining rounds run across
both nodes (a rank per node) and the run ends with the weights of the same run searched on rank 0
(the session's reference run)."""

import os

import pytest
from conftest import weights_equal
from slurmjobs import status, submit

pytestmark = pytest.mark.slurm


def test_a_sharded_run_on_two_nodes_ends_with_the_reference_weights(reference_run, tmp_path):
    ref, _ = reference_run
    d = str(tmp_path / "run")
    _, out = submit(d, "mining.search=sharded", wait=True)
    assert out.returncode == 0, out.stdout + out.stderr
    s = status(d)
    assert s["state"] == "completed" and s["hosts"] == ["node1", "node2"]
    assert len(s["mining"]) == 2 and all("sharded over 2 ranks" in m["engine"] for m in s["mining"])
    assert all(m["hooking_rounds"] >= 1 for m in s["mining"])
    want = status(ref)["mining"]
    for got, round_ in zip(s["mining"], want):
        assert (got["num_clusters"], got["largest_cluster"]) == (
            round_["num_clusters"],
            round_["largest_cluster"],
        )
    assert weights_equal(os.path.join(d, "model.pt"), os.path.join(ref, "model.pt"))
