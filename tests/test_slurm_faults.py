"""Faults users cause, on the real two-node Slurm cluster: a rank killed (srun names it first), a
moved run dir resumed through the sbatch template. (A second job on a held run dir is refused in
test_slurm_job_time.py, on the job that proves its time.)"""

import os
import shutil
import time

import pytest
from conftest import REPO, run_cli
from slurmjobs import (
    TWO_NODES,
    env,
    sbatch_wait,
    sha256,
    status,
)

from clusterflow import rundir
from clusterflow.rundir import restarts

pytestmark = pytest.mark.slurm
# Synchronous saves: a kill in step 10 then always finds step 8 committed, never still being
# written.
KILL_TASK = ("task.target=testtasks:KillAtEnv", "checkpoint.async=false")


def test_a_rank_killed_on_slurm_is_named_first_not_its_peer(cluster, tmp_path):
    """Also: the task kills rank 1 in step 2 of every attempt, a step that keeps failing with
    nothing committed between: after cluster.restarts_in_job (one here) restarts of it, the job
    fails, "no progress" at step 2, naming the rank srun saw end first."""
    d = str(tmp_path / "run")
    t0 = time.time()
    out = run_cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        f"run.dir={d}",
        *TWO_NODES,
        *KILL_TASK,
        "cluster.restarts_in_job=1",
        "--wait",
        env={**env(), "CLUSTERFLOW_TEST_KILL_AT": "2", "CLUSTERFLOW_TEST_KILL_RANK": "1"},
    )
    assert out.returncode == 1, out.stdout + out.stderr
    # srun --kill-on-bad-exit ends rank 0 at once, not after dist.timeout_s (600 s)
    assert time.time() - t0 < 600
    s = status(d)
    assert s["state"] == "failed" and s["attempts"] == 2, s
    assert s["error"].startswith("no progress at step 2: tried 2 times"), s["error"]
    assert "the last time rank 1 on node2: Killed (crash)" in s["error"], s["error"]
    (restart,) = restarts.read(rundir.RunPaths(d))  # one restart, then no more
    assert (restart["cause"], restart["host"], restart["nodes"]) == (
        "crash",
        "node2",
        ["node1", "node2"],
    )  # no spare: the same nodes again
    assert "not restarted in the job after rank 1 on node2: Killed (crash): no progress" in (
        open(os.path.join(d, "logs", "slurm", s["job_id"], f"{s['job_id']}_0_log.err")).read()
    )


def sbatch_template(run_dir, log_dir, extra_env=None):
    cmd = [
        "-N",
        "2",
        "--ntasks-per-node=1",
        f"--output={log_dir}/slurm-%j.out",
        os.path.join(REPO, "slurm_templates", "train.sbatch"),
        "configs/tiny.yaml",
        f"run.dir={run_dir}",
        *KILL_TASK,
        "cluster.restarts_in_job=0",  # the kill ends the job: it is resumed by a second one
    ]
    return sbatch_wait(cmd, env={**os.environ, **env(), **(extra_env or {})})


def test_a_moved_run_dir_resumes_through_the_sbatch_template(cluster, reference_run, tmp_path):
    a, b = str(tmp_path / "runA"), str(tmp_path / "runB")
    first = sbatch_template(
        a, tmp_path, {"CLUSTERFLOW_TEST_KILL_AT": "10"}
    )  # every rank SIGKILLed in step 10
    assert first.returncode != 0
    shutil.move(a, b)
    out = sbatch_template(b, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not os.path.exists(a)
    s = status(b)
    assert s["state"] == "completed" and s["attempts"] == 2
    assert s["world_size"] == 2 and s["hosts"] == ["node1", "node2"], s  # the template's route
    assert (
        "resumed from " + os.path.join(b, "checkpoints", "step-8")
        in open(os.path.join(b, "logs", "rank0.attempt1.log")).read()
    )
    ref_dir, _ = reference_run
    assert sha256(os.path.join(b, "model.pt")) == sha256(os.path.join(ref_dir, "model.pt"))
