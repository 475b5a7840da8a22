"""The own loop's helpers on real ranks (tests/ownloop/steps_accum.py): a step-counted loop
(run.steps) across epochs, 4 micro-batches a step under run.accumulate, killed with SIGKILL
between two micro-batches and resumed bitwise, each sample trained once per epoch as the script
recorded it; one gradient reduction per optimizer step under DDP and FSDP2 (counted by the
script); run.gather and run.reduce over uneven shares; the helpers alone, in one process."""

import json
import os
import signal
import sys

import launch
import pytest
import torch
from conftest import REPO, run_cli, weights_equal
from test_own_loop import (
    Items,
    a_run,
    rank0_log,
    records,
    refused,
    restored_step,
    set_up,
    train_step,
    wait_for,
)

from clusterflow.storage.store import CheckpointStore

SCRIPT = os.path.join(REPO, "tests", "ownloop", "steps_accum.py")
# 100 samples, 4 a rank and micro-batch, 4 micro-batches a step: 32 a step on 2 ranks, 3 steps an
# epoch (the last takes 36); 10 steps end in epoch 4. Saves every 2 steps.
CONFIG = ("checkpoint.every_steps=2", "train.log_every_steps=2", "dist.heartbeat_s=1")


def start(run_dir, env=None, config=CONFIG, args=()):
    seen = run_dir + "-seen"
    os.makedirs(seen, exist_ok=True)
    command = [sys.executable, "-m", "clusterflow.run", "--script", SCRIPT, f"run.dir={run_dir}"]
    command += [*config, "--", *args]
    env = {"SEEN_DIR": seen, **(env or {})}
    return launch.start(2, None, None, run_dir + "-logs", command=command, env=env)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("steps") / "run")
    assert launch.wait(start(d)) == [0, 0], rank0_log(d)[-3000:]
    return d


def test_a_step_counted_loop_reduces_gradients_once_a_step_and_trains_each_sample_once(
    uninterrupted,
):
    seen = records(uninterrupted)
    for rank in (0, 1):
        steps = [r["step"] for r in seen[rank]]
        assert steps == list(range(1, 11)), steps
        # DDP's one bucket, reduced on the last of the 4 micro-batches only.
        assert all(r["reduces"] == [0, 0, 0, 1] for r in seen[rank]), seen[rank]
    for epoch in range(3):
        trained = [i for rs in seen.values() for r in rs if r["epoch"] == epoch for i in r["index"]]
        assert sorted(trained) == list(range(100)), (epoch, len(trained))
    last = [i for rs in seen.values() for r in rs if r["epoch"] == 3 for i in r["index"]]
    assert len(last) == len(set(last)) == 32  # the 10th step: the first of epoch 4
    status = json.loads(run_cli("clusterflow.status", uninterrupted, "--json").stdout)
    assert status["state"] == "completed" and status["global_step"] == 10, status
    assert "steps 10: accuracy" in rank0_log(uninterrupted)


def test_sigkill_between_two_micro_batches_resumes_bitwise(uninterrupted, tmp_path):
    d = str(tmp_path / "run")
    procs = start(d, env={"HOLD_AT_STEP": "8", "HOLD_AT_MICRO": "2"})
    wait_for(os.path.join(d + "-seen", "held"), procs)
    launch.kill(procs)
    assert launch.wait(procs) == [-signal.SIGKILL] * 2
    committed = CheckpointStore(os.path.join(d, "checkpoints")).steps()
    assert committed and max(committed) < 8, committed  # 6, or 4 with 6's write in flight
    assert launch.wait(start(d)) == [0, 0], rank0_log(d)[-3000:]
    resumed = restored_step(d, 1)
    assert max(committed) <= resumed < 8, (committed, resumed)
    assert weights_equal(os.path.join(d, "model.pt"), os.path.join(uninterrupted, "model.pt"))
    # What the script trained, the steps after the checkpoint once: the uninterrupted run's.
    mine, plain = records(d), records(uninterrupted)
    for rank in (0, 1):
        first = mine[rank][0]["pid"]
        kept = [r for r in mine[rank] if r["pid"] != first or r["step"] <= resumed]
        assert [(r["step"], r["index"]) for r in kept] == [
            (r["step"], r["index"]) for r in plain[rank]
        ]


def test_fsdp_accumulation_reduce_scatters_on_the_last_micro_batch_only(tmp_path):
    d = str(tmp_path / "run")
    config = (*CONFIG, "train.parallel=fsdp")
    procs = start(d, config=config, args=("--max-steps", "4"))
    assert launch.wait(procs) == [0, 0], rank0_log(d)[-3000:]
    seen = records(d)
    assert sorted(seen) == [0, 1]
    for rs in seen.values():
        assert [r["step"] for r in rs] == [1, 2, 3, 4]
        # Each of FSDP2's units (the two Linear layers) reduce-scatters once a step.
        assert all(r["reduces"][:3] == [0, 0, 0] and r["reduces"][3] > 0 for r in rs), rs
    assert CheckpointStore(os.path.join(d, "checkpoints")).newest_manifest()["format"] == "dcp"


# -- the helpers in one process --------------------------------------------------------------


def test_the_helpers_in_one_process(tmp_path, capsys):
    run = a_run(tmp_path, "helpers")
    model, opt, _ = set_up(run)
    assert run.is_main
    with run.main_first():
        pass
    t = torch.tensor([1.0, 2.0, 3.0])
    assert torch.equal(run.reduce(t, "mean"), t) and run.reduce(t, "max") is not t
    assert torch.equal(run.gather(t), t)
    message = refused(run.reduce, t, "median")
    assert message == "run.reduce(tensor, op='median'): op is one of mean, sum, max, min"
    assert "at least one dimension" in refused(run.gather, torch.tensor(1.0))
    with run.autocast():  # train.amp=auto on a CPU: nothing
        assert not torch.is_autocast_enabled("cpu")
    assert not run.scaler.is_enabled()
    run.print("printed once", 3)
    assert capsys.readouterr().out == "printed once 3\n"
    loader = run.loader(Items(), batch_size=8)
    run.restore(model=model, optimizer=opt)
    assert "give the loader that run.loader returned" in refused(
        lambda: next(iter(run.steps([], 3)))
    )
    batches = 0
    for x, _i in run.steps(loader, 10):  # 8 steps an epoch: 10 end in the second
        with run.accumulate(model):
            train_step(model, opt, x)
        run.step()
        batches += 1
    assert batches == 10 and run.global_step == 10 and run.epoch == 1
    assert "run.steps(...) came after the run's loop ended" in refused(
        lambda: next(iter(run.steps(loader, 12)))
    )
    run.finish()


def test_autocast_follows_train_amp(tmp_path):
    from clusterflow import rundir
    from clusterflow.config import load
    from clusterflow.observe.context import JobContext
    from clusterflow.train.preemption import Preemption
    from clusterflow.train.session import Run

    cfg = load(None, [f"run.dir={tmp_path / 'r'}", "script.path=train.py", "train.amp=bf16"])
    os.makedirs(cfg.run.dir)
    run = Run(
        JobContext(cfg, rundir.RunPaths(cfg.run.dir)),
        torch.device("cpu"),
        Preemption(),
        lambda o: (o, 0),
    )
    with run.autocast():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
