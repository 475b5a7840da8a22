"""Several models in one script (tests/ownloop/two_models.py: a GAN's generator and discriminator,
each set up with its optimizer, and an EMA the script keeps as a dict of tensors), killed with
SIGKILL in mid-epoch and resumed bitwise: under DDP on 2 ranks; under FSDP2, where the EMA and the
second model are saved and restored sharded, on 2 ranks and after 2 -> 3 ranks; and with
torch.compile before or after run.setup (CPU, inductor)."""

import os
import shutil
import signal
import sys
import time

import launch
import pytest
import torch
from conftest import REPO, weights_equal
from test_own_loop import rank0_log, restored_step, wait_for

from clusterflow.storage.store import CheckpointStore

SCRIPT = os.path.join(REPO, "tests", "ownloop", "two_models.py")
# 96 points, 8 a rank: 6 steps an epoch on 2 ranks, 3 epochs. Saves every 4 steps.
CONFIG = ("checkpoint.every_steps=4", "train.log_every_steps=2", "dist.heartbeat_s=1")


def start(run_dir, world=2, env=None, config=(), args=()):
    seen = run_dir + "-seen"
    os.makedirs(seen, exist_ok=True)
    command = [sys.executable, "-m", "clusterflow.run", "--script", SCRIPT, f"run.dir={run_dir}"]
    command += [*CONFIG, *config, "--", *args]
    env = {"SEEN_DIR": seen, **(env or {})}
    return launch.start(world, None, None, run_dir + "-logs", command=command, env=env)


def saved(run_dir, name):
    return torch.load(os.path.join(run_dir + "-seen", name), weights_only=True)


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def killed_at(run_dir, step, world=2, config=(), args=()):
    """A run killed with SIGKILL before step ``step``'s optimizer steps; the newest step
    committed when it died (the resume may find a newer one complete, see ``restored_step``)."""
    procs = start(run_dir, world, {"HOLD_AT_STEP": str(step)}, config, args)
    wait_for(os.path.join(run_dir + "-seen", "held"), procs, timeout=600)
    # A checkpoint written in the background may still be committing while rank 0 holds.
    store = CheckpointStore(os.path.join(run_dir, "checkpoints"))
    deadline = time.monotonic() + 300
    while not store.steps() and time.monotonic() < deadline:
        time.sleep(0.1)
    launch.kill(procs)
    assert launch.wait(procs) == [-signal.SIGKILL] * world
    committed = store.steps()
    assert committed and max(committed) < step, committed
    return max(committed)


def check_resumed(run_dir, reference, final_step):
    assert weights_equal(os.path.join(run_dir, "model.pt"), os.path.join(reference, "model.pt"))
    for name in (f"ema-step{final_step}.pt", f"d-step{final_step}.pt"):
        assert same(saved(run_dir, name), saved(reference, name)), name


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("gan") / "run")
    assert launch.wait(start(d)) == [0, 0], rank0_log(d)[-3000:]
    return d


def test_a_gan_with_two_optimizers_and_a_scripts_ema_resumes_bitwise(ddp_run, tmp_path):
    d = str(tmp_path / "run")
    killed_at(d, 9)
    assert launch.wait(start(d)) == [0, 0], rank0_log(d)[-3000:]
    check_resumed(d, ddp_run, 18)


@pytest.mark.slow
def test_fsdp_saves_the_second_model_and_the_ema_sharded_and_resumes_them_on_2_and_3_ranks(
    tmp_path,
):
    fsdp = ("train.parallel=fsdp",)
    plain = str(tmp_path / "plain")
    assert launch.wait(start(plain, config=fsdp)) == [0, 0], rank0_log(plain)[-3000:]
    # Every rank's shards of the discriminator, its optimizer and the EMA are in the DCP files,
    # not in rank 0's train_state.pt.
    store = CheckpointStore(os.path.join(plain, "checkpoints"))
    step = store.steps()[-1]
    state = torch.load(os.path.join(store.step_path(step), "train_state.pt"), weights_only=False)
    assert store.newest_manifest()["format"] == "dcp"
    assert not {"ema", "discriminator", "opt_d", "optimizer"} & set(state), sorted(state)

    # One kill serves both resumes: a copy of the killed run dir (and of what its script saw)
    # resumes on 3 ranks, the run dir itself on 2.
    two, three = str(tmp_path / "two"), str(tmp_path / "three")
    committed = killed_at(two, 9, config=fsdp)
    for suffix in ("", "-seen"):
        shutil.copytree(two + suffix, three + suffix, symlinks=True)
    assert launch.wait(start(two, config=fsdp)) == [0, 0], rank0_log(two)[-3000:]
    check_resumed(two, plain, 18)

    assert launch.wait(start(three, world=3, config=fsdp)) == [0, 0, 0], rank0_log(three)[-3000:]
    resumed = restored_step(three, 1)
    assert committed <= resumed < 9, (committed, resumed)
    # The EMA 3 ranks began from, resharded: the one 2 ranks had at the step resumed.
    assert same(saved(three, f"start-step{resumed}.pt"), saved(three, f"ema-step{resumed}.pt"))
    assert "resuming with 3 ranks from a checkpoint of 2" in rank0_log(three)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_model_compiled_before_or_after_setup_resumes_bitwise(tmp_path, when):
    args = ("--compile", when, "--epochs", "2")
    plain = str(tmp_path / "plain")
    assert launch.wait(start(plain, world=1, args=args)) == [0], rank0_log(plain)[-3000:]
    keys = torch.load(os.path.join(plain, "model.pt"), weights_only=True)
    assert not any(k.startswith("_orig_mod") for k in keys), sorted(keys)  # the plain model's
    d = str(tmp_path / "run")
    killed_at(d, 8, world=1, args=args)
    assert launch.wait(start(d, world=1, args=args)) == [0], rank0_log(d)[-3000:]
    check_resumed(d, plain, 24)
