"""The own loop at its edges, on real processes: a stop (SIGTERM, SIGINT, ``clusterflow
cancel``) at an epoch's last step or inside ``run.mine`` of a script with its own work after the
loop (tests/ownloop/epoch_end.py: a validation into a history, a random draw, a per-epoch StepLR,
a counter) resumes bitwise equal to the uninterrupted run, the script's own states included, on
one and two ranks; SIGTERM to every process of the job, DataLoader workers included (as Slurm
sends it), saves and stops, and the run completes when started again."""

import glob
import os
import signal
import sys

import launch
import pytest
import torch
from conftest import REPO, weights_equal

from clusterflow import rundir
from clusterflow.rundir import cancel_marker
from clusterflow.storage.store import CheckpointStore

SCRIPT = os.path.join(REPO, "tests", "ownloop", "epoch_end.py")
# 96 samples, 32 a step: 3 steps an epoch, 5 epochs, the last of which never mines; one epoch
# without run.mine (0-based): epoch 2 on two ranks, epoch 0 on one. Saves every 2 steps (in the
# background).
CONFIG = ("checkpoint.every_steps=2", "train.log_every_steps=1", "dist.heartbeat_s=1")
SKIP = {1: ("--skip-mine", "0"), 2: ("--skip-mine", "2")}
EXIT = {"TERM": 0, "INT": 130, "CANCEL": 0}


def start(world, run_dir, env=None, args=()):
    command = [
        sys.executable,
        "-m",
        "clusterflow.run",
        "--script",
        SCRIPT,
        f"run.dir={run_dir}",
        *CONFIG,
        "--",
        *SKIP[world],
        *args,
    ]
    return launch.start(world, None, None, run_dir + "-logs", command=command, env=env)


def rank0_log(run_dir, attempt=None):
    pattern = f"rank0.attempt{'*' if attempt is None else attempt}.log"
    files = sorted(glob.glob(os.path.join(run_dir, "logs", pattern)))
    return "".join(open(p).read() for p in files)


def final_state(run_dir):
    store = CheckpointStore(os.path.join(run_dir, "checkpoints"))
    path = os.path.join(store.step_path(max(store.steps())), "train_state.pt")
    return torch.load(path, weights_only=True)


def assert_same_run(run_dir, reference):
    assert weights_equal(os.path.join(run_dir, "model.pt"), os.path.join(reference, "model.pt"))
    mine, ref = final_state(run_dir), final_state(reference)
    # The script's own states: what its code after the loop did, once per epoch.
    assert mine["history"] == ref["history"], (mine["history"], ref["history"])
    assert len(ref["history"]["val"]) == 5 and ref["history"]["epochs_seen"] == 5
    assert mine["scheduler"] == ref["scheduler"]
    momentum = [s["momentum_buffer"] for s in mine["optimizer"]["state"].values()]
    reference = [s["momentum_buffer"] for s in ref["optimizer"]["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(momentum, reference, strict=True))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    runs = {}
    for world in (1, 2):
        d = str(tmp_path_factory.mktemp("epoch-end") / f"run{world}")
        assert launch.wait(start(world, d)) == [0] * world, rank0_log(d)[-3000:]
        runs[world] = d
    return runs


def stopped_and_resumed(world, run_dir, stops):
    """Each of ``stops`` (STOP_AT values) ends one attempt; the last attempt completes."""
    for attempt, stop in enumerate(stops):
        how = stop.rsplit(":", 1)[1]
        codes = launch.wait(start(world, run_dir, env={"STOP_AT": stop}))
        assert codes == [EXIT[how]] * world, (stop, codes, rank0_log(run_dir)[-3000:])
        assert "stopping" in rank0_log(run_dir, attempt), stop
        if how == "CANCEL":  # as submitting the run again does
            cancel_marker.clear(rundir.RunPaths(run_dir))
    assert launch.wait(start(world, run_dir)) == [0] * world, rank0_log(run_dir)[-3000:]


@pytest.mark.slow
def test_stops_at_an_epochs_last_step_or_in_its_round_resume_bitwise_on_two_ranks(
    uninterrupted, tmp_path
):
    d = str(tmp_path / "run")
    # Epoch 1: the last step's signal is taken in the round (the loop's end was saved at that
    # step); epoch 2 mines no round: the stop comes at the epoch's end; epoch 3: in the round.
    stopped_and_resumed(2, d, ["last-step:1:TERM", "last-step:2:CANCEL", "mine:3:INT"])
    assert_same_run(d, uninterrupted[2])
    log = rank0_log(d)
    for step in (6, 12):  # each round stop resumed at its epoch's last step, the loop's end
        assert f"saved at global step {step} (in the mining round after epoch" in log
        assert f"/step-{step}: epoch {step // 3 - 1}, step 3 of the epoch" in log
    assert "saved at global step 9 (the end of epoch 3)" in log


@pytest.mark.slow
def test_stops_at_an_epochs_last_step_or_in_its_round_resume_bitwise_on_one_rank(
    uninterrupted, tmp_path
):
    d = str(tmp_path / "run")
    # Epoch 0 ends without run.mine though a round was due, so epoch 1's loop end is not kept:
    # its round's stop saves nothing new, and the steps after step 4 are trained again; the next
    # attempt keeps it (nothing is known of the script then): a signal at its last step is taken
    # in the round; then a stop in the round of an attempt that resumed there (its embeddings read
    # back from the round's files).
    stopped_and_resumed(1, d, ["mine:1:CANCEL", "last-step:1:INT", "after-loop:1:TERM"])
    assert_same_run(d, uninterrupted[1])
    log = rank0_log(d)
    assert "nothing new is saved; the next attempt resumes from step 4 and trains the 2" in log
    assert log.count("saved at global step 6 (in the mining round after epoch 2") == 2


def test_sigterm_to_every_process_with_dataloader_workers_stops_and_resumes(
    uninterrupted, tmp_path
):
    """As Slurm signals a job: every process of each rank's group, its DataLoader workers too."""
    d = str(tmp_path / "run")
    held = tmp_path / "hold"
    held.mkdir()
    env = {"HOLD_AT_STEP": "4", "HOLD_DIR": str(held)}
    procs = start(2, d, env=env, args=("--workers", "2"))
    launch.wait_for_file(str(held / "held"), procs)
    workers = launch.children(procs)
    assert len(workers) >= 4, workers  # two a rank, alive
    launch.kill(procs, signal.SIGTERM)
    (held / "release").touch()
    assert launch.wait(procs) == [0, 0], rank0_log(d)[-3000:]
    assert "SIGTERM received: sav" in rank0_log(d, 0)
    assert launch.wait(start(2, d, args=("--workers", "2"))) == [0, 0], rank0_log(d)[-3000:]
    assert_same_run(d, uninterrupted[2])
