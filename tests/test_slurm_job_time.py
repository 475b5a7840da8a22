"""The job's time as Slurm gives it, on the real local cluster: a pending job's reason and the
start Slurm expects (``squeue --start``), a running job's time left, within seconds of
squeue's own answer asked beside it, in `status` and in the dashboard's job panel (its catalog,
which asks squeue once for all its runs); then a plain scancel, which the run reads as
cancelled."""

import os
import re
import subprocess
import time

import pytest
from conftest import run_cli
from dashboards import poll_until
from slurmjobs import live_status, scmd, status, submit, wait_gone, wait_until

from clusterflow.slurm.commands import slurm_duration, slurm_time
from clusterflow.web import catalog as web_catalog
from clusterflow.web import views

pytestmark = pytest.mark.slurm


def plain_status(run_dir):
    out = run_cli("clusterflow.status", run_dir)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_pending_job_shows_its_reason_and_start_and_a_running_one_its_time_left(
    cluster, tmp_path
):
    d = str(tmp_path / "run")
    gate = tmp_path / "gate"
    gate.touch()  # every loss call waits while it exists: the job stays running for the checks
    job, _ = submit(
        d,
        "task.target=testtasks:Gated",
        f"task.params.gate={gate}",
        "mining.enabled=false",
        "cluster.sbatch_extra={begin: now+900}",
    )
    try:
        s = status(d)
        start, reason = scmd("squeue", "--start", "-h", "-j", job, "-o", "%S|%r").split("|")
        assert s["state"] == "pending" and s["job"]["state"] == "PENDING", s
        assert s["job"]["reason"] == reason == "BeginTime", s["job"]
        expected = slurm_time(start)
        assert expected and s["job"]["start_at"] == expected, (s["job"], start)
        assert 800 < expected - time.time() < 1000
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(expected))
        text = plain_status(d)
        assert f"job          PENDING (BeginTime): Slurm expects it to start at {when}" in text, (
            text
        )
        cat = web_catalog.Catalog([d], lambda: None)
        assert poll_until(cat, lambda: _panel(cat) and _panel(cat)["job"], timeout=60)
        panel = _panel(cat)["job"]
        assert (panel["state"], panel["reason"], panel["start_at"]) == ("PENDING", reason, expected)

        scmd("scontrol", "update", f"JobId={job}", "StartTime=now")
        wait_until("the run to train", lambda: live_status(d).get("state") == "running", job_id=job)
        before = time.time()
        s = status(d)
        left = slurm_duration(scmd("squeue", "-h", "-j", job, "-o", "%L"))
        asked = time.time() - before  # squeue's answer is at most this much later than status's
        assert s["job"]["state"] == "RUNNING" and s["job"]["time_limit_s"] == 600, s["job"]
        assert left is not None and 0 <= s["job"]["left_s"] - left <= 5 + asked, (s["job"], left)
        nodes = scmd("squeue", "-h", "-j", job, "-o", "%N")
        assert s["job"]["nodes"] == nodes and s["job"]["node_count"] == 2, s["job"]
        text = plain_status(d)
        assert re.search(rf"job          RUNNING on {re.escape(nodes)}: \S+ of 0:10:00, ", text), (
            text
        )
        assert poll_until(cat, lambda: (_panel(cat)["job"] or {}).get("state") == "RUNNING", 60)
        panel = _panel(cat)["job"]
        left = slurm_duration(scmd("squeue", "-h", "-j", job, "-o", "%L"))
        # The page counts down from squeue's answer: the left it shows now, as squeue's.
        shown = panel["left_s"] - (time.time() - panel["asked_at"])
        assert abs(shown - left) <= 5, (panel, left)
        assert panel["nodes"] == nodes and panel["time_limit_s"] == 600
        # A plain scancel ends the job: its ranks save the step reached and stop, and the run
        # reads cancelled, not failed (the job shows them COMPLETING, as the end of a job whose
        # batch script died would).
        scmd("scancel", job)
        os.unlink(gate)
        wait_gone(job)
        s = status(d)
        assert (s["state"], s["error"]) == ("cancelled", None), s
        assert s["latest_checkpoint"].endswith(f"/step-{s['global_step']}"), s
        assert "state        cancelled" in plain_status(d)
    finally:
        subprocess.run(["scancel", job], check=False)
        if gate.exists():
            os.unlink(gate)


def _panel(cat):
    """The one run's page as the dashboard sends it (None before its first collect)."""
    run = next(iter(cat.runs.values()), None)
    return views.detail(run) if run is not None and run.status else None
