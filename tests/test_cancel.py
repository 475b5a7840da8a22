"""python -m clusterflow.cancel: the cancelled marker, which jobs are cancelled, and scancel."""

import json
import os
import subprocess
import time

import pytest
from conftest import run_cli, write_status_record

from clusterflow import rundir
from clusterflow.errors import UserError
from clusterflow.manage import cancel
from clusterflow.rundir import cancel_marker, submissions
from clusterflow.sweeps import index as sweep_index


def make_run(path, state=None, job=None, source="slurm", **status):
    d = str(path)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.yaml"), "w") as f:
        f.write("run: {dir: x}\n")
    if state:
        write_status_record(d, state=state, updated_at=time.time(), **status)
    if job:
        rundir.append_jsonl(
            rundir.RunPaths(d).attempts,
            {"attempt": 0, "job_id": job, "started_at": time.time(), "source": source},
        )
    return d


def test_marker(tmp_path):
    paths = rundir.RunPaths(make_run(tmp_path / "r", "running", "7"))
    assert not cancel_marker.is_cancelled(paths)
    cancel_marker.mark(paths, "7", now=1.0)
    rec = json.load(open(paths.cancelled))
    assert cancel_marker.is_cancelled(paths) and rec["job_id"] == "7" and rec["cancelled_at"] == 1.0
    assert "@" in rec["by"]
    assert cancel_marker.clear(paths) and not cancel_marker.is_cancelled(paths)
    assert not cancel_marker.clear(paths)


def test_targets():
    runs = [
        ("done", "completed", "1"),
        ("live", "running", "2"),
        ("queued", None, "3_1"),
        ("back", "requeued", "4"),
        ("dead", "failed", "5"),
        ("stop", "stopped", None),
        ("local", "running", None),
        ("again", "cancelled", "6"),
    ]
    mark, kill, notes = cancel.targets(runs)
    assert mark == ["live", "queued", "back", "dead", "stop", "local", "again"]
    assert kill == [("live", "2"), ("queued", "3_1"), ("back", "4")]
    assert notes == [
        "done: already completed; left alone",
        "dead: failed; marked cancelled so that it is not resumed",
        "stop: stopped; marked cancelled so that it is not resumed",
        "local: no Slurm job known (a local run stops at its next step); marked cancelled",
        "again: already cancelled",
    ]


def test_a_newer_submission_makes_a_stale_state_unknown(tmp_path):
    d = make_run(tmp_path / "r", "failed", "7")
    paths = rundir.RunPaths(d)
    assert cancel.job_state(paths) == "failed"
    # resubmitted: its job may be pending
    submissions.record_submission(paths, "8", now=time.time() + 5)
    assert cancel.job_state(paths) is None
    runs = [(d, cancel.job_state(paths), submissions.current_job_id(paths))]
    assert cancel.targets(runs)[1] == [(d, "8")]


def test_cancel_a_sweep_without_slurm_jobs_marks_the_unfinished_members(tmp_path):
    sw = str(tmp_path / "sw")
    names = ["a", "b", "c", "d"]
    sweep_index.write_index(
        rundir.RunPaths(sw),
        {
            "version": 1,
            "keys": ["train.lr"],
            "base": {},
            "submissions": [],
            "members": [{"name": n, "values": {}, "overrides": []} for n in names],
        },
    )
    make_run(os.path.join(sw, "a"), "completed", "4242", source="submitit-local")
    make_run(
        os.path.join(sw, "b"), "running", "4243", source="submitit-local"
    )  # a local run: no scancel
    make_run(os.path.join(sw, "c"), "stopped")
    out = run_cli("clusterflow.cancel", sw)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"{sw}/d: never submitted; nothing to cancel",
        f"{sw}/a: already completed; left alone",
        f"{sw}/b: no Slurm job known (a local run stops at its next step); marked cancelled",
        f"{sw}/c: stopped; marked cancelled so that it is not resumed",
    ]
    assert [cancel_marker.is_cancelled(rundir.RunPaths(os.path.join(sw, n))) for n in names] == [
        False,
        True,
        True,
        False,
    ]


def test_without_scancel_the_marker_still_stops_requeues(tmp_path):
    d = make_run(tmp_path / "r", "running", "123456789")
    out = run_cli("clusterflow.cancel", d, env={"PATH": str(tmp_path)})  # no scancel on this PATH
    assert (
        out.returncode == 2 and "scancel is not on PATH, so jobs 123456789 still run" in out.stderr
    )
    assert cancel_marker.is_cancelled(rundir.RunPaths(d))


def test_not_a_run_dir(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        cancel.runs_of(rundir.RunPaths(str(tmp_path / "nope")))
    with pytest.raises(UserError, match="neither config.yaml nor sweep.json"):
        cancel.runs_of(rundir.RunPaths(str(tmp_path)))


@pytest.mark.slurm
def test_cancel_scancels_the_runs_real_pending_job(cluster, tmp_path):
    """A held job on the local cluster stands for a submitted run that waits in the queue."""
    d = make_run(tmp_path / "r")
    sub = subprocess.run(
        ["sbatch", "--hold", "--parsable", "-o", "/dev/null", "--wrap", "sleep 600"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    try:
        submissions.record_submission(rundir.RunPaths(d), job)
        out = run_cli("clusterflow.cancel", d)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"{d}: cancelled job {job}"
        assert cancel_marker.is_cancelled(rundir.RunPaths(d))
        deadline = time.time() + 30
        while time.time() < deadline:
            q = subprocess.run(
                ["squeue", "-h", "-j", job, "-o", "%T"], check=False, capture_output=True, text=True
            ).stdout.strip()
            if q in ("", "CANCELLED"):
                break
            time.sleep(0.5)
        assert q in ("", "CANCELLED"), q
        # cancelling again is harmless: the job has already left the queue
        assert run_cli("clusterflow.cancel", d).returncode == 0
    finally:
        subprocess.run(["scancel", job], check=False, capture_output=True, timeout=30)
