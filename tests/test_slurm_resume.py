"""Preemption proofs on the real local Slurm cluster: every interrupted run must end with a
model.pt bitwise equal to the uninterrupted reference run of the same config and topology.

(a) `scontrol requeue` in mid-epoch, then the time-limit signal (SIGUSR2), which makes rank 0
    requeue the job itself, with a DataLoader worker a rank (Slurm signals it too); (b) real
    preemption by an --exclusive job in the high partition;
(c) SIGKILL of the whole job in the middle of a checkpoint write, synchronous (after a mining
    round) and in the background while both nodes train on; (d) damaged newest checkpoints
    skipped on resume.
"""

import glob
import json
import os
import re
import shutil

import pytest
from slurmjobs import live_status, rank0_logs, scmd, sha256, status, submit, wait_gone, wait_until
from test_on_event import fired, notify_script

from clusterflow.storage.store import CheckpointStore
from clusterflow.storage.tensors import TORCH

pytestmark = pytest.mark.slurm

SLOW = (
    "task.target=testtasks:Slow",
    "task.params.step_sleep=0.4",
)  # 6 steps per epoch, 3 epochs, 18 in all
HANG = (
    "task.target=testtasks:HangInSave",
    "task.params.step_sleep=0",
    "task.params.hang_at_step=12",
)
# Step 8 is an every_steps save, written in the background (step 12 follows a mining round:
# synchronous).
HANG_BACKGROUND = (
    "task.target=testtasks:HangInSave",
    "task.params.step_sleep=0.2",
    "task.params.hang_at_step=8",
)


def at_step(run_dir, step, attempt=0):
    s = live_status(run_dir)
    return (
        s.get("attempt") == attempt
        and s.get("global_step", 0) >= step
        and s.get("state") == "running"
    )


def assert_same_weights(run_dir, reference_run):
    ref_dir, _ = reference_run
    assert sha256(os.path.join(run_dir, "model.pt")) == sha256(os.path.join(ref_dir, "model.pt"))


def stop_and_resume_steps(run_dir):
    """The step saved at each stop and the step each later attempt resumed from: they must match.
    A stop that lands on an epoch's last step, or in the mining round after it (a signal late on
    a loaded machine), is saved by the epoch's end, which says so in its own words."""
    logs = rank0_logs(run_dir)
    mid = r"saving at global step (\d+)"
    epoch_end = r"the end of epoch \d+"
    mining = r"in the mining round after epoch \d+, which the next attempt continues"
    end = rf"saved at global step (\d+) \((?:{epoch_end}|{mining})\)"
    saved = [int(a or b) for a, b in re.findall(rf"(?:{mid}|{end}) and stopping", logs)]
    resumed = [int(s) for s in re.findall(r"resumed from \S+/step-(\d+):", logs)]
    return saved, resumed


def test_scontrol_requeue_then_time_limit_signal(cluster, reference_run, tmp_path):
    """Also: observe.on_event runs its command on a compute node for each requeue and for the
    end (the weights stay the reference's)."""
    d = str(tmp_path / "run")
    command, told = notify_script(str(tmp_path))
    job, _ = submit(d, *SLOW, "data.num_workers=1", f"observe.on_event={command}")
    wait_until("mid-epoch 1", lambda: at_step(d, 3), job_id=job)
    # Slurm sends SIGTERM to every process of the job (the workers too), then requeues it.
    scmd("scontrol", "requeue", job)
    wait_until("the requeued attempt in mid-epoch 2", lambda: at_step(d, 9, attempt=1), job_id=job)
    # What Slurm sends ahead of the time limit (--signal=USR2@...): rank 0 requeues the job itself.
    scmd("scancel", "--signal=USR2", job)
    wait_gone(job)
    s = status(d)
    assert s["state"] == "completed" and s["attempts"] == 3, s
    reasons = [json.loads(line)["reason"] for line in open(os.path.join(d, "stops.jsonl"))]
    assert reasons == ["preempted", "timeout"]
    assert f"requeued job {job} after the time-limit signal" in rank0_logs(d)
    saved, resumed = stop_and_resume_steps(d)
    assert len(saved) == 2 and saved == resumed, (saved, resumed)  # no step lost, none repeated
    assert_same_weights(d, reference_run)
    assert [line[:3] for line in fired(told)] == [
        ("requeued", "0", d),
        ("requeued", "1", d),
        ("completed", "2", d),
    ]


def test_preemption_by_exclusive_high_priority_job(cluster, reference_run, tmp_path):
    d = str(tmp_path / "run")
    job, _ = submit(d, *SLOW)
    wait_until("mid-epoch 2", lambda: at_step(d, 8), job_id=job)
    high = scmd(
        "sbatch",
        "--parsable",
        "-p",
        "high",
        "--exclusive",
        "-N",
        "2",
        "-t",
        "2",
        f"--output={tmp_path}/high-%j.out",
        "--wrap",
        "hostname; sleep 2",
    )
    wait_gone(high)
    wait_gone(job)
    assert os.path.exists(tmp_path / f"high-{high}.out")  # the preemptor really ran
    s = status(d)
    assert s["state"] == "completed" and s["attempts"] == 2, s
    saved, resumed = stop_and_resume_steps(d)
    assert len(saved) == 1 and saved == resumed, (saved, resumed)
    assert_same_weights(d, reference_run)


def half_written(ckpts, step):
    return glob.glob(os.path.join(ckpts, f".tmp-step-{step}-*", "model.pt"))


def committed_files(ckpts):
    """Each file of the committed checkpoints, with its digest."""
    return {p: sha256(p) for p in glob.glob(os.path.join(ckpts, "step-*", "*"))}


