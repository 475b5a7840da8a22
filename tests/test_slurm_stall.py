"""Hangs on the real two-node Slurm cluster: a rank that stops moving is named, with its stack, and
the job ends within dist.stall_s plus a minute instead of dist.timeout_s; `status --ranks` on a
running job shows every rank's fresh heartbeat."""

import json
import os
import time

import pytest
from conftest import run_cli
from slurmjobs import status, submit, wait_until

pytestmark = pytest.mark.slurm
STALL_S = 10
STALL = (
    "task.target=testtasks:StallOnRank1",
    f"dist.stall_s={STALL_S}",
    "dist.heartbeat_s=0.5",
    "dist.timeout_s=300",
    # The job ends at the stall: it does not go on without the stalled rank's node (a restart on
    # the remaining node is tests/test_slurm_recovery.py's).
    "cluster.shrink=false",
)


def _ended_within_stall_and_a_minute(d, s):
    first = json.load(open(os.path.join(d, "errors", "first.attempt0.json")))
    stalled_since = first["time"] - first["stalled_s"]
    assert time.time() - stalled_since < STALL_S + 60, (
        first
    )  # the job is over (submit --wait returned) by now
    assert s["slurm"]["state"] == "FAILED" and s["slurm"]["exit_code"] == 86, s[
        "slurm"
    ]  # the watchdog's exit code


def test_a_rank_that_sleeps_in_its_loss_is_named_with_its_stack(cluster, tmp_path):
    d = str(tmp_path / "run")
    _, out = submit(d, *STALL, "task.params.at=3", wait=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stdout + out.stderr
    assert "ended: failed" in out.stdout, out.stdout
    s = status(d)
    assert s["state"] == "failed"
    assert s["error"].startswith(f"rank 1 on node2 stalled {STALL_S} s at step 2 in train ("), s[
        "error"
    ]
    assert "testtasks.py:" in s["error"], s[
        "error"
    ]  # tests/testtasks.py or its copy frozen into RUN_DIR/code/
    assert s["error"].endswith("sleeping_in_loss)"), s["error"]
    _ended_within_stall_and_a_minute(d, s)
    log = open(os.path.join(d, "logs", "rank1.attempt0.log")).read()
    assert "stacks of every thread" in log and "in sleeping_in_loss" in log
    # A stalled rank's node is a suspect, but a two-node job on two nodes cannot leave one out.
    assert (
        "node node2 failed (stalled 10 s at step 2 in train (" in log
        and "not requeued without it: leaving out node2 would leave 1 node(s) of the partition "
        "for a job of 2"
        in log
    ), log


def test_running_ranks_are_listed_then_a_rank_stuck_in_mining_embed_is_named(cluster, tmp_path):
    d = str(tmp_path / "run")
    job_id, out = submit(d, *STALL, "task.params.in_embed=true", "task.params.step_sleep=1.5")
    assert out.returncode == 0, out.stdout + out.stderr

    def both_fresh():
        s = json.loads(run_cli("clusterflow.status", d, "--json").stdout or "{}")
        rs = s.get("ranks") or []
        ok = (
            s.get("state") == "running"
            and len(rs) == 2
            and all(
                r["phase"] == "train"
                and r["heartbeat_age_s"] is not None
                and r["heartbeat_age_s"] < 5
                and not r["silent"]
                for r in rs
            )
        )
        return ok and s

    s = wait_until(
        "both ranks training with fresh heartbeats", both_fresh, timeout=180, job_id=job_id
    )
    assert [(r["rank"], r["host"]) for r in s["ranks"]] == [(0, "node1"), (1, "node2")]
    table = run_cli("clusterflow.status", d, "--ranks").stdout
    assert table.splitlines()[0].split()[:4] == ["rank", "host", "step", "phase"], table
    assert " node1 " in table and " node2 " in table, table
    wait_until(
        "the job to fail",
        lambda: status(d)["state"] == "failed",
        timeout=STALL_S + 180,
        job_id=job_id,
    )
    s = status(d)
    assert (
        s["error"].startswith("rank 1 on node2 stalled") and " in mining embed (" in s["error"]
    ), s["error"]
    assert "testtasks.py:" in s["error"], s["error"]
    assert s["error"].endswith("sleeping_in_embed)"), s["error"]
    log = open(os.path.join(d, "logs", "rank1.attempt0.log")).read()
    assert "in sleeping_in_embed" in log
    # rank 0 logged every rank's step time from the heartbeats (no collective), node2's included
    assert '"ranks/step_time_s/rank1"' in open(os.path.join(d, "metrics.jsonl")).read()
