"""Faults users cause, on the real two-node Slurm cluster: a rank killed (srun names it first), a
moved run dir resumed through the sbatch template (a run that mines sharded across both nodes, and
ends with the weights of the same run searched on rank 0). (A second job on a held run dir is
refused in test_slurm_job_time.py, on the job that proves its time.)"""

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
    """Rank 1 SIGKILLed in step 2 of the first attempt: srun names it, not rank 0 that it ends,
    and the job restarts on the same nodes (no spare). In the next attempt the task itself raises
    on rank 1 (a ValueError in its loss): no restart cures that, the job fails fast, exit 1, and
    status names the task's own failure first, not rank 0's."""
    d = str(tmp_path / "run")
    t0 = time.time()
    out = run_cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        f"run.dir={d}",
        *TWO_NODES,
        "task.target=testtasks:KilledThenCrashOnRank1",
        f"task.params.run_dir={d}",
        "checkpoint.async=false",
        "cluster.restarts_in_job=1",
        "dist.timeout_s=60",
        "--wait",
        env=env(),
    )
    ended = time.time()
    assert out.returncode == 1, out.stdout + out.stderr
    assert ended - t0 < 600  # not at the time limit (cluster.time_min=10)
    s = status(d)
    assert s["state"] == "failed" and s["attempts"] == 2, s
    (restart,) = restarts.read(rundir.RunPaths(d))  # one restart: the kill's, not the error's
    assert (restart["cause"], restart["rank"], restart["host"], restart["error"]) == (
        "crash",
        1,
        "node2",
        "Killed",
    ), restart  # srun's first report: the killed rank, not rank 0 that srun ended after it
    assert restart["nodes"] == ["node1", "node2"], restart  # no spare: the same nodes again
    # srun --kill-on-bad-exit ends rank 0 at once, not after dist.timeout_s (60 s here)
    assert restart["restart_at"] - restart["fault_at"] < 60, restart
    job = s["job_id"]
    batch_log = open(os.path.join(d, "logs", "slurm", job, f"{job}_0_log.err")).read()
    assert (
        f"restart 1 in job {job} after rank 1 on node2: Killed (crash): resuming from the "
        "newest checkpoint on node1, node2"
    ) in batch_log, batch_log[-3000:]
    # The task's own failure in the restarted attempt ends the job within the process-group
    # timeout of its first step, not at the time limit, and is not restarted.
    assert ended - restart["first_step_at"] < 60 + 30, (ended, restart)
    assert "restart 2 in job" not in batch_log, batch_log[-3000:]
    assert any(e["rank"] == 1 and "deliberate failure" in e["error"] for e in s["errors"]), s
    # the first cause, not rank 0's: the task's own failure, named with the method it raised in
    assert s["error"].startswith(
        "rank 1: task.target 'testtasks:KilledThenCrashOnRank1' failed in loss"
    ), s["error"]
    assert "ValueError: deliberate failure" in s["error"], s["error"]


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
        "mining.search=sharded",
        "cluster.restarts_in_job=0",  # the kill ends the job: it is resumed by a second one
    ]
    return sbatch_wait(cmd, env={**os.environ, **env(), **(extra_env or {})})


def test_a_moved_run_dir_resumes_through_the_sbatch_template(cluster, reference_run, tmp_path):
    """Killed in step 10, moved, resumed by a second template job from the moved dir's own
    checkpoint. Its mining rounds are searched across both nodes (a rank a node), and the run
    still ends with the weights of the session's reference, searched on rank 0."""
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
    assert len(s["mining"]) == 2 and all("sharded over 2 ranks" in m["engine"] for m in s["mining"])
    assert all(m["hooking_rounds"] >= 1 for m in s["mining"]), s["mining"]
    ref_dir, _ = reference_run
    want = [(m["num_clusters"], m["largest_cluster"]) for m in status(ref_dir)["mining"]]
    assert [(m["num_clusters"], m["largest_cluster"]) for m in s["mining"]] == want, s["mining"]
    assert sha256(os.path.join(b, "model.pt")) == sha256(os.path.join(ref_dir, "model.pt"))
