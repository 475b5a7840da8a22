"""checkpoint.keep_every_steps and checkpoint.keep_best, with kills around pruning: the kept set
is what the rule gives over every committed step, RUN_DIR/best names the best one, every resume
finds its checkpoint, and the weights end equal to an uninterrupted run's."""

import os
import re

import launch
import pytest
import torch
from clihelp import call
from conftest import REPO

from clusterflow.launch import submit
from clusterflow.observe.metrics import read_metrics

RETAIN = [
    "cluster.tasks_per_node=1",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=2",
    "checkpoint.keep_every_steps=8",
    "checkpoint.keep_best=train/loss:min",
]


def weights(run_dir):
    return torch.load(os.path.join(run_dir, "model.pt"), weights_only=True)


def kept(run_dir):
    names = os.listdir(os.path.join(run_dir, "checkpoints"))
    return {int(n[5:]) for n in names if re.fullmatch(r"step-\d+", n)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("plain") / "run")
    assert launch.run(1, "configs/tiny.yaml", [f"run.dir={d}", *RETAIN], d) == [0]
    return d


def test_kills_around_pruning_keep_the_rule_best_and_every_resume(
    uninterrupted, tmp_path, monkeypatch
):
    d = str(tmp_path / "run")
    monkeypatch.setenv("PYTHONPATH", os.path.join(REPO, "tests"))
    over = [
        f"run.dir={d}",
        *RETAIN,
        "task.target=testtasks:Signals",
        f"task.params.run_dir={d}",
        "task.params.signals=0:7:KILL,1:5:KILL",  # in steps 7 and (resumed from 6) 11
    ]
    codes = [launch.run(1, "configs/tiny.yaml", over, d)[0] for _ in range(3)]
    assert codes == [-9, -9, 0], codes

    # every resume found a checkpoint (none was pruned under it) and went on from it
    for attempt in (1, 2):
        log = open(os.path.join(d, "logs", f"rank0.attempt{attempt}.log")).read()
        assert re.search(r"resumed from \S+/step-\d+", log), log[-2000:]

    # the rule, computed here from metrics.jsonl over every step that was ever committed
    loss = {s: v["train/loss"] for s, v in read_metrics(d).items() if "train/loss" in v}
    committed = list(range(2, 19, 2))
    best = min(committed, key=lambda s: (loss[s], s))
    assert kept(d) == {16, 18} | {8, 16} | {best}
    assert best not in (8, 16, 18)  # the best one is kept for being best alone
    assert os.readlink(os.path.join(d, "best")) == os.path.join("checkpoints", f"step-{best}")
    assert kept(uninterrupted) == kept(d)
    assert os.readlink(os.path.join(uninterrupted, "best")) == os.readlink(os.path.join(d, "best"))
    a, b = weights(d), weights(uninterrupted)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_bad_keep_best_is_refused_at_submit(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # in-process (tests/clihelp.call, as python -m runs it)
    args = ["configs/tiny.yaml", "--dry-run", f"run.dir={tmp_path}/run"]
    code, _, err = call(submit.main, [*args, "checkpoint.keep_best=eval/view_cos"])
    assert code == 2
    assert "checkpoint.keep_best" in err and "METRIC:max" in err, err


def test_a_keep_best_metric_never_logged_is_named_once_with_the_logged_ones(tmp_path):
    """A misspelt metric (eval/view_cosine; the task logs eval/view_cos) keeps no best checkpoint:
    the rank-0 log says so once, after the first epoch's eval and mining, naming what was
    logged."""
    d = str(tmp_path / "run")
    overrides = [f"run.dir={d}", *RETAIN[:-1], "checkpoint.keep_best=eval/view_cosine:max"]
    assert launch.run(1, "configs/tiny.yaml", overrides, d) == [0]
    log = open(os.path.join(d, "logs", "rank0.attempt0.log")).read()
    said = [ln for ln in log.splitlines() if "checkpoint.keep_best" in ln]
    assert len(said) == 1, said
    assert "the metric 'eval/view_cosine' was not logged by epoch 1" in said[0], said
    assert "eval/view_cos," in said[0] and "train/loss" in said[0], said
    assert not os.path.lexists(os.path.join(d, "best"))
