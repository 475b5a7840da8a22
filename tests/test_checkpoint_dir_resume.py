"""``checkpoint.dir`` changed on resume: a launch whose new dir holds none of the run's committed
checkpoints is refused (exit 2, naming both dirs and how to move them) instead of announcing a
resume and training from step 0; once the checkpoints are moved there, it resumes from them and
config.yaml names the new dir."""

import os
import shutil

import pytest
import yaml
from clihelp import call, one_error_line
from conftest import REPO, run_cli

from clusterflow.launch import submit

KILL9 = {
    "CLUSTERFLOW_TEST_KILL_AT": "9"
}  # SIGKILL during step 9: steps 4, 6 (the end of epoch 1) and 8 committed
TINY = ["cluster.tasks_per_node=1", "task.target=testtasks:KillAtEnv", "checkpoint.async=false"]


@pytest.fixture(autouse=True)
def _tasks_importable(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.join(REPO, "tests"))
    monkeypatch.delenv("CLUSTERFLOW_TEST_KILL_AT", raising=False)


def steps(root):
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-"))


def rank0_logs(run_dir):
    logs = os.path.join(run_dir, "logs")
    names = sorted(f for f in os.listdir(logs) if f.startswith("rank0."))
    return "".join(open(os.path.join(logs, f)).read() for f in names)


def test_a_changed_checkpoint_dir_is_refused_until_the_checkpoints_are_moved(tmp_path, monkeypatch):
    """The two refusals end before anything starts: submit runs in-process for them
    (tests/clihelp.call, as python -m runs it); the resume is a real submit --local."""
    run_dir, old, new = tmp_path / "run", tmp_path / "ckpt-a", tmp_path / "ckpt-b"
    first = ["configs/tiny.yaml", f"run.dir={run_dir}", *TINY]
    killed = run_cli("clusterflow.run", *first, f"checkpoint.dir={old}", env=KILL9)
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert steps(old) == [4, 6, 8]
    saved = open(run_dir / "config.yaml").read()

    monkeypatch.chdir(REPO)
    code, out, err = call(submit.main, [*first, f"checkpoint.dir={new}", "--local"])
    assert code == 2, out[-2000:] + err[-2000:]
    line = one_error_line(err)
    assert str(old) in line and str(new) in line and "step-8" in line and "mv " in line, line
    assert "resuming" not in out and not os.path.exists(new)
    assert open(run_dir / "config.yaml").read() == saved

    # The checkpoints moved as the error says: the run resumes from step 8 in the new dir.
    os.makedirs(new)
    for name in os.listdir(old):
        shutil.move(os.path.join(old, name), os.path.join(new, name))
    res = run_cli("clusterflow.submit", *first, f"checkpoint.dir={new}", "--local")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "global step 8" in rank0_logs(run_dir)
    assert yaml.safe_load(open(run_dir / "config.yaml"))["checkpoint"]["dir"] == str(new)
    # The original command now names the dir the checkpoints left.
    code, _, err = call(submit.main, [*first, f"checkpoint.dir={old}", "--local"])
    assert code == 2 and str(new) in one_error_line(err), err
