"""Issue 15 on the real two-node Slurm cluster, in few jobs (each test proves several things):

- a 2x2 sweep runs as one job array; one member's time-limit signal requeues that array task
  alone; another member, stopped at cluster.max_timeout_requeues, resumes when the sweep is
  submitted again with a longer cluster.time_min (alone: the completed members are skipped); a
  third submission submits nothing;
- stage 2 queued --after stage 1 waits across stage 1's requeue, loads its weights, and runs the
  task file as submitted although the file was edited while stage 2 was pending;
- cancel leaves status cancelled and nothing requeues.
"""

import json
import os
import re
import textwrap

import pytest
from conftest import run_cli
from slurmjobs import (
    TWO_NODES,
    at_step,
    env,
    live_status,
    queue,
    rank0_logs,
    scmd,
    sha256,
    status,
    submit,
    wait_gone,
    wait_until,
)

pytestmark = pytest.mark.slurm

ONE_TASK = (
    "cluster.nodes=1",
    "cluster.tasks_per_node=1",
    "cluster.cpus_per_task=1",
    "cluster.time_min=10",
)
SLOW = ("task.target=testtasks:Slow", "task.params.step_sleep=0.3")


def sweep_submit(sweep_dir, *extra):
    return run_cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        f"run.dir={sweep_dir}",
        *ONE_TASK,
        "task.target=testtasks:Slow",
        "task.params.step_sleep=0.5",
        "train.epochs=2",
        "cluster.max_timeout_requeues=1",
        "--sweep",
        "train.lr=0.001,0.003",
        "--sweep",
        "mining.k=3,5",
        *extra,
        env=env(),
    )


def test_sweep_is_one_job_array_members_requeue_alone_and_resubmissions_resume_only_the_stopped(
    cluster, tmp_path
):
    d = str(tmp_path / "sweep")
    out = sweep_submit(d)
    assert out.returncode == 0, out.stdout + out.stderr
    array = re.search(r"submitted job array (\d+): 4 member\(s\)", out.stdout).group(1)
    rows = json.loads(run_cli("clusterflow.status", d, "--json").stdout)
    assert [r["job_id"] for r in rows] == [f"{array}_{i}" for i in range(4)]
    # The time-limit signal to member 1: its rank 0 saves and requeues that array task only.
    one, two = rows[1]["run_dir"], rows[2]["run_dir"]
    wait_until("member 1 in mid-epoch 1", lambda: at_step(one, 3), job_id=array)
    scmd("scancel", "--signal=USR2", f"{array}_1")
    # Member 2 gets it twice: the second time is over cluster.max_timeout_requeues=1, so it stops.
    wait_until("member 2 in mid-epoch 1", lambda: at_step(two, 2), job_id=array)
    scmd("scancel", "--signal=USR2", f"{array}_2")
    wait_until("member 2's second attempt", lambda: at_step(two, 5, attempt=1), job_id=array)
    scmd("scancel", "--signal=USR2", f"{array}_2")
    wait_gone(array)
    rows = json.loads(run_cli("clusterflow.status", d, "--json").stdout)
    assert [r["state"] for r in rows] == ["completed", "completed", "stopped", "completed"], rows
    attempts = [len(open(os.path.join(r["run_dir"], "attempts.jsonl")).readlines()) for r in rows]
    assert attempts == [1, 2, 2, 1], attempts
    assert f"requeued job {array}_1 after the time-limit signal" in rank0_logs(one)
    assert "time limit reached 2 times" in rows[2]["error"]
    again = sweep_submit(d, "cluster.time_min=20")  # a resource may change: still the same sweep
    assert again.returncode == 0, again.stdout + again.stderr
    assert (
        "cluster.time_min 10 -> 20" in again.stderr and again.stdout.count("skip (completed)") == 3
    )
    job = re.search(r"submitted job array (\d+): 1 member\(s\)", again.stdout).group(1)
    wait_gone(job)
    rows = json.loads(run_cli("clusterflow.status", d, "--json").stdout)
    assert [r["state"] for r in rows] == ["completed"] * 4 and rows[2]["job_id"] == job, rows
    assert "4 member(s), 4 completed" in run_cli("clusterflow.status", d).stdout
    third = sweep_submit(d, "cluster.time_min=20")
    assert third.returncode == 0 and "nothing to submit" in third.stdout, (
        third.stdout + third.stderr
    )
    assert len(json.load(open(os.path.join(d, "sweep.json")))["submissions"]) == 2


FROZEN = textwrap.dedent("""
    import logging
    from clusterflow.tasks.pseudo_id import PseudoIDTask

    class Task(PseudoIDTask):
        def __init__(self, seed=0, **params):
            super().__init__(seed, **params)
            logging.getLogger("clusterflow").info("frozentask version %s", VERSION)

    VERSION = "submitted"
""")


