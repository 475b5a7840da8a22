"""A resubmission whose task code changed since the last one says so: which snapshot the run
continues with, and where the earlier one stays."""

import os
import shutil
import subprocess

import pytest

from clusterflow.rundir import frozen_code as snapshot
from clusterflow.rundir.paths import RunPaths

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_a_resubmission_with_changed_task_code_says_so(tmp_path, monkeypatch, capsys):
    repo = tmp_path / "repo"
    write(str(repo / "changedtasks" / "__init__.py"), "")
    write(str(repo / "changedtasks" / "task.py"), "VALUE = 1\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    monkeypatch.syspath_prepend(str(repo))
    run_dir = str(tmp_path / "run")
    first = snapshot.take(RunPaths(run_dir), "changedtasks.task:Task")
    again = snapshot.take(RunPaths(run_dir), "changedtasks.task:Task")
    assert again["version"] == first["version"]
    assert "changed" not in capsys.readouterr().err  # unchanged code: nothing to say

    write(str(repo / "changedtasks" / "task.py"), "VALUE = 2\n")
    second = snapshot.take(RunPaths(run_dir), "changedtasks.task:Task")
    err = capsys.readouterr().err
    assert second["version"] != first["version"]
    assert "task's code changed" in err and first["version"] in err and second["version"] in err
    assert os.path.join(run_dir, "code", first["version"]) in err
