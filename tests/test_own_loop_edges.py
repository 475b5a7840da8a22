"""The own loop at its edges, on real processes: a stop (SIGTERM, SIGINT, ``clusterflow
cancel``) at an epoch's last step or inside ``run.mine`` of a script with its own work after the
loop (tests/ownloop/epoch_end.py: a validation into a history, a random draw, a per-epoch StepLR,
a counter) resumes bitwise equal to the uninterrupted run, the script's own states included, on
one and two ranks; SIGTERM to every process of the job, DataLoader workers included (as Slurm
sends it), saves and stops, and the run completes when started again. A script started by hand
that returns without run.finish() keeps its last checkpoint, one that swallows the stop gets one
line, one kept alive after run.finish() ends on SIGTERM, its prints are in its log, its failure
names the line that raised; its goodput record follows every step, its data its own phase."""

import glob
import json
import os
import runpy
import signal
import subprocess
import sys
import time

import launch
import pytest
import torch
from conftest import REPO, run_cli, weights_equal

from clusterflow import rundir
from clusterflow.config import load
from clusterflow.job import failure
from clusterflow.observe.context import JobContext
from clusterflow.observe.timeline import AttemptTimeline, Startup, process_started_at
from clusterflow.rundir import cancel_marker, timeline
from clusterflow.storage.store import CheckpointStore
from clusterflow.train.preemption import Preemption
from clusterflow.train.session import Run

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
        assert f"/step-{step}: epoch {step // 3}, step 3 of the epoch" in log
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
    # torchrun outside Slurm: nothing requeues it, the same command resumes it.
    assert json.load(open(os.path.join(d, "status.json")))["state"] == "stopped"
    assert launch.wait(start(2, d, args=("--workers", "2"))) == [0, 0], rank0_log(d)[-3000:]
    assert_same_run(d, uninterrupted[2])


# -- a script's end, its output, its failure, its record ------------------------------------------

BY_HAND = """
import os, signal, sys, threading
import torch
import clusterflow

run = clusterflow.start(**{"run.dir": sys.argv[1], "mining.enabled": False})
print("hello from the script")
model = run.setup(torch.nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = run.loader(torch.utils.data.TensorDataset(torch.randn(64, 64)), batch_size=16)
run.restore(model=model, optimizer=opt)
try:
    for epoch in run.epochs(2):
        for (x,) in loader:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            if sys.argv[2] == "swallow":
                os.kill(os.getpid(), signal.SIGTERM)
            run.step()
except BaseException:  # swallows RunStopped too
    if sys.argv[2] != "swallow":
        raise
    for (x,) in loader:
        pass
if sys.argv[2] == "linger":
    run.finish()
    threading.Thread(target=threading.Event().wait).start()  # keeps the process alive
    open(sys.argv[1] + "-finished", "w").close()
"""


def by_hand(tmp_path, mode):
    """``python script.py RUN_DIR MODE``, as a user starts it (its own session)."""
    script = tmp_path / "by_hand.py"
    script.write_text(BY_HAND)
    d = str(tmp_path / mode)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    proc = subprocess.Popen(
        [sys.executable, str(script), d, mode],
        cwd=str(tmp_path),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return proc, d


def test_a_script_that_returns_without_finish_keeps_its_last_epochs_checkpoint(tmp_path):
    """The last epoch's checkpoint is written in the background as the script returns; the
    interpreter's shutdown must not cut it off (running the script again would train the epoch
    again)."""
    proc, d = by_hand(tmp_path, "return")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, out + err
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith("error: script by_hand.py ended without calling run.finish()")
    ), err
    assert "Traceback" not in err and "cannot schedule" not in out + err, out + err
    assert CheckpointStore(os.path.join(d, "checkpoints")).steps()[-1] == 8


def test_a_call_after_a_swallowed_stop_is_one_line(tmp_path):
    proc, d = by_hand(tmp_path, "swallow")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, out + err
    assert "Traceback" not in err, err
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            "error: iterating run.loader came after the run stopped (preempted): the stop raised "
            "clusterflow.RunStopped"
        )
    ), err
    # python script.py outside Slurm: nothing requeues it, the same command resumes it.
    assert json.load(open(os.path.join(d, "status.json")))["state"] == "stopped"


def test_a_finished_script_kept_alive_by_a_thread_ends_on_sigterm_and_its_prints_are_logged(
    tmp_path,
):
    proc, d = by_hand(tmp_path, "linger")
    try:
        launch.wait_for_file(d + "-finished", [proc])
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGTERM
    logs = run_cli("clusterflow.logs", d)
    assert "hello from the script" in logs.stdout, logs.stdout


def test_a_scripts_failure_names_the_line_that_raised(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(
        "def inner():\n    raise ValueError('boom')\n\n\ndef main():\n    inner()\n\n\nmain()\n"
    )
    with pytest.raises(ValueError) as e:
        runpy.run_path(str(script), run_name="__main__")
    said = failure.describe(e.value, "", script=str(script))
    assert said.message == f"script 'fails.py' failed in inner ({script}:2): ValueError: boom"


def test_the_goodput_record_follows_every_step_and_a_scripts_data_is_its_own_phase(
    tmp_path, monkeypatch
):
    """The timeline's last step is at most a second behind (here: none), whatever
    train.log_every_steps; a script's data preparation is start-up phase "task data", not
    "model"."""
    monkeypatch.setattr(AttemptTimeline, "WRITE_EVERY_S", 0.0)
    cfg = load(
        None,
        [f"run.dir={tmp_path / 'run'}", "script.path=train.py", "train.log_every_steps=100"],
    )
    os.makedirs(cfg.run.dir)
    paths = rundir.RunPaths(cfg.run.dir)
    startup = Startup(process_started_at())
    run = Run(
        JobContext(cfg, paths),
        torch.device("cpu"),
        Preemption(),
        lambda outcome: (outcome, 0),
        startup=startup,
    )
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = run.setup(model, opt)
    time.sleep(0.3)  # the script builds its data
    loader = run.loader(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=8)
    run.restore(model=model, optimizer=opt)
    assert startup.seconds["task data"] >= 0.3, startup.seconds
    for _ in run.epochs(1):
        for i, (x,) in enumerate(loader):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            run.step()
            if i == 2:
                break
        break
    assert timeline.read_all(paths).records[0]["last_step"] == 3
