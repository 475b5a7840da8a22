"""Issue 15 on the real two-node Slurm cluster: a 2x2 sweep as one job array (one member requeued
alone by its own time-limit signal; resubmitting submits nothing), stage 2 queued --after stage 1
(which is requeued meanwhile), cancel, a time-limit stop resumed with a longer time limit, and a
task file edited while its job is held runs the submitted version."""

import json
import os
import re
import textwrap

import pytest

from conftest import run_cli
from slurmjobs import TWO_NODES, env, live_status, queue, rank0_logs, scmd, status, submit, wait_gone, wait_until

pytestmark = pytest.mark.slurm

ONE_TASK = ("cluster.nodes=1", "cluster.tasks_per_node=1", "cluster.cpus_per_task=1", "cluster.time_min=10")
SLOW = ("task.target=testtasks:Slow", "task.params.step_sleep=0.3")


def at_step(run_dir, step, attempt=0):
    s = live_status(run_dir)
    return s.get("attempt") == attempt and s.get("global_step", 0) >= step and s.get("state") == "running"


def sweep_submit(sweep_dir, *extra):
    return run_cli("clusterflow.submit", "configs/tiny.yaml", f"run.dir={sweep_dir}", *ONE_TASK, *SLOW, "train.epochs=2",
                   "--sweep", "train.lr=0.001,0.003", "--sweep", "mining.k=3,5", *extra, env=env())


def test_sweep_is_one_job_array_a_member_requeues_alone_and_resubmitting_submits_nothing(cluster, tmp_path):
    d = str(tmp_path / "sweep")
    out = sweep_submit(d)
    assert out.returncode == 0, out.stdout + out.stderr
    array = re.search(r"submitted job array (\d+): 4 member\(s\)", out.stdout).group(1)
    rows = json.loads(run_cli("clusterflow.status", d, "--json").stdout)
    assert [r["job_id"] for r in rows] == [f"{array}_{i}" for i in range(4)]
    # The time-limit signal to one member: its rank 0 saves and requeues that array task only.
    member = rows[1]["run_dir"]
    wait_until("member 1 in mid-epoch 1", lambda: at_step(member, 3), job_id=array)
    scmd("scancel", "--signal=USR2", f"{array}_1")
    wait_gone(array)
    rows = json.loads(run_cli("clusterflow.status", d, "--json").stdout)
    assert [r["state"] for r in rows] == ["completed"] * 4, rows
    attempts = [len(open(os.path.join(r["run_dir"], "attempts.jsonl")).readlines()) for r in rows]
    assert attempts == [1, 2, 1, 1], attempts
    assert f"requeued job {array}_1 after the time-limit signal" in rank0_logs(member)
    table = run_cli("clusterflow.status", d).stdout
    assert "4 member(s), 4 completed" in table
    again = sweep_submit(d, "cluster.time_min=20")  # a resource may change: still the same sweep
    assert again.returncode == 0 and "nothing to submit" in again.stdout, again.stdout + again.stderr
    assert "submitted" not in again.stdout and len(json.load(open(os.path.join(d, "sweep.json")))["submissions"]) == 1


def test_stage_two_waits_for_stage_one_across_its_requeue(cluster, tmp_path):
    s1, s2 = str(tmp_path / "s1"), str(tmp_path / "s2")
    job1, _ = submit(s1, *SLOW)
    out = run_cli("clusterflow.submit", "configs/tiny.yaml", f"run.dir={s2}", *TWO_NODES, f"task.init_from={s1}",
                  "--after", s1, env=env())
    assert out.returncode == 0, out.stdout + out.stderr
    job2 = re.search(r"submitted job (\d+)", out.stdout).group(1)
    wait_until("stage 1 in mid-epoch 1", lambda: at_step(s1, 3), job_id=job1)
    assert queue(job2).startswith("PENDING Dependency")
    scmd("scontrol", "requeue", job1)
    wait_until("stage 1's second attempt", lambda: at_step(s1, 8, attempt=1), job_id=job1)
    assert queue(job2).startswith("PENDING Dependency")  # the requeued job keeps its id: afterok still holds
    wait_gone(job1)
    wait_gone(job2)
    one, two = status(s1), status(s2)
    assert one["state"] == "completed" and one["attempts"] == 2 and two["state"] == "completed", (one, two)
    started = json.loads(open(os.path.join(s2, "attempts.jsonl")).readline())["started_at"]
    assert started >= os.path.getmtime(os.path.join(s1, "model.pt"))
    assert f"from {s1}/model.pt" in rank0_logs(s2)


def test_cancel_leaves_cancelled_and_nothing_requeues(cluster, tmp_path):
    d = str(tmp_path / "run")
    job, _ = submit(d, *SLOW)
    wait_until("mid-epoch 1", lambda: at_step(d, 3), job_id=job)
    out = run_cli("clusterflow.cancel", d)
    assert out.returncode == 0 and f"cancelled job {job}" in out.stdout, out.stdout + out.stderr
    wait_gone(job)
    s = status(d)
    assert s["state"] == "cancelled" and s["attempts"] == 1, s
    assert not queue(job)


def test_time_limit_stop_resumes_with_a_longer_time_limit(cluster, tmp_path):
    d = str(tmp_path / "run")
    job, _ = submit(d, *SLOW, "cluster.max_timeout_requeues=0")
    wait_until("mid-epoch 1", lambda: at_step(d, 3), job_id=job)
    scmd("scancel", "--signal=USR2", job)  # what Slurm sends ahead of the time limit
    wait_gone(job)
    s = status(d)
    assert s["state"] == "stopped" and "time limit reached 1 times" in s["error"], s
    job2, out = submit(d, *SLOW, "cluster.max_timeout_requeues=0", "cluster.time_min=20", wait=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resumes with changed resources: cluster.time_min 10 -> 20" in out.stderr
    s = status(d)
    assert s["state"] == "completed" and s["job_id"] == job2 and s["attempts"] == 2, s


def test_a_task_edited_while_its_job_is_held_runs_the_submitted_version(cluster, tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    task = code / "frozentask.py"
    source = textwrap.dedent("""
        import logging
        from clusterflow.tasks.pseudo_id import PseudoIDTask

        class Task(PseudoIDTask):
            def __init__(self, seed=0, **params):
                super().__init__(seed, **params)
                logging.getLogger("clusterflow").info("frozentask version %s", VERSION)

        VERSION = "submitted"
    """)
    task.write_text(source)
    d = str(tmp_path / "run")
    e = env()
    e["PYTHONPATH"] = f"{code}{os.pathsep}{e['PYTHONPATH']}"
    out = run_cli("clusterflow.submit", "configs/tiny.yaml", f"run.dir={d}", *TWO_NODES, "task.target=frozentask:Task",
                  "cluster.sbatch_extra={hold: true}", env=e)
    assert out.returncode == 0, out.stdout + out.stderr
    job = re.search(r"submitted job (\d+)", out.stdout).group(1)
    assert "JobHeldUser" in queue(job) or "PENDING" in queue(job)
    task.write_text(source.replace('"submitted"', '"edited"') + "\nraise RuntimeError('the edited file ran')\n")
    scmd("scontrol", "release", job)
    wait_gone(job)
    s = status(d)
    assert s["state"] == "completed" and s["code"]["module"] == "frozentask", s
    assert "frozentask version submitted" in rank0_logs(d) and "frozentask version edited" not in rank0_logs(d)
