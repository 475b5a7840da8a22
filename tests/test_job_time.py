"""The job's time as status reads it from squeue (one call for every job asked), the run's own
estimate of its end, and the job's own watch of Slurm's end against its measured saves; the real
cluster's answers are checked in test_slurm_job_time.py."""

import signal

import pytest
import torch

from clusterflow import rundir
from clusterflow.checkpoint.checkpointer import STEP, Checkpointer
from clusterflow.checkpoint.train_state import TrainState
from clusterflow.config.job_config import load
from clusterflow.manage import status
from clusterflow.observe.context import JobContext
from clusterflow.rundir import timeline
from clusterflow.rundir.states import StopHow, StopReason
from clusterflow.slurm import commands
from clusterflow.train import preemption


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


# -- the job's own end: read from Slurm, weighed against its saves ------------------------------


def test_the_jobs_end_is_slurms_end_time_asked_again_at_each_call(fake_slurm):
    fields = "JobId=7 JobState=RUNNING TimeLimit=00:10:00 StartTime=2026-01-02T10:00:00"
    fake_slurm.answer("scontrol", stdout=f"{fields} EndTime=2026-01-02T10:10:00\n")
    end = commands.job_end("7")
    assert end.end_at == commands.slurm_time("2026-01-02T10:10:00") and end.limit == "00:10:00"
    # An admin's `scontrol update JobId=7 EndTime=...` (or TimeLimit=...): the next call sees it.
    fake_slurm.answer("scontrol", stdout=f"{fields} EndTime=2026-01-02T10:04:30\n")
    assert commands.job_end("7").end_at == commands.slurm_time("2026-01-02T10:04:30")
    assert fake_slurm.calls() == ["scontrol show job -o 7"] * 2
    unlimited = "JobId=7 JobState=RUNNING TimeLimit=UNLIMITED EndTime=Unknown\n"
    fake_slurm.answer("scontrol", stdout=unlimited)
    assert commands.job_end("7") == commands.JobEnd(None, "UNLIMITED")
    fake_slurm.answer("scontrol", stderr="slurm_load_jobs error: Unable to contact\n", code=1)
    assert commands.job_end("7") is None  # no answer: the watch keeps the end it knew


class _Clock:
    def __init__(self, now):
        self.now = now

    def __call__(self):
        return self.now


def _watch(end_at, clock, save_s=3.0, margin_s=5.0):
    answers = [commands.JobEnd(end_at, "0:10:00")]
    watch = preemption.EndWatch(lambda: answers[-1], every_s=60, margin_s=margin_s, clock=clock)
    watch.measure_saves(lambda: save_s)
    watch.ask()
    return watch, answers


def test_an_end_closer_than_two_saves_and_the_margin_stops_the_run_for_the_time_limit():
    """Two saves (the write in flight, then the stop's own) plus the margin: 3 s + 3 s + 5 s."""
    clock = _Clock(1000.0)
    watch, answers = _watch(1600.0, clock)
    stop = preemption.Preemption(end=watch)
    assert watch.needed_s() == 11 and not stop.requested and stop.reason() == ""
    clock.now = 1588.0  # 12 s left
    assert not stop.requested
    # The admin brings the end forward; the watch sees it at its next question to Slurm.
    answers.append(commands.JobEnd(1598.0, "0:10:00"))
    watch.ask()
    assert watch.end_at == 1598.0
    assert stop.requested and stop.reason() == StopReason.TIMEOUT
    assert "10.0 s away, closer than two saves (3.0 s each" in watch.said, watch.said
    answers.append(commands.JobEnd(1900.0, "0:15:00"))  # extended after the stop was decided:
    watch.ask()
    assert stop.reason() == StopReason.TIMEOUT  # the ranks may have agreed already: it stays
    said = stop.stop_record(StopReason.TIMEOUT)
    assert said == {
        "signal_at": None,
        "how": StopHow.END,
        "end_at": 1900.0,
        "save_s": 3.0,
        "due_at": 1588.0,
    }
    assert stop.stop_record(StopReason.PREEMPTED) == {"signal_at": None}


def test_a_signal_with_the_end_near_keeps_its_own_reason():
    """A SIGTERM near the end stays a preemption (it may be Slurm's own requeue under way, which
    a second requeue would fail), and Ctrl-C still wins."""
    clock = _Clock(1000.0)
    watch, _ = _watch(1005.0, clock)
    stop = preemption.Preemption(end=watch)
    assert stop.reason() == StopReason.TIMEOUT
    stop._handle(signal.SIGTERM, None)
    assert stop.reason() == StopReason.PREEMPTED and stop.requested
    stop._handle(signal.SIGINT, None)
    assert stop.reason() == StopReason.INTERRUPTED
    # Slurm's signal before the end came near: the signal began the stop.
    early = preemption.Preemption(end=_watch(1600.0, clock)[0])
    early._handle(signal.SIGUSR2, None)
    assert early.stop_record(StopReason.TIMEOUT)["how"] == StopHow.SIGNAL
    # No end known (no time limit, or Slurm never answered): only the signals count.
    assert not preemption.Preemption(end=_watch(None, clock)[0]).requested


def test_a_save_takes_what_the_checkpointer_measured_else_what_an_earlier_attempt_did(tmp_path):
    cfg = load(None, [f"run.dir={tmp_path}", "checkpoint.every_steps=1", "checkpoint.async=false"])
    paths = rundir.RunPaths(cfg.run.dir)
    timeline.write(paths, {"attempt": 0, "write_s": 7.5})
    model = torch.nn.Linear(3, 2)
    state = TrainState()
    seen = []
    ck = Checkpointer(
        JobContext(cfg, paths),
        model,
        {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1)},
        state,
        steps_per_epoch=100,
        after_commit=lambda step, seconds: seen.append(seconds),
    )
    assert ck.save_s() == 7.5  # nothing measured in this attempt yet
    state.step_done()
    ck.save(STEP)
    (measured,) = seen
    assert 0 < measured < 7.5 and ck.save_s() == measured
