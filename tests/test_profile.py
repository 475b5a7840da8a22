"""train.profile: a torch.profiler trace of exactly the configured global steps, on exactly the
configured ranks, in a file TensorBoard's profiler and Perfetto open (Chrome trace JSON)."""

import json
import os
import re

import launch
import pytest
from clihelp import call
from conftest import REPO

from clusterflow import config
from clusterflow.errors import UserError
from clusterflow.job import run
from clusterflow.launch import submit


def test_a_profiled_run_traces_exactly_the_window_on_the_chosen_rank(tmp_path):
    d = str(tmp_path / "run")
    assert launch.run(2, "configs/tiny.yaml", [f"run.dir={d}", "train.profile=3-5@1"], d) == [0, 0]
    files = sorted(os.listdir(os.path.join(d, "profile")))
    assert files == ["rank1.attempt0.steps3-5.pt.trace.json"], files
    trace = json.load(open(os.path.join(d, "profile", files[0])))
    steps = {
        int(m.group(1))
        for e in trace["traceEvents"]
        if (m := re.fullmatch(r"ProfilerStep#(\d+)", str(e.get("name", ""))))
    }
    assert steps == {3, 4, 5}
    ops = {e.get("name") for e in trace["traceEvents"]}
    assert any(str(op).startswith("aten::") for op in ops)  # the model's operators are in it
    log = open(os.path.join(d, "logs", "rank1.attempt0.log")).read()
    assert "profiled global steps 3-5" in log


@pytest.mark.parametrize("value", ["5-3", "0-2", "3-5@", "a-b", "3-5@0;1"])
def test_a_bad_profile_window_is_refused_with_the_form(value):
    with pytest.raises(UserError, match="train.profile"):
        config.load("configs/tiny.yaml", [f"train.profile={value}"])


def test_a_profile_naming_a_rank_the_run_does_not_have_is_refused():
    with pytest.raises(UserError, match=r"names rank 7 but the run has 2 rank\(s\)"):
        config.load("configs/tiny.yaml", ["train.profile=3-5@0,7", "cluster.tasks_per_node=2"])
    config.load("configs/tiny.yaml", ["train.profile=3-5@1", "cluster.tasks_per_node=2"])


@pytest.mark.parametrize("command", ["submit", "run"])
def test_a_window_past_the_last_step_is_refused_before_anything_is_written(
    tmp_path, monkeypatch, command
):
    """tiny.yaml: 192 samples / 32 = 6 steps an epoch, 3 epochs: steps 1-18. A window from step
    19 on would profile nothing. `submit --local` and `run --check` run in-process
    (tests/clihelp.call, as python -m runs them): a refusal ends before anything starts."""
    d = str(tmp_path / "run")
    main, extra = (submit.main, "--local") if command == "submit" else (run.main, "--check")
    monkeypatch.chdir(REPO)
    code, out, err = call(main, ["configs/tiny.yaml", extra, f"run.dir={d}", "train.profile=19-20"])
    assert code == 2, out + err
    assert err.strip().splitlines() == [
        (
            "error: train.profile = '19-20': starts after the run's last step: 3 epoch(s) x 6 "
            "steps (192 samples / train.batch_size 32) = 18 steps; profile steps within 1-18, "
            "e.g. 16-18"
        )
    ]
    assert not os.path.exists(d)
    extra = "--dry-run" if command == "submit" else "--check"
    code, out, err = call(main, ["configs/tiny.yaml", extra, f"run.dir={d}", "train.profile=18-25"])
    assert code == 0, out + err
    if command == "submit":  # a window the run reaches: it is traced, up to the run's last step
        over = [f"run.dir={d}", "train.profile=18-25"]
        assert launch.run(2, "configs/tiny.yaml", over, str(tmp_path / "logs")) == [0, 0]
        assert os.listdir(os.path.join(d, "profile")) == ["rank0.attempt0.steps18-18.pt.trace.json"]