@pytest.fixture(scope="module")
def killed_jobs(cluster, tmp_path_factory):
    """Two jobs at once (one core of each node each), each SIGKILLed whole in the middle of a
    checkpoint write: the synchronous one of step 12 (after a mining round), and the background
    one of step 8 while both nodes train on past step 10. For each, its run dir and the files of
    its committed checkpoints, with their digests taken before the kill."""
    root = tmp_path_factory.mktemp("killed-while-writing")
    sync, background = str(root / "step-12"), str(root / "step-8-background")
    jobs = {sync: submit(sync, *HANG)[0], background: submit(background, *HANG_BACKGROUND)[0]}
    ckpts = {d: os.path.join(d, "checkpoints") for d in jobs}
    partial = wait_until(
        "a half-written step 12", lambda: half_written(ckpts[sync], 12), job_id=jobs[sync]
    )
    committed = {sync: committed_files(ckpts[sync])}
    scmd("scancel", "--signal=KILL", "--full", jobs[sync])
    wait_until(
        "a half-written step 8",
        lambda: half_written(ckpts[background], 8),
        job_id=jobs[background],
    )
    wait_until(
        "both nodes training past step 8 while it is written",
        lambda: at_step(background, 10),
        job_id=jobs[background],
    )
    committed[background] = committed_files(ckpts[background])
    scmd("scancel", "--signal=KILL", "--full", jobs[background])
    for job in jobs.values():
        wait_gone(job)
    assert status(sync)["state"] == "failed"  # left the queue without an outcome
    assert os.path.exists(partial[0])
    return {"sync": (sync, committed[sync]), "background": (background, committed[background])}


@pytest.fixture
def killed_while_writing_step_12(killed_jobs):
    """The run dir killed in the middle of writing step 12, and its committed files. Each test
    resumes a copy of it (a run dir may be copied and resumed from its new place): one kill
    serves them all."""
    return killed_jobs["sync"]


def copy_of(killed, run_dir):
    """A copy of the killed run dir at ``run_dir``; returns its checkpoints folder."""
    shutil.copytree(killed, run_dir, symlinks=True)
    return os.path.join(run_dir, "checkpoints")


def test_sigkill_during_checkpoint_write_keeps_the_previous_one(
    killed_while_writing_step_12, reference_run, tmp_path
):
    killed, committed = killed_while_writing_step_12
    assert {p: sha256(p) for p in committed} == committed  # untouched by the kill
    d = str(tmp_path / "run")
    ckpts = copy_of(killed, d)
    store = CheckpointStore(ckpts, keep_last=3, codec=TORCH)
    assert store.steps() == [4, 6, 8]
    assert store.latest().step == 8
    _, out = submit(d, *HANG, wait=True)  # the next attempt: the same command again
    assert out.returncode == 0, out.stdout + out.stderr
    s = status(d)
    assert s["state"] == "completed" and s["attempts"] == 2, s
    logs = rank0_logs(d)
    assert "removed unfinished checkpoint folders left by a killed writer: .tmp-step-12-" in logs
    assert re.search(r"resumed from \S+/step-8: epoch 2, step 2 of the epoch", logs)
    assert_same_weights(d, reference_run)


def test_sigkill_during_a_background_write_resumes_from_the_previous_commit(
    killed_jobs, reference_run, tmp_path
):
    killed, committed = killed_jobs["background"]
    d = str(tmp_path / "run")
    ckpts = copy_of(killed, d)
    assert CheckpointStore(ckpts, keep_last=3, codec=TORCH).steps() == [4, 6]
    assert {p: sha256(p) for p in committed} == committed  # untouched by the kill
    _, out = submit(d, *HANG_BACKGROUND, wait=True)
    assert out.returncode == 0, out.stdout + out.stderr
    logs = rank0_logs(d)
    assert "removed unfinished checkpoint folders left by a killed writer: .tmp-step-8-" in logs
    assert re.search(r"resumed from \S+/step-6: epoch 2, step 0 of the epoch", logs)
    assert_same_weights(d, reference_run)


def test_damaged_newest_checkpoints_are_skipped_on_resume(
    killed_while_writing_step_12, reference_run, tmp_path
):
    d = str(tmp_path / "run")
    ckpts = copy_of(killed_while_writing_step_12[0], d)
    model8 = os.path.join(ckpts, "step-8", "model.pt")
    data = bytearray(open(model8, "rb").read())
    data[len(data) // 2] ^= 0x10  # one flipped bit
    open(model8, "wb").write(bytes(data))
    state6 = os.path.join(ckpts, "step-6", "train_state.pt")
    os.truncate(state6, os.path.getsize(state6) // 2)  # a torn write
    _, out = submit(d, *HANG, wait=True)
    assert out.returncode == 0, out.stdout + out.stderr
    logs = rank0_logs(d)
    assert re.search(
        r"skipping damaged checkpoint \S+/step-8: model.pt does not match its blake3 digest", logs
    )
    assert re.search(r"skipping damaged checkpoint \S+/step-6: train_state.pt has \d+ bytes", logs)
    assert re.search(r"resumed from \S+/step-4:", logs)
    # The damaged steps are kept aside for inspection when the run commits those steps anew.
    assert len(glob.glob(os.path.join(ckpts, "damaged-step-8-*"))) == 1
    assert len(glob.glob(os.path.join(ckpts, "damaged-step-6-*"))) == 1
    s = status(d)
    assert s["state"] == "completed"
    assert sorted(os.path.basename(p)[:14] for p in s["damaged_checkpoints"]) == [
        "damaged-step-6",
        "damaged-step-8",
    ]
    assert_same_weights(d, reference_run)
