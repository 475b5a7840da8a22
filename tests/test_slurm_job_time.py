"""The job's time as Slurm gives it, on the real local cluster: a pending job's reason and the
start Slurm expects (``squeue --start``), a running job's time left, within seconds of
squeue's own answer asked beside it, in `status` and in the dashboard's job panel (its catalog,
which asks squeue once for all its runs); while it runs, a second submission of its run dir is
refused, naming it, and changes nothing there; then a plain scancel, which the run reads as
cancelled; and ten time limits, each brought forward by an admin's ``scontrol update``,
survived with no step lost although the save is slower than Slurm's --signal lead."""

import itertools
import os
import re
import subprocess
import time

import pytest
from conftest import run_cli
from dashboards import poll_until
from slurmjobs import (
    ENDED,
    TWO_NODES,
    env,
    job_fields,
    live_status,
    scmd,
    sha256,
    status,
    submit,
    wait_gone,
    wait_until,
)

from clusterflow import rundir
from clusterflow.rundir import lease, timeline
from clusterflow.slurm.commands import slurm_duration, slurm_time
from clusterflow.web import catalog as web_catalog
from clusterflow.web import views

pytestmark = pytest.mark.slurm


def plain_status(run_dir):
    out = run_cli("clusterflow.status", run_dir)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_pending_then_running_job_shows_its_time_refuses_a_second_job_and_reads_scancel_cancelled(
    cluster, tmp_path
):
    """One job, kept running by a gate, carries three proofs in turn: pending, its reason and
    the start Slurm expects; running, its time left and nodes, and one job per run dir (a second
    submission is refused and writes nothing there); then a plain scancel read as cancelled."""
    d = str(tmp_path / "run")
    gate = tmp_path / "gate"
    gate.touch()  # every loss call waits while it exists: the job stays running for the checks
    gated = (
        "task.target=testtasks:Gated",
        f"task.params.gate={gate}",
        "mining.enabled=false",
        "cluster.sbatch_extra={begin: now+900}",
    )
    job, _ = submit(d, *gated)
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
        # One job per run dir: the job holds it, and the same submission again is refused before
        # it writes anything there (the run dir as it was: the run goes on as this job's alone;
        # test_run_dir.py proves, locally, that such a run still completes bitwise).
        paths = rundir.RunPaths(d)
        holder = wait_until(
            "the job to take the run dir",
            lambda: (lease.current(paths)[1] or {}).get("slurm_job"),
            job_id=job,
        )
        assert holder == job
        kept = [_read(paths.config), _read(paths.submissions)]
        second = run_cli(
            "clusterflow.submit", "configs/tiny.yaml", f"run.dir={d}", *TWO_NODES, *gated, env=env()
        )
        assert second.returncode == 2, second.stdout + second.stderr
        assert (
            f"is held by Slurm job {job} (pid " in second.stderr
            and f"Slurm job {job} is RUNNING" in second.stderr
        ), second.stderr
        assert [_read(paths.config), _read(paths.submissions)] == kept
        assert (lease.current(paths)[1] or {}).get("slurm_job") == job
        # A plain scancel ends the job: its ranks save the step reached and stop, and the run
        # reads cancelled, not failed (the job shows them COMPLETING, as the end of a job whose
        # batch script died would).
        scmd("scancel", job)
        os.unlink(gate)
        wait_gone(job)
        s = status(d)
        assert (s["state"], s["error"], s["attempts"]) == ("cancelled", None, 1), s
        assert s["latest_checkpoint"].endswith(f"/step-{s['global_step']}"), s
        assert "state        cancelled" in plain_status(d)
    finally:
        subprocess.run(["scancel", job], check=False)
        if gate.exists():
            os.unlink(gate)


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _panel(cat):
    """The one run's page as the dashboard sends it (None before its first collect)."""
    run = next(iter(cat.runs.values()), None)
    return views.detail(run) if run is not None and run.status else None


# Ten time limits: each attempt trains, then the test brings the job's end to WINDOW_S from now
# (as an admin's `scontrol update` does); Slurm's --signal comes 1 s before it (if at all: Slurm
# looks at its time limits every 30 s), shorter than the slowed save. WINDOW_S is a little over
# what a stop needs (end_margin_s plus two saves of 2 s), so the watch sees the end before it is
# due. The attempt after the last limit is not slowed: it trains the rest at full speed (the ten
# slowed attempts train 45-60 of the run's 90 steps, 5 or 6 each after the first's 10).
LIMITS, WINDOW_S = 10, 11
TIME_LIMITED = (
    "task.target=testtasks:SlowSave",
    "task.params.step_sleep=0.4",
    "task.params.save_sleep=2",
    "train.epochs=15",
    "mining.every_epochs=5",
    "checkpoint.every_steps=8",
    "cluster.signal_delay_s=1",
    "cluster.end_check_s=1",
    "cluster.end_margin_s=5",
    f"cluster.max_timeout_requeues={LIMITS}",
)


