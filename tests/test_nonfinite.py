"""A diverging loss stops the run naming the step; nothing non-finite is ever committed; the newest
finite checkpoint survives; skip_step skips exactly the bad step; mining never runs on NaN."""

import os

import launch
import pytest
import torch
from conftest import REPO
from multirank import run_ranks

ONE = ["cluster.tasks_per_node=1"]
TASKS = {"PYTHONPATH": os.path.join(REPO, "tests")}


def steps(run_dir):
    ck = os.path.join(run_dir, "checkpoints")
    names = os.listdir(ck) if os.path.isdir(ck) else []
    return sorted(
        int(n[5:])
        for n in names
        if n.startswith("step-") and os.path.exists(os.path.join(ck, n, "manifest.json"))
    )


def tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)


def all_finite(run_dir, step):
    folder = os.path.join(run_dir, "checkpoints", f"step-{step}")
    objs = [
        torch.load(os.path.join(folder, n), weights_only=True)
        for n in ("model.pt", "train_state.pt")
    ]
    return all(torch.isfinite(t).all() for o in objs for t in tensors(o) if t.is_floating_point())


def status(run_dir):
    """What `status --json` says (its error is the first cause, also when two failing ranks raced
    to write status.json)."""
    from clusterflow.manage import status as status_cli
    from clusterflow.rundir.paths import RunPaths

    return status_cli.collect(RunPaths(run_dir))


def rank0_log(run_dir, attempt=0):
    return open(os.path.join(run_dir, "logs", f"rank0.attempt{attempt}.log")).read()


def test_submit_with_a_huge_lr_fails_naming_the_step(cli, tmp_path):
    """One rank: the test is about the divergence, not about a start-up under load (a second
    rank's rendezvous is tested elsewhere; the guard's reduce is the same on one process)."""
    d = str(tmp_path / "run")
    out = cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        "train.lr=1.0e+10",
        f"run.dir={d}",
        *ONE,
        "--local",
    )
    assert out.returncode == 1, out.stdout + out.stderr
    st = status(d)
    assert st["state"] == "failed"
    assert (
        "training diverged: the loss became non-finite (NaN or inf) at global step 2" in st["error"]
    )
    assert "Traceback" not in out.stderr
    assert steps(d) == [] and not os.path.exists(
        os.path.join(d, "model.pt")
    )  # step 4 would have been the first save
    assert "mining" not in rank0_log(d)  # no round on NaN embeddings


def test_divergence_after_some_checkpoints_keeps_the_newest_finite_one(tmp_path):
    """lr warms up to 1e10 / 60 per step: the loss turns NaN at step 10, after steps 4, 6 (epoch
    end, mining) and 8 were committed. Without the check, the run would 'complete' with NaN weights
    and keep_last would prune every finite checkpoint."""
    d = str(tmp_path / "run")
    over = [
        f"run.dir={d}",
        *ONE,
        "train.lr=1.0e+10",
        "train.warmup_steps=60",
        "checkpoint.keep_last=2",
    ]
    assert launch.run(1, "configs/tiny.yaml", over, d) == [1]
    assert "at global step 10 " in status(d)["error"] and status(d)["state"] == "failed"
    assert steps(d) == [6, 8] and all(all_finite(d, s) for s in steps(d))
    assert "the newest checkpoint, step-8, holds finite state" in status(d)["error"]
    # Resuming with the other policy is allowed (the key may change on resume). Here the weights
    # are finite but so large that some batches overflow: those steps are skipped, and the mining
    # round after epoch 2 finds NaN embeddings and refuses to cluster them.
    assert launch.run(1, "configs/tiny.yaml", [*over, "train.on_nonfinite=skip_step"], d) == [1]
    log = rank0_log(d, 1)
    assert (
        "resumed from" in log
        and "global step 10: non-finite loss or gradient; the optimizer step is skipped" in log
    )
    assert "mining after epoch 2: the embeddings are not finite" in status(d)["error"]
    assert (
        len(status(d)["mining"]) == 1
        and steps(d) == [6, 8]
        and all(all_finite(d, s) for s in steps(d))
    )


def run_nan_task(tmp_path, *extra, world=1):
    d = str(tmp_path / "run")
    over = [
        f"run.dir={d}",
        f"cluster.tasks_per_node={world}",
        "task.target=testtasks:NanAt",
        "checkpoint.every_steps=1",
        "checkpoint.keep_last=20",
        *extra,
    ]
    return d, launch.run(world, "configs/tiny.yaml", over, d)


