"""Status tells the truth from what is committed: a completed run reads `completed` whatever its
records say, and records that are lost, damaged or wrong-typed are named, never a traceback."""

import json
import os
import shutil

import pytest
from conftest import run_cli

from clusterflow.launch import stages


@pytest.fixture(scope="module")
def completed_run(tmp_path_factory):
    """One real one-process run of configs/tiny.yaml to its end, made once; tests damage copies."""
    d = str(tmp_path_factory.mktemp("completed") / "run")
    out = run_cli(
        "clusterflow.run", "configs/tiny.yaml", f"run.dir={d}", "cluster.tasks_per_node=1"
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return d


@pytest.fixture
def completed(completed_run, tmp_path):
    d = str(tmp_path / "run")
    shutil.copytree(completed_run, d)
    return d


def status(run_dir, *flags):
    out = run_cli("clusterflow.status", run_dir, *flags)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
    return out.stdout


def damage_status(run_dir, how):
    target = os.path.join(run_dir, "status.json")
    os.remove(target)
    if how == "directory":
        os.mkdir(target)
        return
    with open(target, "w") as f:
        f.write({"empty": "", "JSON list": "[1, 2, 3]\n"}[how])


@pytest.mark.parametrize("how", ["empty", "directory", "JSON list"])
def test_a_completed_run_reads_completed_whatever_status_json_holds(completed, how):
    damage_status(completed, how)
    s = json.loads(status(completed, "--json"))
    assert s["state"] == "completed" and s["error"] is None and s["alive"] is None, s
    # Progress from the newest committed checkpoint: tiny.yaml is 3 epochs of 6 steps.
    assert (s["epoch"], s["global_step"], s["step_in_epoch"]) == (3, 18, 0)
    assert s["latest_checkpoint"].endswith("step-18") and s["damaged_records"]
    assert "state        completed" in status(completed)
    # --after accepts it: a completed earlier stage needs no dependency, --local included.
    assert stages.dependency([completed], local=True) is None
    out = run_cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        f"run.dir={completed}-next",
        "--after",
        completed,
        "--local",
        "--dry-run",
    )
    assert out.returncode == 0 and "--after" not in out.stderr, out.stdout + out.stderr


def test_progress_after_a_kill_comes_from_the_newest_committed_checkpoint(completed):
    # Killed after step 18 was committed but before model.pt and the next status.json write:
    # the record still says step 1, the run's processes are gone.
    os.remove(os.path.join(completed, "model.pt"))
    with open(os.path.join(completed, "status.json"), "w") as f:
        json.dump({"state": "running", "epoch": 0, "global_step": 1, "step_in_epoch": 1}, f)
    s = json.loads(status(completed, "--json"))
    assert s["state"] == "failed" and s["alive"] is False, s
    assert (s["epoch"], s["global_step"], s["step_in_epoch"]) == (3, 18, 0)
    assert s["liveness"].endswith("; last step 18"), s["liveness"]
