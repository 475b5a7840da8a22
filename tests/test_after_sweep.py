"""``--after SWEEP_DIR``: a stage after a whole sweep waits for every member (with --local, every
member must have completed), instead of refusing the sweep dir as "not a run dir"."""

import json
import os

from clihelp import one_error_line
from conftest import run_cli

from clusterflow import rundir
from clusterflow.launch import stages
from clusterflow.rundir import submissions

ONE = ["cluster.tasks_per_node=1", "train.epochs=1"]


def test_after_a_sweep_dir_waits_for_every_member(tmp_path, fake_slurm):
    sweep_dir, next_dir = tmp_path / "sweep", tmp_path / "next"
    res = run_cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        f"run.dir={sweep_dir}",
        *ONE,
        "--sweep",
        "train.lr=0.001,0.002",
        "--local",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    res = run_cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        f"run.dir={next_dir}",
        *ONE,
        "--after",
        str(sweep_dir),
        "--local",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert json.load(open(next_dir / "status.json"))["state"] == "completed"

    # A member that has not completed: named, and on Slurm its job is waited for.
    members = sorted(d for d in os.listdir(sweep_dir) if d.startswith("lr="))
    first = sweep_dir / members[0]
    status = json.load(open(first / "status.json"))
    json.dump(dict(status, state="pending", job_id="4711_0"), open(first / "status.json", "w"))
    os.remove(first / "model.pt")  # committed final weights would make it completed
    submissions.record_submission(rundir.RunPaths(str(first)), "4711_0")
    fake_slurm.answer("squeue", stdout="PENDING|Priority\n")  # the member's job still waits
    res = run_cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        f"run.dir={tmp_path / 'third'}",
        *ONE,
        "--after",
        str(sweep_dir),
        "--local",
    )
    assert res.returncode == 2
    assert members[0] in one_error_line(res.stderr), res.stderr
    runs = stages.after_runs([str(sweep_dir)])
    assert [os.path.basename(r.root) for r in runs] == members
