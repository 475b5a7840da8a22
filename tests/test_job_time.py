"""The job's time as status reads it from squeue (one call for every job asked), and the run's
own estimate of its end; the real cluster's answers are checked in test_slurm_job_time.py."""

import pytest

from clusterflow.manage import status
from clusterflow.slurm import commands


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("0:31", 31),
        ("10:00", 600),
        ("1:00:00", 3600),
        ("1-02:03:04", 93784),
        ("1-02:03", 93780),
        ("2-5", 2 * 86400 + 5 * 3600),
        ("90", 5400),  # a bare number is minutes, as sbatch --time reads it
        ("UNLIMITED", None),
        ("NOT_SET", None),
        ("INVALID", None),
        ("N/A", None),
        ("", None),
        ("-5", None),
        ("1:2:3:4", None),
    ],
)
def test_slurm_durations(text, seconds):
    assert commands.slurm_duration(text) == seconds


def test_one_squeue_call_answers_every_job_with_its_times(fake_slurm):
    fake_slurm.answer(
        "squeue",
        stdout="41|RUNNING|None|1:00:00|12:30|47:30|2026-01-02T10:00:00|2|node[1-2]|(null)\n"
        "42|PENDING|Resources|2-00:00:00|0:00|2-00:00:00|2026-01-02T11:30:00|4||node[3-6]\n"
        "43_7|PENDING|BeginTime|UNLIMITED|0:00|UNLIMITED|N/A|1||(null)\n"
        "garbage without fields\n",
    )
    jobs = commands.queued_jobs(["42", "41", "43_7", "44", "local"])
    (call,) = fake_slurm.calls()
    assert call.startswith("squeue -h -r -j 41,42,43_7,44 -o ")
    running, pending, array = jobs["41"], jobs["42"], jobs["43_7"]
    assert (running.state, running.time_limit_s, running.elapsed_s, running.left_s) == (
        "RUNNING",
        3600,
        750,
        2850,
    )
    assert running.nodes == "node[1-2]" and running.node_count == 2 and not running.scheduled_nodes
    assert pending.reason == "Resources" and pending.scheduled_nodes == "node[3-6]"
    assert pending.start_at == commands.slurm_time("2026-01-02T11:30:00")
    assert (
        array.start_at is None and array.time_limit_s is None and array.line == "PENDING|BeginTime"
    )
    assert jobs["44"] is None and "local" not in jobs  # not listed; not a Slurm id
    assert commands.queue_states(["41", "44"]) == {"41": "RUNNING|None", "44": ""}


def test_a_queue_asks_once_per_job_and_says_when_squeue_does_not_answer(fake_slurm):
    fake_slurm.answer("squeue", stdout="7|RUNNING|None|10:00|1:00|9:00|N/A|1|n1|(null)\n")
    q = commands.Queue()
    assert q.state("7") == "RUNNING|None" and q.job("7").left_s == 540
    assert q.state("local-3") is None  # not a Slurm job: squeue is not asked
    assert len(fake_slurm.calls()) == 1
    fake_slurm.answer("squeue", stderr="slurm_load_jobs error: Unable to contact", code=1)
    assert commands.Queue().state("7") is None and commands.Queue().job("7") is None
    fake_slurm.forgot_every_job()
    assert commands.Queue().state("7") == ""


def _running(**more):
    ranks = [
        {"rank": r, "phase": "train", "silent": False, "step_time_s": t}
        for r, t in enumerate([0.5, 0.4, 0.6, 3.0])
    ]
    return {"state": "running", "epoch": 1, "step_in_epoch": 4, "steps_per_epoch": 10,
            "ranks": ranks, **more}  # fmt: skip


def test_the_runs_own_estimate_is_the_steps_left_at_the_median_step_time():
    assert status._finish(_running(), epochs=3) == {"steps_left": 16, "eta_s": 16 * 0.6}
    stopped = status._finish(_running(state="requeued"), epochs=3)
    assert stopped == {"steps_left": 16, "eta_s": None}  # no throughput while it does not train
    assert status._finish(_running(), epochs=None) == {"steps_left": None, "eta_s": None}
    quiet = _running(ranks=[{"rank": 0, "phase": "train", "silent": True, "step_time_s": 1.0}])
    assert status._finish(quiet, epochs=3)["eta_s"] is None
    assert status.hms(93784.4) == "1-2:03:04" and status.hms(59) == "0:00:59"
