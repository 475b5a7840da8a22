"""Restart inside the allocation, on the real local Slurm cluster (partition wide: node1..3): spares
beyond the partition are refused before anything is submitted. A frozen rank (SIGSTOP) is named
by its silent heartbeat and its node left out, and the job trains again on the spare, from the
shared filesystem's newest checkpoint; the batch step's driver killed ends the run failed (Slurm
does not requeue it), with the command that resumes it.

Restart budgets count faults without progress (rundir/tries.py): a run killed once, then crashed
by a poisoned sample in every try of one step, restarts after each fault that followed progress
and ends failed after the third try of that step, naming the step and the samples of its batch.
(A rank killed in mid-epoch, three times in one job, restarting on the spare from the nodes'
memory, with the time from each fault to the next step and the goodput ledger of the restarts;
a rank frozen right after a heartbeat, named by the rank that waits for it, and a spare that
fails its node check: tests/test_slurm_recovery.py.)"""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from conftest import REPO, run_cli
from slurmjobs import (
    TWO_NODES,
    env,
    live_status,
    read_jsonl,
    sha256,
    status,
    submit,
    wait_gone,
    wait_until,
)

from clusterflow.distributed.sampler import GlobalBatchSampler

pytestmark = pytest.mark.slurm


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


def _driver_pid(run_dir):
    """The batch step's own process, ``python -m clusterflow.job.restarts RUN/config.yaml -- ...``
    (the test cluster's nodes share this machine's pids)."""
    config = os.path.join(run_dir, "config.yaml").encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"clusterflow.job.restarts" in argv and config in argv:
            return int(pid)
    return None


