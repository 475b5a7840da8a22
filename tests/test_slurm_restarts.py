"""Restart inside the allocation, on the real local Slurm cluster (partition wide: node1..3): a job
of two nodes and one spare whose rank 1 is SIGKILLed in mid-epoch starts a new srun step in the
same Slurm job, from the newest checkpoint, on node1 and the spare node3 (node2 left out), records
the restart and the time from the fault to the next step, and ends bitwise equal to an
uninterrupted run."""

import json
import os
import signal
import time

import pytest
from conftest import run_cli
from slurmjobs import TWO_NODES, env, live_status, sha256, status, submit, wait_gone, wait_until

from clusterflow import rundir
from clusterflow.rundir import restarts

pytestmark = pytest.mark.slurm


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_a_rank_killed_mid_epoch_trains_again_in_the_same_job_on_the_spare(
    cluster, reference_run, tmp_path
):
    d = str(tmp_path / "run")
    job, out = submit(
        d,
        "cluster.partition=wide",
        "cluster.spare_nodes=1",
        "task.target=testtasks:Slow",
        "task.params.step_sleep=0.3",
        "checkpoint.async=false",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # Mid-epoch 2 (steps 7-12), after the checkpoint of step 8.
    wait_until("step 9", lambda: (live_status(d).get("global_step") or 0) >= 9, job_id=job)
    (first,) = read_jsonl(os.path.join(d, "attempts.jsonl"))
    host, pid, _ = first["procs"][1]  # rank 1's process (the nodes share this machine's pids)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    wait_gone(job, timeout=300)

    s = status(d)
    assert s["state"] == "completed" and s["attempts"] == 2, s
    attempts = read_jsonl(os.path.join(d, "attempts.jsonl"))
    assert [a["job_id"] for a in attempts] == [job, job], attempts  # no requeue, no new job
    assert [a.get("restart_in_job") for a in attempts] == [0, 1], attempts
    assert sorted(set(attempts[0]["hosts"])) == ["node1", "node2"] and host == "node2"
    assert sorted(set(attempts[1]["hosts"])) == ["node1", "node3"], attempts  # on the spare
    (r,) = restarts.read(rundir.RunPaths(d))
    assert (r["cause"], r["rank"], r["host"], r["left_out"]) == ("crash", 1, "node2", ["node2"])
    assert r["failed_attempt"] == 0 and r["next_attempt"] == 1 and r["first_step"] == 9, r
    assert killed_at - 1 < r["fault_at"] <= r["restart_at"] < r["first_step_at"], r
    # The bound (back training within 60 s); a requeue alone waits longer.
    assert 0 < r["recovery_s"] < 60, r
    ref_dir, _ = reference_run
    assert sha256(os.path.join(d, "model.pt")) == sha256(os.path.join(ref_dir, "model.pt"))
    # The goodput ledger: each attempt's parts sum to its wall time, and the restart is in it.
    out = run_cli("clusterflow.goodput", d, "--json", env=env())
    assert out.returncode == 0, out.stdout + out.stderr
    book = json.loads(out.stdout)
    rows = book["attempts"]
    for row in rows:
        assert abs(sum(row["seconds"].values()) - row["wall_s"]) <= 0.01 * row["wall_s"], row
    assert rows[0]["restart_in_job"] is None
    back = rows[1]["restart_in_job"]
    assert back["recovery_s"] == r["recovery_s"] and back["left_out"] == ["node2"], back
    assert rows[1]["sources"]["allocated"] == "previous attempt's end (same allocation)"
    shown = run_cli("clusterflow.goodput", d, env=env()).stdout
    assert "restart in job: attempt 1 after a crash of rank 1 on node2: back training" in shown


def test_spares_beyond_the_partition_are_refused_before_anything_is_submitted(cluster, tmp_path):
    d = str(tmp_path / "run")
    out = run_cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        f"run.dir={d}",
        *TWO_NODES,
        "cluster.partition=low",
        "cluster.spare_nodes=1",
        env=env(),
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip() == (
        "error: cluster.spare_nodes = 1: with cluster.nodes = 2 the job asks for 3 node(s) but "
        "partition 'low' has 2; lower cluster.spare_nodes"
    )
    assert not os.path.exists(os.path.join(d, "status.json"))
