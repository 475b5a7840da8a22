"""train.ema_decay on real gloo ranks, ddp and fsdp: a SIGKILL and resume end with model and EMA
weights bitwise equal to an uninterrupted run; eval reports both; the EMA weights come out as
model_ema.pt and through clusterflow.export --weights ema; mining.embed_with=ema mines with
them."""

import json
import os
import re

import launch
import pytest
import torch
from clihelp import call
from conftest import REPO

from clusterflow.launch import submit


def load(path):
    return torch.load(path, weights_only=True)


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def rank0_log(run_dir):
    logs = sorted(f for f in os.listdir(os.path.join(run_dir, "logs")) if f.startswith("rank0."))
    return "".join(open(os.path.join(run_dir, "logs", f)).read() for f in logs)


def overrides(run_dir, parallel, signals="", *extra):
    return [
        f"run.dir={run_dir}",
        f"train.parallel={parallel}",
        "train.ema_decay=0.9",
        "task.target=testtasks:Signals",
        f"task.params.run_dir={run_dir}",
        f"task.params.signals={signals}",
        *extra,
    ]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_sigkill_and_resume_end_with_model_and_ema_bitwise_equal(
    parallel, tmp_path, monkeypatch, cli
):
    monkeypatch.setenv("PYTHONPATH", os.path.join(REPO, "tests"))
    plain, killed = str(tmp_path / "plain"), str(tmp_path / "killed")
    assert launch.run(2, "configs/tiny.yaml", overrides(plain, parallel), plain) == [0, 0]
    assert launch.run(2, "configs/tiny.yaml", overrides(killed, parallel, "0:10:KILL"), killed) == [
        -9,
        -9,
    ]
    assert launch.run(2, "configs/tiny.yaml", overrides(killed, parallel, "0:10:KILL"), killed) == [
        0,
        0,
    ]
    # step 8 under fsdp; under ddp its background write may not have landed before the kill
    assert re.search(r"resumed from \S+/step-[68]: ", rank0_log(killed))
    for name in ("model.pt", "model_ema.pt"):
        assert same(load(f"{killed}/{name}"), load(f"{plain}/{name}")), name
    model, ema = load(f"{plain}/model.pt"), load(f"{plain}/model_ema.pt")
    assert model.keys() == ema.keys() and not same(model, ema)
    evals = json.load(open(f"{plain}/status.json"))["eval"]
    assert {"eval/view_cos", "eval_ema/view_cos"} <= set(evals), evals
    assert evals["eval/view_cos"] != evals["eval_ema/view_cos"]
    out = cli("clusterflow.export", plain, str(tmp_path / "ema.pt"), "--weights", "ema")
    assert out.returncode == 0, out.stderr
    assert same(load(tmp_path / "ema.pt"), ema)


def test_mining_embeds_with_the_ema_weights_when_asked(tmp_path, cli, monkeypatch):
    """The same run with mining.embed_with=model and =ema: the first round's labels differ (the
    teacher's embedding is not the student's); and ema without train.ema_decay is refused."""
    labels = {}
    for who in ("model", "ema"):
        d = str(tmp_path / who)
        out = cli(
            "clusterflow.run",
            "configs/tiny.yaml",
            f"run.dir={d}",
            "cluster.tasks_per_node=1",
            "train.ema_decay=0.9",
            f"mining.embed_with={who}",
            "train.epochs=2",
        )
        assert out.returncode == 0, out.stdout + out.stderr
        state = load(os.path.join(d, "checkpoints", "step-6", "train_state.pt"))
        labels[who] = state["train"]["labels"]
    assert labels["model"] is not None and labels["ema"] is not None
    assert not torch.equal(labels["model"], labels["ema"])
    # in-process (tests/clihelp.call, as python -m runs it): a refusal starts nothing
    monkeypatch.chdir(REPO)
    code, _, err = call(submit.main, ["configs/tiny.yaml", "--dry-run", "mining.embed_with=ema"])
    assert code == 2
    assert "mining.embed_with = 'ema': embedding with the EMA weights needs train.ema_decay" in err
