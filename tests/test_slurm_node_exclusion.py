"""A bad node is left out on requeue, on the real two-node Slurm cluster: a one-node job whose
rank fails on node1 with a GPU's device error (the error PyTorch raises for an uncorrectable ECC
error), or whose rank hangs there until the stall watchdog ends it, requeues itself with node1
excluded, resumes on node2 from its last checkpoint, and ends bitwise equal to an uninterrupted
run; `status` names the excluded node."""

import glob
import json
import os
import re

import pytest
from conftest import run_cli
from slurmjobs import queue, rank0_logs, sha256, status, submit, wait_until

pytestmark = pytest.mark.slurm

# Both jobs of a test: one node, all of it (so that the second job cannot share node2 with the
# first), and the same task, which fails on node1 only: loss call 7 comes after the checkpoint at
# the end of the first epoch, step 6.
# No restart inside the job: these prove the requeue without the node (docs/restarts.md has the
# in-job path, tests/test_slurm_restarts.py its proof).
ONE_NODE = ("cluster.nodes=1", "cluster.exclusive=true", "cluster.restarts_in_job=0")
DEVICE_ERROR = (
    "task.target=testtasks:DeviceErrorOnHost",
    "task.params.host=node1",
    "task.params.at=7",
)
# Rank 1 of two on node1 sleeps in its loss at call 7 (after step 6); its peer waits in the next
# collective.
STALL = (
    "cluster.tasks_per_node=2",
    "task.target=testtasks:StallOnHost",
    "task.params.host=node1",
    "task.params.at=7",
    "dist.stall_s=10",
    "dist.heartbeat_s=0.5",
)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_on_node1_then_node2(tmp_path, *overrides):
    """The job under test, started on node1 while the reference holds node2 (where the task
    never fails), and waited for through all its attempts; returns (run dir, reference dir)."""
    ref = str(tmp_path / "reference")
    ref_job, out = submit(ref, *ONE_NODE, *overrides, "cluster.sbatch_extra.nodelist=node2")
    assert out.returncode == 0, out.stdout + out.stderr
    wait_until(
        "the reference running on node2",
        lambda: queue(ref_job).startswith("RUNNING"),
        timeout=180,
        job_id=ref_job,
    )
    d = str(tmp_path / "run")
    _, out = submit(d, *ONE_NODE, *overrides, wait=True)
    assert out.returncode == 0, out.stdout + out.stderr
    wait_until("the reference done", lambda: queue(ref_job) == "", timeout=180, job_id=ref_job)
    assert status(ref)["state"] == "completed"
    return d, ref


def assert_resumed_on_node2_without_node1(d, ref, cause):
    s = status(d)
    assert s["state"] == "completed" and s["attempts"] == 2, s
    assert s["excluded_nodes"] == ["node1"] and s["hosts"] == ["node2"], s
    attempts = read_jsonl(os.path.join(d, "attempts.jsonl"))
    assert [sorted(set(a["hosts"])) for a in attempts] == [["node1"], ["node2"]], attempts
    (stop,) = read_jsonl(os.path.join(d, "stops.jsonl"))
    assert stop["reason"] == "node_failure" and stop["node"] == "node1" and stop["excluded"], stop
    assert re.search(cause, stop["error"]), stop
    logs = "".join(
        open(p).read() for p in sorted(glob.glob(os.path.join(d, "logs", "rank*.attempt0.log")))
    )
    assert "node node1 left out and the job requeued (node failure 1 of at most 3)" in logs, logs
    assert "excluded nodes now node1" in logs, logs
    assert re.search("resumed from " + re.escape(d) + r"/checkpoints/step-6:", rank0_logs(d))
    assert sha256(os.path.join(d, "model.pt")) == sha256(os.path.join(ref, "model.pt"))
    text = run_cli("clusterflow.status", d).stdout
    assert "excluded     node1 (left out of the job after a node failure" in text, text


def test_a_rank_failing_with_a_device_error_on_node1_resumes_on_node2_without_it(cluster, tmp_path):
    d, ref = run_on_node1_then_node2(tmp_path, *DEVICE_ERROR)
    assert_resumed_on_node2_without_node1(d, ref, "CUDA error: uncorrectable ECC error")


def test_a_rank_stalled_on_node1_resumes_on_node2_without_it(cluster, tmp_path):
    d, ref = run_on_node1_then_node2(tmp_path, *STALL)
    assert_resumed_on_node2_without_node1(d, ref, r"^stalled \d+ s at step 6 in train \(")
    first = json.load(open(os.path.join(d, "errors", "first.attempt0.json")))
    assert first["kind"] == "stall" and first["rank"] == 1 and first["host"] == "node1", first