@pytest.fixture(autouse=True)
def _tasks_importable(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TASKS["PYTHONPATH"])


def test_fail_policy_names_the_exact_step_of_a_bad_batch(tmp_path):
    d, codes = run_nan_task(tmp_path, "task.params.nan_at=4", "train.log_every_steps=3")
    assert codes == [1]
    assert (
        "at global step 4 (seen by the check at step 4" in status(d)["error"]
    )  # the save check at step 4 sees it
    assert steps(d) == [1, 2, 3] and all(all_finite(d, s) for s in steps(d))


def test_a_nan_between_checks_is_caught_by_the_stop_checkpoint(tmp_path):
    """NaN at step 5, SIGTERM during step 6; no log or save check in between (log every 10, save
    every 100): the stop's checkpoint is the first check, and it must not commit."""
    d, codes = run_nan_task(
        tmp_path,
        "task.params.nan_at=5",
        "task.params.term_at=6",
        "train.log_every_steps=10",
        "checkpoint.every_steps=100",
    )
    assert codes == [1]
    assert "at global step 5 (seen by the check at step 6" in status(d)["error"]
    assert steps(d) == []  # nothing at all: the stop did not commit the NaN state


def test_skip_step_skips_exactly_the_bad_step_on_every_rank(tmp_path):
    """Rank 0 and rank 1 each see one NaN loss (at step 4): the ranks agree, the update of step 4 is
    skipped everywhere (weights and optimizer state of step 4 equal step 3's bit for bit) and the
    run completes with finite weights."""
    d, codes = run_nan_task(
        tmp_path, "task.params.nan_at=4", "train.on_nonfinite=skip_step", world=2
    )
    assert codes == [0, 0]
    assert status(d)["state"] == "completed"
    load = lambda s, n: torch.load(
        os.path.join(d, "checkpoints", f"step-{s}", n), weights_only=True
    )
    m3, m4, m5 = (load(s, "model.pt") for s in (3, 4, 5))
    assert all(torch.equal(m3[k], m4[k]) for k in m3) and not all(
        torch.equal(m4[k], m5[k]) for k in m4
    )
    o3, o4 = (load(s, "train_state.pt")["optimizer"]["state"] for s in (3, 4))
    assert all(torch.equal(o3[i]["exp_avg"], o4[i]["exp_avg"]) for i in o3)
    assert (
        "global step 4: non-finite loss or gradient; the optimizer step is skipped (1 in a row, 1 "
        "in all)" in rank0_log(d)
    )
    assert all(
        torch.isfinite(t).all()
        for t in torch.load(os.path.join(d, "model.pt"), weights_only=True).values()
    )


def test_skip_step_fails_after_too_many_skips_in_a_row(tmp_path):
    d, codes = run_nan_task(
        tmp_path,
        "task.params.nan_at=4,5,6",
        "train.on_nonfinite=skip_step",
        "train.max_consecutive_skips=2",
    )
    assert codes == [1]
    assert (
        "non-finite at 3 optimizer steps in a row, up to global step 6 "
        "(train.max_consecutive_skips=2)" in status(d)["error"]
    )
    assert steps(d) == [1, 2, 3, 4, 5]  # 4 and 5: skipped steps, weights of step 3


def _guard_on_two_ranks():
    from types import SimpleNamespace

    from clusterflow.distributed import comm as dist
    from clusterflow.errors import RunFailed
    from clusterflow.train.finite import FiniteGuard

    train = SimpleNamespace(on_nonfinite="fail", grad_accum=2, max_consecutive_skips=3, lr=1.0)
    guard = FiniteGuard(torch.device("cpu"), train, list)
    guard.start(10)
    for micro in range(
        6
    ):  # steps 11, 12, 13; rank 1's fourth micro-batch (step 12) is NaN, rank 0's fifth
        bad = (dist.rank() == 1 and micro == 3) or (dist.rank() == 0 and micro == 4)
        guard.observe(torch.tensor(float("nan") if bad else 1.0))
    try:
        guard.check(13)
    except RunFailed as exc:
        return str(exc)
    return ""


def test_ranks_agree_on_the_first_non_finite_step():
    messages = run_ranks(2, _guard_on_two_ranks)
    assert (
        messages[0] == messages[1] and "non-finite (NaN or inf) at global step 12 " in messages[0]
    )
