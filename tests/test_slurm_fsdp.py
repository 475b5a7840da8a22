"""train.parallel=fsdp on the real two-node Slurm cluster: one rank per node, each writing its
own shards of every checkpoint; a `scontrol requeue` in mid-epoch resumes from the shards both
nodes wrote and ends with a model.pt bitwise equal to an uninterrupted sharded run."""

import json
import os

import pytest
from slurmjobs import live_status, rank0_logs, scmd, sha256, status, submit, wait_gone, wait_until

pytestmark = pytest.mark.slurm

FSDP = ("train.parallel=fsdp",)
SLOW = ("task.target=testtasks:Slow", "task.params.step_sleep=0.4")


def test_sharded_run_on_two_nodes_resumes_after_a_requeue_bitwise(cluster, tmp_path):
    # The uninterrupted reference trains beside the run under test (one core of each node each).
    ref = str(tmp_path / "ref")
    ref_job, _ = submit(ref, *FSDP, *SLOW, "task.params.step_sleep=0")

    d = str(tmp_path / "run")
    # Slowed in attempt 0 only, so that the requeue lands in mid-epoch; the requeued attempt
    # trains the rest at full speed.
    job, _ = submit(d, *FSDP, *SLOW, f"task.params.run_dir={d}", "task.params.slow_attempts=1")
    wait_until(
        "mid-epoch 1",
        lambda: (
            live_status(d).get("global_step", 0) >= 3 and live_status(d).get("state") == "running"
        ),
        job_id=job,
    )
    scmd("scontrol", "requeue", job)  # SIGTERM to both nodes' ranks, then requeued
    wait_gone(job)
    wait_gone(ref_job)
    assert status(ref)["state"] == "completed"
    s = status(d)
    assert s["state"] == "completed" and s["attempts"] == 2, s
    logs = rank0_logs(d)
    assert "resumed from" in logs and "from 2 ranks" in logs, logs
    manifest = json.load(open(os.path.join(d, "checkpoints", "step-18", "manifest.json")))
    assert manifest["format"] == "dcp"
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(manifest["files"])
    assert sha256(os.path.join(d, "model.pt")) == sha256(os.path.join(ref, "model.pt"))
