"""A script of the user's own on the real local Slurm cluster (``submit --script``, the converted
DDP script of tests/ownloop/, a DataLoader worker a rank): preempted by ``scontrol requeue`` in
mid-epoch 1 (Slurm's SIGTERM reaches the workers too), it saves and comes back as a requeued
attempt; a rank of that attempt SIGKILLed in mid-epoch 2 restarts it
inside the allocation on the spare node; the run ends bitwise equal to the same script's
uninterrupted run, and ``status`` and ``goodput`` say what happened. One run serves every check
(about 3 minutes with its reference)."""

import json
import os
import re
import signal
import time

import pytest
from conftest import REPO, run_cli
from slurmjobs import (
    TWO_NODES,
    at_step,
    env,
    rank0_logs,
    read_jsonl,
    scmd,
    sha256,
    status,
    wait_gone,
)
from slurmjobs import wait_until as wait_for

from clusterflow import rundir
from clusterflow.rundir import restarts

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SCRIPT = os.path.join(REPO, "tests", "ownloop", "converted_ddp.py")
CONFIG = ("checkpoint.every_steps=4", "checkpoint.async=false", "train.log_every_steps=1")


def submit_script(run_dir, *overrides, extra_env=None):
    out = run_cli(
        "clusterflow.submit",
        "--script",
        SCRIPT,
        f"run.dir={run_dir}",
        *TWO_NODES,
        *CONFIG,
        *overrides,
        "--",
        "--epochs",
        "3",
        # Slurm signals every process of the job, the DataLoader workers too.
        "--workers",
        "1",
        env={**env(), **(extra_env or {})},
    )
    m = re.search(r"submitted job (\d+)", out.stdout)
    assert m, out.stdout + out.stderr
    return m.group(1), out


def test_a_script_is_requeued_after_preemption_and_restarted_in_its_allocation(cluster, tmp_path):
    # The uninterrupted reference trains beside the run under test (one core of each node each).
    ref = str(tmp_path / "reference")
    ref_job, _ = submit_script(ref)

    d = str(tmp_path / "run")
    job, _ = submit_script(
        d,
        "cluster.partition=wide",
        "cluster.spare_nodes=1",
        extra_env={"STEP_SLEEP_S": "0.3"},
    )
    wait_for("mid-epoch 1", lambda: at_step(d, 3, 0), job_id=job)
    scmd("scontrol", "requeue", job)  # SIGTERM to every task, then Slurm requeues the job
    wait_for("the requeued attempt in mid-epoch 2", lambda: at_step(d, 9, 1), job_id=job)
    second = read_jsonl(os.path.join(d, "attempts.jsonl"))[1]
    host, pid, _ = second["procs"][1]  # rank 1's process (the nodes share this machine's pids)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    wait_gone(job, timeout=300)

    s = status(d)
    assert s["state"] == "completed" and s["attempts"] == 3, s
    assert s["script"] == {
        "path": os.path.normpath(SCRIPT),
        "args": ["--epochs", "3", "--workers", "1"],
    }
    assert s["global_step"] == 18 and s["epoch"] == 3, s
    attempts = read_jsonl(os.path.join(d, "attempts.jsonl"))
    assert [a["job_id"] for a in attempts] == [job] * 3, attempts
    assert [a.get("restart_in_job") for a in attempts] == [0, 0, 1], attempts
    assert sorted(set(attempts[2]["hosts"])) == sorted({"node1", "node2", "node3"} - {host})
    reasons = [r["reason"] for r in read_jsonl(os.path.join(d, "stops.jsonl"))]
    assert reasons == ["preempted"], reasons
    (r,) = restarts.read(rundir.RunPaths(d))
    assert (r["cause"], r["rank"], r["host"]) == ("crash", 1, host), r
    assert killed_at - 1 < r["fault_at"] <= r["restart_at"] < r["first_step_at"], r
    logs = rank0_logs(d)
    # In mid-epoch ("saving at global step N and stopping") or, for a signal at an epoch's last
    # step, after that epoch's end ("saved at global step N (the end of epoch E)").
    saved = [int(x) for x in re.findall(r"sav(?:ing|ed) at global step (\d+)", logs)]
    resumed = [int(x) for x in re.findall(r"resumed from \S+/step-(\d+):", logs)]
    assert len(saved) == 1 and resumed[0] == saved[0] >= 3, (saved, resumed)
    assert len(resumed) == 2 and resumed[1] >= saved[0], resumed  # the restart
    wait_gone(ref_job, timeout=300)
    assert status(ref)["state"] == "completed"
    assert sha256(os.path.join(d, "model.pt")) == sha256(os.path.join(ref, "model.pt"))

    shown = run_cli("clusterflow.status", d, env=env()).stdout
    assert f"script       {os.path.normpath(SCRIPT)} --epochs 3 --workers 1" in shown, shown
    assert "attempts     3 (1 restart(s) inside the job" in shown, shown
    out = run_cli("clusterflow.goodput", d, "--json", env=env())
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(out.stdout)["attempts"]
    assert len(rows) == 3
    for row in rows:
        assert abs(sum(row["seconds"].values()) - row["wall_s"]) <= 0.01 * row["wall_s"], row
    assert rows[0]["restart_in_job"] is None and rows[2]["restart_in_job"]["left_out"] == [host]
    assert rows[2]["sources"]["allocated"] == "previous attempt's end (same allocation)"
    assert sum(row["seconds"]["productive"] for row in rows) > 0
