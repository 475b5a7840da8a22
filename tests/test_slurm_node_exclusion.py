"""Bad nodes are left out on requeue, on the real three-node Slurm cluster: a one-node job whose
ranks fail on node1 with a GPU's device error (the error PyTorch raises for an uncorrectable ECC
error) requeues itself with node1 excluded and resumes on node2 from its last checkpoint; there
a rank hangs until the stall watchdog ends it, and the job requeues itself with node2 excluded
too, resumes on node3, and ends bitwise equal to an uninterrupted run; `status` names the
excluded nodes."""

import json
import os
import re

import pytest
from conftest import ONE_NODE, run_cli
from slurmjobs import read_jsonl, sha256, status, submit

pytestmark = pytest.mark.slurm

# No restart inside the job (ONE_NODE): this proves the requeue without the node
# (docs/restarts.md has the in-job path, tests/test_slurm_restarts.py its proof). Loss call 7 of
# each attempt comes after a checkpoint at an epoch's end (steps 6 and 12): on node1 both ranks
# raise the device error; on node2 rank 1 sleeps in its loss and its peer waits in the next
# collective.
TWO_BAD_NODES = (
    "cluster.partition=wide",
    "task.target=testtasks:DeviceErrorThenStall",
    "task.params.device_host=node1",
    "task.params.host=node2",
    "task.params.at=7",
    "dist.stall_s=10",
    "dist.heartbeat_s=0.5",
)


def test_a_device_error_then_a_stalled_rank_leave_out_two_nodes_on_requeue(
    cluster, one_node_reference, tmp_path
):
    d = str(tmp_path / "run")
    _, out = submit(d, *ONE_NODE, *TWO_BAD_NODES, wait=True)
    assert out.returncode == 0, out.stdout + out.stderr
    s = status(d)
    assert s["state"] == "completed" and s["attempts"] == 3, s
    assert s["excluded_nodes"] == ["node1", "node2"] and s["hosts"] == ["node3"], s
    attempts = read_jsonl(os.path.join(d, "attempts.jsonl"))
    assert [sorted(set(a["hosts"])) for a in attempts] == [["node1"], ["node2"], ["node3"]]
    device, stall = read_jsonl(os.path.join(d, "stops.jsonl"))
    for stop, node in ((device, "node1"), (stall, "node2")):
        assert stop["reason"] == "node_failure" and stop["node"] == node and stop["excluded"], stop
    assert "CUDA error: uncorrectable ECC error" in device["error"], device
    assert re.search(r"^stalled \d+ s at step 12 in train \(", stall["error"]), stall
    first = json.load(open(os.path.join(d, "errors", "first.attempt1.json")))
    assert first["kind"] == "stall" and first["rank"] == 1 and first["host"] == "node2", first
    for attempt, (node, count, excluded) in enumerate(
        (("node1", 1, "node1"), ("node2", 2, "node1,node2"))
    ):
        logs = "".join(
            open(os.path.join(d, "logs", f"rank{r}.attempt{attempt}.log")).read() for r in (0, 1)
        )
        said = f"node {node} left out and the job requeued (node failure {count} of at most 3)"
        assert said in logs and f"excluded nodes now {excluded}" in logs, logs
    for attempt, step in ((1, 6), (2, 12)):
        log = open(os.path.join(d, "logs", f"rank0.attempt{attempt}.log")).read()
        assert re.search("resumed from " + re.escape(d) + rf"/checkpoints/step-{step}:", log)
    ref, _ = one_node_reference
    assert sha256(os.path.join(d, "model.pt")) == sha256(os.path.join(ref, "model.pt"))
    text = run_cli("clusterflow.status", d).stdout
    assert "excluded     node1, node2 (left out of the job after a node failure" in text, text
