"""run.loader over a stream (an IterableDataset; tests/ownloop/stream.py on 2 real ranks): each
rank's position saved per rank and resumed bitwise after SIGKILL in mid-pass, every item trained
once per pass as the script recorded it; a resume on another world size refused in one line; a
stream without a state of its own taken with one warning, and a script started by hand whose
loop leaves its DataLoader worker in mid-pass ends; epochs over a stream refused."""

import json
import os
import signal
import subprocess
import sys

import launch
import pytest
import torch
from conftest import REPO, run_cli, weights_equal
from test_own_loop import a_run, rank0_log, records, refused, set_up, wait_for

from clusterflow.storage.store import CheckpointStore

SCRIPT = os.path.join(REPO, "tests", "ownloop", "stream.py")
# 200 items, 100 a rank; 5 a rank and micro-batch, 2 micro-batches a step: a pass is 10 steps,
# 14 steps end in the second. Saves every 3 steps.
CONFIG = ("checkpoint.every_steps=3", "train.log_every_steps=2", "dist.heartbeat_s=1")


def start(run_dir, world=2, env=None, args=()):
    seen = run_dir + "-seen"
    os.makedirs(seen, exist_ok=True)
    command = [sys.executable, "-m", "clusterflow.run", "--script", SCRIPT, f"run.dir={run_dir}"]
    command += [*CONFIG, "--", *args]
    env = {"SEEN_DIR": seen, **(env or {})}
    return launch.start(world, None, None, run_dir + "-logs", command=command, env=env)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("stream") / "run")
    assert launch.wait(start(d)) == [0, 0], rank0_log(d)[-3000:]
    return d


def test_a_stream_trains_each_item_once_a_pass(uninterrupted):
    seen = records(uninterrupted)
    assert [r["step"] for r in seen[0]] == list(range(1, 15))
    first_pass = [i for rs in seen.values() for r in rs if r["step"] <= 10 for i in r["index"]]
    assert sorted(first_pass) == list(range(200))
    status = json.loads(run_cli("clusterflow.status", uninterrupted, "--json").stdout)
    assert status["state"] == "completed" and status["global_step"] == 14, status
    ledger = json.load(open(os.path.join(uninterrupted, "sample_ledger.json")))
    assert [(r["start"], r["end"]) for e in ledger["epochs"] for r in e["ranges"]] == [(0, 280)]


def test_a_stream_resumes_bitwise_after_sigkill_and_refuses_another_world_size(
    uninterrupted, tmp_path
):
    d = str(tmp_path / "run")
    procs = start(d, env={"HOLD_AT_STEP": "8"})
    wait_for(os.path.join(d + "-seen", "held"), procs)
    launch.kill(procs)
    assert launch.wait(procs) == [-signal.SIGKILL] * 2
    committed = CheckpointStore(os.path.join(d, "checkpoints")).steps()
    assert committed and max(committed) < 8, committed  # 6, or 3 with 6's write still in flight
    # On 3 ranks: each rank's position is another rank's stream.
    assert launch.wait(start(d, world=3)) == [2, 2, 2]
    # The step it refused: the newest, which may be a write killed before its rename, published
    # by this attempt.
    resumed = CheckpointStore(os.path.join(d, "checkpoints")).steps()[-1]
    assert max(committed) <= resumed < 8, (committed, resumed)
    line = [x for x in rank0_log(d).splitlines() if "holds each rank's position" in x]
    assert (
        line
        and (
            f"run.loader(StatefulItems): the checkpoint of step {resumed} holds each rank's "
            "position in its stream for 2 ranks, and this attempt runs 3"
        )
        in line[-1]
    ), rank0_log(d)[-2000:]
    assert launch.wait(start(d)) == [0, 0], rank0_log(d)[-3000:]
    assert weights_equal(os.path.join(d, "model.pt"), os.path.join(uninterrupted, "model.pt"))
    mine, plain = records(d), records(uninterrupted)
    for rank in (0, 1):
        first = mine[rank][0]["pid"]
        kept = [r for r in mine[rank] if r["pid"] != first or r["step"] <= resumed]
        assert [(r["step"], r["index"]) for r in kept] == [
            (r["step"], r["index"]) for r in plain[rank]
        ]


def test_a_stream_without_a_state_is_taken_with_one_warning_and_its_workers_end(tmp_path):
    """The script started by hand (``python stream.py``, as torchrun or srun start it), its
    stream read by a DataLoader worker, its 3 steps ending in mid-pass: the process ends once
    the run completed. Its workers outlive the stop signals (distributed/workers.py), so the
    exit's SIGTERM to them would leave it waiting for them forever: run.finish() stops them."""
    os.makedirs(tmp_path / "seen")
    out = subprocess.run(
        [sys.executable, SCRIPT, "--stateless", "--max-steps", "3", "--workers", "1"],
        check=False,
        cwd=tmp_path,
        env={**os.environ, "SEEN_DIR": str(tmp_path / "seen")},
        capture_output=True,
        text=True,
        timeout=300,  # a run of seconds: a process left waiting for its workers never ends
    )
    d = str(tmp_path / "runs" / "stream")  # run.dir by hand: runs/<script name>
    assert out.returncode == 0, out.stderr[-3000:]
    assert "run completed" in rank0_log(d)
    warned = [x for x in rank0_log(d).splitlines() if "the stream has no state_dict()" in x]
    assert len(warned) == 1 and "run.loader(Items)" in warned[0], warned
    assert "exact only if it yields the same items in the same order every time" in warned[0]


def test_epochs_over_a_stream_are_refused(tmp_path):
    run = a_run(tmp_path, "stream")
    model, opt, _ = set_up(run)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from torch.zeros(8, 4)

    run.loader(Stream(), batch_size=2)
    run.restore(model=model, optimizer=opt)
    message = refused(lambda: next(iter(run.epochs(1))))
    assert message.startswith("run.epochs(n) over a stream (run.loader of a Stream"), message
    assert "run.steps(loader, max_steps)" in message