def test_stage_two_waits_for_stage_one_across_its_requeue_and_runs_its_code_as_submitted(
    cluster, tmp_path
):
    s1, s2 = str(tmp_path / "s1"), str(tmp_path / "s2")
    code = tmp_path / "code"
    code.mkdir()
    (code / "frozentask.py").write_text(FROZEN)
    # Stage 1 trains behind a gate until stage 2 is submitted and its code edited: on a loaded
    # machine that submission alone can take longer than stage 1's whole run.
    gate = tmp_path / "gate"
    gate.touch()
    job1, _ = submit(s1, "task.target=testtasks:Gated", f"task.params.gate={gate}", *SLOW[1:])
    e = env()
    e["PYTHONPATH"] = f"{code}{os.pathsep}{e['PYTHONPATH']}"
    out = run_cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        f"run.dir={s2}",
        *TWO_NODES,
        "task.target=frozentask:Task",
        f"task.init_from={s1}",
        "train.epochs=1",
        "--after",
        s1,
        env=e,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    job2 = re.search(r"submitted job (\d+)", out.stdout).group(1)
    # Edited while stage 2 is pending: the job must run the version frozen at submission.
    (code / "frozentask.py").write_text(
        FROZEN.replace('"submitted"', '"edited"') + "\nraise RuntimeError('edited file ran')\n"
    )
    gate.unlink()
    wait_until("stage 1 in mid-epoch 1", lambda: at_step(s1, 3), job_id=job1)
    assert queue(job2).startswith("PENDING Dependency")
    scmd("scontrol", "requeue", job1)
    wait_until("stage 1's second attempt", lambda: at_step(s1, 8, attempt=1), job_id=job1)
    assert queue(job2).startswith(
        "PENDING Dependency"
    )  # the requeued job keeps its id: afterok still holds
    wait_gone(job1)
    wait_gone(job2)
    one, two = status(s1), status(s2)
    assert one["state"] == "completed" and one["attempts"] == 2 and two["state"] == "completed", (
        one,
        two,
    )
    started = json.loads(open(os.path.join(s2, "attempts.jsonl")).readline())["started_at"]
    assert started >= os.path.getmtime(os.path.join(s1, "model.pt"))
    logs = rank0_logs(s2)
    assert f"from {s1}/model.pt" in logs
    assert "frozentask version submitted" in logs and "frozentask version edited" not in logs
    assert (
        two["code"]["module"] == "frozentask"
        and "frozen at commit (no git)" in run_cli("clusterflow.status", s2).stdout
    )


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


@pytest.mark.slow  # ~40 s: a sweep of two twins, one preempted
def test_a_preempted_sweep_member_is_requeued_alone_and_ends_bitwise_equal_to_its_twin(
    cluster, tmp_path
):
    """The two members differ only in how often they log, which changes no weight: the member
    preempted in mid-epoch ends bitwise equal to its twin, which ran uninterrupted beside it."""
    d = str(tmp_path / "sweep")
    one_node = (
        "cluster.nodes=1",
        "cluster.tasks_per_node=1",
        "cluster.cpus_per_task=2",
        *SLOW,
    )  # one member per node
    out = run_cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        f"run.dir={d}",
        *one_node,
        "--sweep",
        "train.log_every_steps=1,3",
        env=env(),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    array = re.search(r"submitted job array (\d+): 2 member\(s\)", out.stdout).group(1)
    rows = json.loads(run_cli("clusterflow.status", d, "--json").stdout)
    first, twin = rows[0]["run_dir"], rows[1]["run_dir"]
    wait_until("member 0 in mid-epoch 2", lambda: at_step(first, 8), job_id=array)
    node = live_status(first)["hosts"][0]
    high = scmd(
        "sbatch",
        "--parsable",
        "-p",
        "high",
        "--exclusive",
        "-N",
        "1",
        "-w",
        node,
        "-t",
        "2",
        f"--output={tmp_path}/high-%j.out",
        "--wrap",
        "hostname; sleep 2",
    )
    wait_gone(high)
    wait_gone(array)
    assert os.path.exists(tmp_path / f"high-{high}.out")  # the preemptor really ran
    rows = json.loads(run_cli("clusterflow.status", d, "--json").stdout)
    assert [r["state"] for r in rows] == ["completed", "completed"], rows
    attempts = [len(open(os.path.join(r["run_dir"], "attempts.jsonl")).readlines()) for r in rows]
    assert attempts == [2, 1], attempts  # only the preempted array task came back
    assert sha256(os.path.join(first, "model.pt")) == sha256(os.path.join(twin, "model.pt"))
