"""Background saves on real processes: a kill while a background write is in flight, and a disk that
fills up, each lose no committed step, and the run ends bitwise equal to an uninterrupted one."""

import glob
import hashlib
import json
import os
import re
import subprocess
import time

import launch
import pytest
import torch
from conftest import REPO, tmpfs

from clusterflow.storage.store import CheckpointStore
from clusterflow.storage.tensors import TORCH

HANG = [
    "task.target=testtasks:HangInSave",
    "task.params.step_sleep=0.2",
    "task.params.hang_at_step=8",
]


def weights(run_dir):
    return torch.load(os.path.join(run_dir, "model.pt"), weights_only=True)


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def live_status(run_dir):
    try:
        return json.load(open(os.path.join(run_dir, "status.json")))
    except (OSError, ValueError):
        return {}


def rank0_log(run_dir):
    return "".join(
        open(p).read()
        for p in sorted(glob.glob(os.path.join(run_dir, "logs", "rank0.attempt*.log")))
    )


def digests(folder):
    return {
        p: hashlib.sha256(open(p, "rb").read()).hexdigest()
        for p in sorted(glob.glob(os.path.join(folder, "step-*", "*")))
    }


def wait_for(what, predicate, timeout=240):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def reference(tiny_two_rank_run):
    return tiny_two_rank_run


def test_kill_during_a_background_write_resumes_from_the_previous_commit(
    reference, tmp_path, monkeypatch
):
    """Rank 0's background write of step 8 hangs half-way while both ranks train on; every process
    is SIGKILLed then. The next attempt removes the partial folder, resumes from step 6 and ends
    bitwise equal to the uninterrupted run."""
    monkeypatch.setenv("PYTHONPATH", os.path.join(REPO, "tests"))
    d = str(tmp_path / "run")
    ckpts = os.path.join(d, "checkpoints")
    over = [f"run.dir={d}", *HANG]
    procs = launch.start(2, "configs/tiny.yaml", over, d)
    try:
        wait_for(
            "a half-written step 8",
            lambda: glob.glob(os.path.join(ckpts, ".tmp-step-8-*", "model.pt")),
        )
        wait_for(
            "training past step 8 while it is written",
            lambda: live_status(d).get("global_step", 0) >= 10,
        )
        committed = digests(ckpts)
        assert sorted({os.path.basename(os.path.dirname(p)) for p in committed}) == [
            "step-4",
            "step-6",
        ]
    finally:
        launch.kill(procs)
        launch.wait(procs)
    assert digests(ckpts) == committed  # the kill touched no committed step
    assert launch.run(2, "configs/tiny.yaml", over, d) == [0, 0]
    logs = rank0_log(d)
    assert "removed unfinished checkpoint folders left by a killed writer: .tmp-step-8-" in logs
    assert re.search(r"resumed from \S+/step-6: epoch 2, step 0 of the epoch", logs)
    assert same_weights(weights(d), weights(reference))


HIDDEN = [
    "cluster.tasks_per_node=1",
    "task.params.hidden=700",
]  # a 5.7 MiB checkpoint: two fit in 16 MiB, three do not


def test_a_full_disk_is_reported_and_loses_no_committed_step(tmp_path, monkeypatch, cli):
    fs = tmp_path / "small"
    with tmpfs(fs, "size=16m"):
        d = str(tmp_path / "run")
        over = [f"run.dir={d}", f"checkpoint.dir={fs}/ck", *HIDDEN]
        assert launch.run(1, "configs/tiny.yaml", over, d) != [0]
        logs = rank0_log(d)
        # Step 8 is written in the background and fails: reported at once, the run goes on ...
        assert re.search(
            rf"no space left on tmpfs \(mounted at {fs}\) writing checkpoint step 8 to "
            rf"{fs}/ck/step-8 \(it needs about .*; the committed steps are untouched",
            logs,
        ), logs
        # ... and the next save (step 12) is its synchronous retry, which fails the job.
        out = cli("clusterflow.status", d, "--json")
        s = json.loads(out.stdout)
        assert s["state"] == "failed", s
        assert (
            "no space left on tmpfs" in s["error"] and "writing checkpoint step 12" in s["error"]
        ), s
        assert "writing checkpoint step 12" in s["checkpoint_error"]
        assert "last write FAILED: no space left on tmpfs" in cli("clusterflow.status", d).stdout
        assert [os.path.basename(p) for p in s["checkpoints"]] == ["step-4", "step-6"]
        assert sorted(os.listdir(fs / "ck")) == [
            "step-4",
            "step-6",
        ]  # the failed writes gave their space back
        assert (
            CheckpointStore(str(fs / "ck"), codec=TORCH).latest().step == 6
        )  # its files match their digests
        subprocess.run(["mount", "-o", "remount,size=64m", str(fs)], check=True)  # space is freed
        assert launch.run(1, "configs/tiny.yaml", over, d) == [0]
        assert re.search(r"resumed from \S+/step-6: epoch 2, step 0 of the epoch", rank0_log(d))
    plain = str(tmp_path / "plain")
    assert launch.run(1, "configs/tiny.yaml", [f"run.dir={plain}", *HIDDEN], plain) == [0]
    assert same_weights(weights(d), weights(plain))
