"""Sweep input that lies: a value listed twice is named as such, and --max-parallel below 1 is
refused with --local as without it (one line, exit 2, nothing written)."""

import os

import pytest
from clihelp import call, one_error_line

from clusterflow.errors import UserError
from clusterflow.launch.submit import main
from clusterflow.sweeps import sweep


def test_a_value_listed_twice_is_named():
    with pytest.raises(UserError) as e:
        sweep.expand("configs/tiny.yaml", [], ["train.lr=0.1,0.1"])
    msg = str(e.value)
    assert "train.lr" in msg and "0.1 is listed twice" in msg and "share a directory" not in msg


def test_a_value_listed_twice_beside_another_axis_is_named():
    with pytest.raises(UserError) as e:
        sweep.expand("configs/tiny.yaml", [], ["train.lr=0.1,0.2,0.1", "mining.k=5,6"])
    assert "0.1 is listed twice" in str(e.value)


@pytest.mark.parametrize("n", ["0", "-3"])
def test_max_parallel_below_one_is_refused_with_local(tmp_path, n):
    code, out, err = call(
        main,
        [
            "configs/tiny.yaml",
            f"run.dir={tmp_path}/sw",
            "--sweep",
            "train.lr=0.1,0.2",
            "--max-parallel",
            n,
            "--local",
        ],
    )
    assert code == 2, out + err
    assert f"--max-parallel {n}: must be >= 1" in one_error_line(err)
    assert not os.path.exists(tmp_path / "sw")


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_task_params_of_every_member_are_checked_before_anything_is_submitted(tmp_path, dry_run):
    code, out, err = call(
        main,
        [
            "configs/tiny.yaml",
            f"run.dir={tmp_path}/sw",
            "--sweep",
            "task.params.bogus=1,2",
            "--local",
            *dry_run,
        ],
    )
    assert code == 2, out + err
    line = one_error_line(err)
    assert "bogus" in line and "every member of the sweep fails" in line, line
    assert not os.path.exists(tmp_path / "sw")
