"""Preemption proofs on the real local Slurm cluster: every interrupted run must end with a
model.pt bitwise equal to the uninterrupted reference run of the same config and topology.

(a) in one job: real preemption by an --exclusive job in the high partition, `scontrol requeue`
    in mid-epoch, then the time-limit signal (SIGUSR2), which makes rank 0 requeue the job itself,
    with a DataLoader worker a rank (Slurm signals it too);
(b) SIGKILL of the whole job (scancel --full) in the middle of a synchronous checkpoint write
    (after a mining round).

Proven locally, not again here: a kill during a background write
(tests/test_async_resume.py::test_kill_during_a_background_write_resumes_from_the_previous_commit,
the same task and assertions), and damaged newest checkpoints skipped on resume
(tests/test_manifest_lies.py: each damage in-process, and
test_a_run_resumes_past_lying_checkpoints_bitwise end to end).
"""

import glob
import json
import os
import re
import shutil

import pytest
from slurmjobs import (
    at_step,
    rank0_logs,
    scmd,
    sha256,
    status,
    submit,
    wait_gone,
    wait_until,
)
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


def slowed(run_dir, attempts):
    """SLOW's sleep in the first ``attempts`` attempts only, those the test signals in
    mid-epoch; the attempt after them trains the rest at full speed."""
    return (f"task.params.run_dir={run_dir}", f"task.params.slow_attempts={attempts}")


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


def test_preemption_then_scontrol_requeue_then_time_limit_signal(cluster, reference_run, tmp_path):
    """One job stopped three ways, each in mid-epoch, each attempt resuming at the step the one
    before saved: preempted by an --exclusive job in the high partition, requeued by `scontrol
    requeue` (Slurm sends SIGTERM to every process of the job, its DataLoader workers too), then
    sent the time-limit signal, on which rank 0 requeues the job itself. Also: observe.on_event
    runs its command on a compute node for each requeue and for the end (the weights stay the
    reference's)."""
    d = str(tmp_path / "run")
    command, told = notify_script(str(tmp_path))
    job, _ = submit(
        d,
        *SLOW,
        "task.params.step_sleep=0.6",  # the signal of the third attempt lands 5 steps from the end
        *slowed(d, 3),
        "data.num_workers=1",
        f"observe.on_event={command}",
    )
    wait_until("mid-epoch 1", lambda: at_step(d, 3), job_id=job)
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
    wait_until("the preempted attempt in mid-epoch 2", lambda: at_step(d, 8, 1), job_id=job)
    assert os.path.exists(tmp_path / f"high-{high}.out")  # the preemptor really ran
    scmd("scontrol", "requeue", job)
    wait_until("the requeued attempt in epoch 3", lambda: at_step(d, 13, 2), job_id=job)
    # What Slurm sends ahead of the time limit (--signal=USR2@...): rank 0 requeues the job itself.
    scmd("scancel", "--signal=USR2", job)
    wait_gone(job)
    s = status(d)
    assert s["state"] == "completed" and s["attempts"] == 4, s
    reasons = [json.loads(line)["reason"] for line in open(os.path.join(d, "stops.jsonl"))]
    assert reasons == ["preempted", "preempted", "timeout"]
    assert f"requeued job {job} after the time-limit signal" in rank0_logs(d)
    saved, resumed = stop_and_resume_steps(d)
    assert len(saved) == 3 and saved == resumed, (saved, resumed)  # no step lost, none repeated
    assert_same_weights(d, reference_run)
    assert [line[:3] for line in fired(told)] == [
        ("requeued", "0", d),
        ("requeued", "1", d),
        ("requeued", "2", d),
        ("completed", "3", d),
    ]


def half_written(ckpts, step):
    return glob.glob(os.path.join(ckpts, f".tmp-step-{step}-*", "model.pt"))


def committed_files(ckpts):
    """Each file of the committed checkpoints, with its digest."""
    return {p: sha256(p) for p in glob.glob(os.path.join(ckpts, "step-*", "*"))}


@pytest.fixture(scope="module")
def killed_while_writing_step_12(cluster, tmp_path_factory):
    """A job SIGKILLed whole in the middle of its synchronous checkpoint write of step 12 (after a
    mining round): its run dir, and the files of its committed checkpoints with their digests
    taken before the kill."""
    d = str(tmp_path_factory.mktemp("killed-while-writing") / "step-12")
    job = submit(d, *HANG)[0]
    ckpts = os.path.join(d, "checkpoints")
    partial = wait_until("a half-written step 12", lambda: half_written(ckpts, 12), job_id=job)
    committed = committed_files(ckpts)
    scmd("scancel", "--signal=KILL", "--full", job)
    wait_gone(job)
    assert status(d)["state"] == "failed"  # left the queue without an outcome
    assert os.path.exists(partial[0])
    return d, committed


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