@pytest.mark.slow
def test_a_frozen_rank_is_left_out_then_a_killed_driver_ends_the_run_failed(
    cluster, reference_run, tmp_path
):
    """SIGSTOP on rank 1: the healthy rank 0 waits in a collective until its watchdog ends it;
    the restart names rank 1 (its heartbeat went silent) and leaves node2 out. Then SIGKILL on the
    batch step's driver (an OOM kill on the batch node): Slurm ends the job FAILED and does not
    requeue it, so the ranks, which saved on the step's SIGTERM, say failed, not requeued;
    `submit --wait` and `status` agree; the resume command named trains to the end bitwise equal
    to an uninterrupted run."""
    d = str(tmp_path / "run")
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    waiting = subprocess.Popen(
        [
            sys.executable, "-m", "clusterflow.submit", "configs/tiny.yaml", f"run.dir={d}",
            *TWO_NODES, "cluster.partition=wide", "cluster.spare_nodes=1",
            "task.target=testtasks:Slow", "task.params.step_sleep=0.5", "checkpoint.async=false",
            # slowed while the test acts (the freeze, then the driver's kill); the resume not
            f"task.params.run_dir={d}", "task.params.slow_attempts=2",
            "dist.stall_s=10", "dist.heartbeat_s=0.5", "--wait",
        ],
        cwd=REPO, env={**e, **env()}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    job = wait_until("the job id", lambda: live_status(d).get("job_id"), timeout=120)
    wait_until("step 3", lambda: (live_status(d).get("global_step") or 0) >= 3, job_id=job)
    (first,) = read_jsonl(os.path.join(d, "attempts.jsonl"))
    host, pid, _ = first["procs"][1]
    assert host == "node2"
    os.kill(pid, signal.SIGSTOP)
    path = os.path.join(d, "restarts.jsonl")
    wait_until("the restart", lambda: os.path.exists(path), timeout=180, job_id=job)
    (r,) = [x for x in read_jsonl(path) if x["event"] == "restart"]
    assert (r["cause"], r["rank"], r["host"]) == ("stall", 1, "node2"), r
    assert r["nodes"] == ["node1", "node3"] and r["left_out"] == ["node2"], r
    assert "no heartbeat for" in r["error"] and "rank 0 on node1" in r["error"], r

    # The restarted attempt trains; then the batch step's driver is killed.
    wait_until(
        "the restarted attempt training",
        lambda: (
            live_status(d).get("attempt") == 1
            and live_status(d).get("state") == "running"
            and len(read_jsonl(path)) == 2
        ),
        job_id=job,
    )
    os.kill(_driver_pid(d), signal.SIGKILL)
    out, err = waiting.communicate(timeout=300)
    assert waiting.returncode == 1, out + err
    assert f"job {job} ended: failed" in out, out + err
    s = status(d)
    assert s["state"] == "failed" and s["attempts"] == 2, s
    resume = f"python -m clusterflow.submit {d}/config.yaml"
    assert f"Slurm ends job {job} without requeueing it" in s["error"], s["error"]
    assert s["error"].endswith(resume), s["error"]
    assert s["slurm"]["state"] == "FAILED" and s["slurm"]["exit_code"] == 137, s["slurm"]
    stops = read_jsonl(os.path.join(d, "stops.jsonl"))
    assert stops[-1]["reason"] == "preempted", stops
    saved = s["global_step"]
    assert s["latest_checkpoint"].endswith(f"step-{saved}"), s

    # Records that say requeued (a job that could not ask Slurm) are reconciled with Slurm's.
    with open(os.path.join(d, "status.json")) as f:
        record = json.load(f)
    with open(os.path.join(d, "status.json"), "w") as f:
        json.dump({**record, "state": "requeued", "error": None}, f)
    s = status(d)
    assert s["state"] == "failed", s
    assert re.match(
        rf"Slurm ended job {job} without requeueing it \(FAILED: exit code 137", s["error"]
    )
    assert s["error"].endswith(resume), s["error"]

    again = run_cli(*resume.split()[2:], "--wait", env=env())
    assert again.returncode == 0, again.stdout + again.stderr
    assert status(d)["state"] == "completed"
    assert (
        f"resumed from {d}/checkpoints/step-{saved}"
        in open(os.path.join(d, "logs", "rank0.attempt2.log")).read()
    )
    ref_dir, _ = reference_run
    assert sha256(os.path.join(d, "model.pt")) == sha256(os.path.join(ref_dir, "model.pt"))


@pytest.mark.slow
def test_faults_after_progress_restart_and_a_poisoned_step_ends_failed_naming_its_samples(
    cluster, tmp_path
):
    """Rank 1 SIGKILLed at step 3 or later (the run's first fault), then sample P, which crashes
    native code (a segfault) whenever it is read in epoch 2, kills rank 1 in step 10 three times.
    Four faults with cluster.restarts_in_job=2: the second followed progress (snapshots of steps
    after the kill), so it restarts too; the third and fourth followed none, and the fourth is
    the step's third try: failed, "no progress at step 10" and rank 1's slice of that batch, as
    the epoch plan cuts it (computed here), in status."""
    plan = GlobalBatchSampler(24 * 8, 32, 1, 2, 1)
    plan.set_epoch(1)
    batch = list(plan)[3]  # step 10: epoch 2's fourth step, rank 1's slice
    d = str(tmp_path / "run")
    memory = f"/dev/shm/clusterflow-test-{os.path.basename(tmp_path)}"
    job, out = submit(
        d,
        "cluster.partition=wide",
        "cluster.spare_nodes=1",
        "cluster.restarts_in_job=2",
        "checkpoint.memory_every_steps=2",
        f"checkpoint.memory_dir={memory}/{{node}}",
        "task.target=testtasks:PoisonedSample",
        f"task.params.poison={batch[5]}",
        "task.params.step_sleep=0.3",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    try:
        wait_until("step 3", lambda: (live_status(d).get("global_step") or 0) >= 3, job_id=job)
        (first,) = read_jsonl(os.path.join(d, "attempts.jsonl"))
        os.kill(first["procs"][1][1], signal.SIGKILL)
        wait_gone(job, timeout=600)
    finally:
        subprocess.run(["rm", "-rf", memory], check=False)

    s = status(d)
    assert s["state"] == "failed" and s["attempts"] == 4, s
    said = s["error"]
    assert said.startswith("no progress at step 10: tried 3 times with no newer step committed"), (
        said
    )
    assert "(cluster.restarts_in_job=2 restarts of one step" in said, said
    assert "Segmentation fault" in said and "(crash)" in said, said
    slice_ = ", ".join(str(i) for i in batch)
    assert f"the batch it died on (epoch 2) held samples rank 1's slice: {slice_}: " in said, said
    assert said.endswith(f"python -m clusterflow.submit {d}/config.yaml"), said
    assert s["tries"]["gave_up"] and s["tries"]["indices"] == {"1": batch}, s["tries"]
    # three restarts in the job (one more than restarts_in_job), then none
    rs = s["restarts"]
    assert [r["cause"] for r in rs] == ["crash"] * 3, rs
    assert [(r["tries"], r["progress"]) for r in rs] == [(1, True), (1, True), (2, False)], rs
    assert [r.get("died_on") for r in rs][1:] == [10, 10], rs
    attempts = read_jsonl(os.path.join(d, "attempts.jsonl"))
    assert {a["job_id"] for a in attempts} == {job}, attempts  # no requeue: the same job
    log = open(os.path.join(d, "logs", "slurm", job, f"{job}_0_log.err")).read()
    assert "no progress since the last fault: try 3 of step 10 of at most 3" in log, log[-3000:]
    assert "not restarted in the job after rank 1 on " in log
    shown = run_cli("clusterflow.status", d).stdout
    assert "no progress at step 10" in shown, shown