def _trained(run_dir, attempt, committed):
    """Attempt ``attempt`` trains (its first step recorded), and has committed a checkpoint when
    ``committed`` (so that it measured a save)."""
    tl = timeline.read_all(rundir.RunPaths(run_dir)).records.get(attempt, {})
    s = live_status(run_dir)
    return (
        s.get("attempt") == attempt
        and s.get("state") == "running"
        and "first_step_at" in tl
        and (not committed or "commit" in tl)
    )


def _ended(job):
    fields = job_fields(job)
    return fields.get("JobState") in ENDED and fields


@pytest.mark.slow
@pytest.mark.cpu_bound  # ten attempts' start-ups: 190 s alone, 260-300 s beside the other workers
def test_ten_time_limits_with_a_short_signal_lead_and_a_slow_save_lose_no_step(cluster, tmp_path):
    """The job reads its end from Slurm again every second: an end brought forward is seen,
    and the run stops, saves and requeues itself before it, each attempt resuming at exactly the
    step the one before saved; each sample once per epoch; the weights of an uninterrupted run
    of the same config trained beside it."""
    d, ref = str(tmp_path / "run"), str(tmp_path / "reference")
    same = [o for o in TIME_LIMITED if not o.startswith(("task.params", "cluster."))]
    ref_job, _ = submit(ref, *same, "task.params.step_sleep=0", "task.params.save_sleep=0")
    job, _ = submit(
        d, *TIME_LIMITED, f"task.params.run_dir={d}", f"task.params.slow_attempts={LIMITS}"
    )
    ends = []
    try:
        for k in range(LIMITS):
            wait_until(f"attempt {k} training", lambda k=k: _trained(d, k, k == 0), job_id=job)
            end = int(time.time()) + WINDOW_S
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(end))
            scmd("scontrol", "update", f"JobId={job}", f"EndTime={stamp}")
            assert job_fields(job)["EndTime"] == stamp
            ends.append(end)
            wait_until(
                f"time-limit stop {k + 1}",
                lambda k=k: len(rundir.read_jsonl(rundir.RunPaths(d).stops)) > k,
                job_id=job,
            )
        # An admin gives the job time again: the last attempt trains to the end.
        scmd("scontrol", "update", f"JobId={job}", "TimeLimit=10")
        fields = wait_until(f"job {job} to end", lambda: _ended(job), timeout=600, job_id=job)
        assert fields["JobState"] == "COMPLETED", fields  # never TIMEOUT
        # (long done, and maybe forgotten by Slurm: its run dir says)
        wait_until("the reference run", lambda: live_status(ref).get("state") == "completed")
    finally:
        subprocess.run(["scancel", job, ref_job], check=False)
    s = status(d)
    assert s["state"] == "completed" and s["attempts"] == LIMITS + 1, s
    stops = rundir.read_jsonl(rundir.RunPaths(d).stops)
    tls = timeline.read_all(rundir.RunPaths(d)).records
    assert [x["reason"] for x in stops] == ["timeout"] * LIMITS, stops
    for k, (stop, end) in enumerate(zip(stops, ends, strict=True)):
        # Saved and requeued before the end (without the watch, the stop comes when Slurm ends
        # the job for its time limit, up to 30 s after it, and only KillWait lets the save
        # through), begun by the job's own watch of it (or by Slurm's signal, when its check
        # every 30 s happened to come first: it signals up to 30 s early).
        assert stop["at"] < end, (k, stop, end)
        assert stop["how"] in ("end", "signal") and stop["end_at"] == end, stop
        assert stop["save_s"] >= 2, stop
        # Each attempt resumes at exactly the step the one before saved at its stop: no step lost.
        assert stop["attempt"] == k and tls[k + 1]["restored_step"] == stop["step"], (stop, tls)
        assert tls[k]["last_step"] == stop["step"] > tls[k]["restored_step"], (k, stop, tls[k])
    # Each a time-limit fault in status: back training from the disk checkpoint of its stop.
    assert [f["kind"] for f in s["faults"]] == ["time_limit"] * LIMITS, s["faults"]
    for f, stop in zip(s["faults"], stops, strict=True):
        assert (f["steps_lost"], f["restored_from"], f["restored_step"]) == (
            0,
            "shared",
            stop["step"],
        )
        assert f["how"] == stop["how"] and f["lost_s"] == pytest.approx(f["recovery_s"], abs=1e-3)
    for epoch in s["samples"]["epochs"]:  # each sample once per epoch
        ranges = sorted((r["start"], r["end"]) for r in epoch["ranges"])
        assert ranges[0][0] == 0 and ranges[-1][1] == epoch["samples"], epoch
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), epoch
    assert sha256(os.path.join(d, "model.pt")) == sha256(os.path.join(ref, "model.pt"))
