"""A bad node is left out on requeue, on the real two-node Slurm cluster: a one-node job whose
rank fails on node1 with a GPU's device error (the error PyTorch raises for an uncorrectable ECC
error) requeues itself with node1 excluded, resumes on node2 from its last checkpoint, and ends
bitwise equal to an uninterrupted run; `status` names the excluded node."""

import json
import os
import re

import pytest
from conftest import run_cli
from slurmjobs import queue, rank0_logs, sha256, status, submit, wait_until

pytestmark = pytest.mark.slurm

# Both jobs: one node, all of it (so that the second job cannot share node2 with the first), and
# the same task, whose loss call 7 raises on node1 only (after the checkpoint at the end of the
# first epoch, step 6).
ONE_NODE = (
    "cluster.nodes=1",
    "cluster.exclusive=true",
    "task.target=testtasks:DeviceErrorOnHost",
    "task.params.host=node1",
    "task.params.at=7",
)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_a_rank_failing_with_a_device_error_on_node1_resumes_on_node2_without_it(
    cluster, tmp_path
):
    ref = str(tmp_path / "reference")
    # The reference holds node2 (and never fails there) while the job under test starts, so that
    # its first attempt runs on node1.
    ref_job, out = submit(ref, *ONE_NODE, "cluster.sbatch_extra.nodelist=node2")
    assert out.returncode == 0, out.stdout + out.stderr
    wait_until(
        "the reference running on node2",
        lambda: queue(ref_job).startswith("RUNNING"),
        timeout=180,
        job_id=ref_job,
    )
    d = str(tmp_path / "run")
    _, out = submit(d, *ONE_NODE, wait=True)
    assert out.returncode == 0, out.stdout + out.stderr
    wait_until("the reference done", lambda: queue(ref_job) == "", timeout=180, job_id=ref_job)
    assert status(ref)["state"] == "completed"

    s = status(d)
    assert s["state"] == "completed" and s["attempts"] == 2, s
    assert s["excluded_nodes"] == ["node1"] and s["hosts"] == ["node2"], s
    attempts = read_jsonl(os.path.join(d, "attempts.jsonl"))
    assert [a["hosts"] for a in attempts] == [["node1"], ["node2"]], attempts
    (stop,) = read_jsonl(os.path.join(d, "stops.jsonl"))
    assert stop["reason"] == "node_failure" and stop["node"] == "node1" and stop["excluded"], stop
    assert "uncorrectable ECC error" in stop["error"], stop

    logs = rank0_logs(d)
    assert "node node1 left out and the job requeued (node failure 1 of at most 3)" in logs, logs
    assert "excluded nodes now node1" in logs, logs
    assert re.search("resumed from " + re.escape(d) + r"/checkpoints/step-6:", logs), logs
    assert sha256(os.path.join(d, "model.pt")) == sha256(os.path.join(ref, "model.pt"))
    text = run_cli("clusterflow.status", d).stdout
    assert "excluded     node1 (left out of the job after a node failure" in text, text
