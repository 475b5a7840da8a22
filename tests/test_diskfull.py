"""A full disk says so in one line (device, step, path, size needed, space free), the job ends
`failed` with exit 1, the committed checkpoints stay as they were and the partial one is removed;
freeing space and resubmitting resumes (issue 12). Real small filesystems (tmpfs), so root only."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, tmpfs

from clusterflow import rundir
from clusterflow.errors import RunFailed
from clusterflow.storage import durable
from clusterflow.storage.store import CheckpointStore
from clusterflow.storage.tensors import TORCH


@pytest.fixture
def small_disk(tmp_path):
    """A real 8 MiB filesystem."""
    with tmpfs(tmp_path / "disk", "size=8m") as d:
        yield d


def test_checkpoint_larger_than_the_disk(small_disk):
    store = CheckpointStore(os.path.join(small_disk, "ck"), keep_last=2, codec=TORCH)
    store.save(1, {"model.pt": {"w": torch.ones(1000)}})
    with pytest.raises(RunFailed) as e:
        store.save(2, {"model.pt": {"w": torch.zeros(3_000_000)}})  # 12 MB
    msg = str(e.value)
    assert msg.startswith(
        f"no space left on tmpfs (mounted at {small_disk}) writing checkpoint step 2 to "
        f"{small_disk}/ck/step-2 (it needs about 12 MB, "
    )
    assert "MB free)" in msg and "enforce fail" not in msg and "resubmit" in msg
    assert os.listdir(os.path.join(small_disk, "ck")) == ["step-1"]  # the partial folder is gone
    assert store.steps() == [1] and torch.equal(
        store.verify(1).load("model.pt")["w"], torch.ones(1000)
    )


def test_atomic_file_on_a_full_disk(small_disk):
    with pytest.raises(
        RunFailed,
        match=rf"no space left on tmpfs \(mounted at {small_disk}\) writing model.pt to "
        rf"{small_disk}/model.pt \(it needs about 40 MB",
    ):
        durable.write_atomic(
            os.path.join(small_disk, "model.pt"), {"w": torch.zeros(10_000_000)}, codec=TORCH
        )
    assert os.listdir(small_disk) == []


def test_run_on_a_disk_that_fills_up(small_disk):
    run_dir = os.path.join(small_disk, "run")
    filler = os.path.join(small_disk, "filler")
    args = [
        sys.executable,
        "-m",
        "clusterflow.run",
        "configs/tiny.yaml",
        "task.params={}",
        f"run.dir={run_dir}",
        "task.target=testtasks:FillDisk",
        f"task.params.path={filler}",
        "task.params.at_call=3",
        "task.params.leave_kb=512",
        "task.params.hidden=384",
        "cluster.tasks_per_node=1",
        "train.batch_size=4",
        "train.epochs=2",
        "checkpoint.every_steps=2",
        "checkpoint.async=false",
        "mining.enabled=false",
        "train.eval_every_epochs=0",
    ]
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "tests")}
    out = subprocess.run(
        args, check=False, capture_output=True, text=True, cwd=REPO, env=env, timeout=300
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "Logging error" not in out.stderr, out.stderr
    ckpts = os.path.join(run_dir, "checkpoints")
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"error: no space left on tmpfs (mounted at {small_disk}) writing checkpoint step 4 to "
            f"{ckpts}/step-4 (it needs about"
        )
    )
    status = rundir.read_json(rundir.RunPaths(run_dir).status)
    assert (
        status["state"] == "failed"
        and status["exit_code"] == 1
        and "no space left" in status["error"]
    )
    store = CheckpointStore(ckpts, codec=TORCH)
    assert os.listdir(ckpts) == ["step-2"] and store.verify(2).step == 2
    os.unlink(
        filler
    )  # the user frees space and runs the same command again: it resumes from step 2
    again = subprocess.run(
        args, check=False, capture_output=True, text=True, cwd=REPO, env=env, timeout=300
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert (
        "resumed from" in again.stdout
        and rundir.read_json(rundir.RunPaths(run_dir).status)["state"] == "completed"
    )
