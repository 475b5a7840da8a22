"""Stops and kills of a real single-process run, resumed: a finished mining round is never redone,
TensorBoard and metrics.jsonl keep one value per (step, tag), and the weights end bitwise equal
to an uninterrupted run's."""

import collections
import json
import os
import re

import launch
import pytest
import torch
from conftest import REPO

ONE = ["cluster.tasks_per_node=1"]


def weights(run_dir):
    return torch.load(os.path.join(run_dir, "model.pt"), weights_only=True)


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def rank0_log(run_dir):
    logs = sorted(f for f in os.listdir(os.path.join(run_dir, "logs")) if f.startswith("rank0."))
    return "".join(open(os.path.join(run_dir, "logs", f)).read() for f in logs)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("plain") / "run")
    assert launch.run(1, "configs/tiny.yaml", [f"run.dir={d}", *ONE], d) == [0]
    return d


def signalled_run(run_dir, signals, attempts, monkeypatch, task="Signals"):
    """Run tiny.yaml with the Signals test task until it completes; returns the exit codes."""
    monkeypatch.setenv("PYTHONPATH", os.path.join(REPO, "tests"))
    over = [
        f"run.dir={run_dir}",
        *ONE,
        f"task.target=testtasks:{task}",
        f"task.params.run_dir={run_dir}",
        f"task.params.signals={signals}",
    ]
    return [launch.run(1, "configs/tiny.yaml", over, run_dir)[0] for _ in range(attempts)]


def test_stop_at_the_last_step_of_an_epoch_never_repeats_its_mining_round(
    uninterrupted, tmp_path, monkeypatch
):
    """SIGTERM during the last step of epoch 1 commits step 6 before eval and mining; the next
    attempt mines and commits step 6 again (after mining), then is killed; the third must not mine
    again."""
    d = str(tmp_path / "run")
    codes = signalled_run(d, "0:6:TERM,1:1:KILL", 3, monkeypatch)
    assert codes == [0, -9, 0], codes
    logs = rank0_log(d)
    assert "saving at global step 6 and stopping" in logs
    assert len(re.findall(r"mining after epoch 1:", logs)) == 1, logs
    assert re.search(
        r"resumed from \S+/step-6: epoch 2, step 0 of the epoch", logs
    )  # the state after mining
    assert same_weights(weights(d), weights(uninterrupted))


def test_tensorboard_and_metrics_after_kills_hold_one_value_per_step(
    uninterrupted, tmp_path, monkeypatch
):
    """Killed at step 3 (before any checkpoint: the next attempt starts afresh), then at step 10
    (resumes from step 8): every (step, tag) has one value, and none is from a dead attempt past
    the step the next attempt resumed from."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    d = str(tmp_path / "run")
    assert signalled_run(d, "0:3:KILL,1:10:KILL", 3, monkeypatch) == [-9, -9, 0]
    starts = [json.loads(line)["started_at"] for line in open(os.path.join(d, "attempts.jsonl"))]
    resumed_from = [0, 8]  # what attempts 1 and 2 resumed from (attempt 1 had no checkpoint)
    acc = EventAccumulator(
        os.path.join(d, "tb")
    )  # purge_orphaned_data=True, as TensorBoard loads it
    acc.Reload()
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        counts = collections.Counter(e.step for e in events)
        assert max(counts.values()) == 1, (tag, counts)
        for e in events:
            for dead, step in enumerate(resumed_from):
                assert not (e.step > step and e.wall_time < starts[dead + 1]), (
                    tag,
                    e.step,
                    "from dead attempt",
                    dead,
                )
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 19))
    from clusterflow.observe.metrics import (
        read_metrics,
    )  # metrics.jsonl, read back by the same rule

    rows = read_metrics(d)
    plain = read_metrics(uninterrupted)
    assert sorted(s for s, v in rows.items() if "train/loss" in v) == list(range(1, 19))
    assert {s: v["train/loss"] for s, v in rows.items() if "train/loss" in v} == {
        s: v["train/loss"] for s, v in plain.items() if "train/loss" in v
    }  # exact resume: the same losses
    assert same_weights(weights(d), weights(uninterrupted))


def test_a_stop_in_mid_epoch_continues_the_global_random_stream_exactly(tmp_path, monkeypatch):
    """Dropout draws from the global torch stream; the stop at step 9 (mid-epoch 2) and the resume
    must leave it where the uninterrupted run has it (a DataLoader that seeds its workers from
    that stream when its iterator starts would shift it by one draw on resume)."""
    plain, stopped = str(tmp_path / "plain"), str(tmp_path / "stopped")
    assert signalled_run(plain, "", 1, monkeypatch, "DropoutSignals") == [0]
    assert signalled_run(stopped, "0:9:TERM", 2, monkeypatch, "DropoutSignals") == [0, 0]
    assert "saving at global step 9 and stopping" in rank0_log(stopped)
    assert same_weights(weights(stopped), weights(plain))
