"""The whole after-stop policy as a table, without a cluster (like submitit's
test_requeuing_checkpointable)."""

import os
import signal
import threading
import time

import pytest

from clusterflow.job.requeue import NO_SCONTROL, Action, decide
from clusterflow.slurm import commands as slurm_commands

LIMIT = 2
TABLE = [
    # outcome, source, slurm_state, timeouts so far (this one included) -> action
    ("completed", "slurm", "RUNNING", 0, Action("completed", "completed")),
    ("completed", "single", None, 0, Action("completed", "completed")),
    (
        "timeout",
        "slurm",
        "",
        1,
        Action("timeout", "requeued", requeue=True, why="the time-limit signal"),
    ),
    (
        "timeout",
        "torchrun",
        "",
        2,
        Action("timeout", "requeued", requeue=True, why="the time-limit signal"),
    ),
    (
        "timeout",
        "slurm",
        "",
        3,
        Action(
            "timeout",
            "stopped",
            error="time limit reached 3 times (cluster.max_timeout_requeues=2); "
            "resume by submitting the same config again",
        ),
    ),
    (
        "preempted",
        "slurm",
        "RUNNING",
        0,
        Action("preempted", "requeued", requeue=True, why="the preemption signal (SIGTERM)"),
    ),
    (
        "preempted",
        "slurm",
        "RUNNING",
        5,
        Action("preempted", "requeued", requeue=True, why="the preemption signal (SIGTERM)"),
    ),
    (
        "preempted",
        "slurm",
        "COMPLETING",
        0,
        Action("preempted", "requeued"),
    ),  # scontrol requeue under way
    ("preempted", "slurm", "CANCELLED", 0, Action("cancelled", "cancelled")),  # scancel
    ("preempted", "slurm", "", 0, Action("preempted", "requeued")),  # scontrol did not answer
    # a container without scontrol: the batch script outside requeues (exit 75)
    (
        "preempted",
        "slurm",
        NO_SCONTROL,
        0,
        Action("preempted", "requeued", requeue=True, why="the preemption signal (SIGTERM)"),
    ),
    # python train.py, torchrun outside Slurm: nobody requeues; the same command resumes
    ("preempted", "single", None, 0, Action("preempted", "stopped")),
    ("preempted", "torchrun", None, 0, Action("preempted", "stopped")),
    ("timeout", "torchrun", None, 9, Action("timeout", "stopped")),
    ("preempted", "submitit-local", None, 0, Action("preempted", "stopped")),
    ("timeout", "submitit-local", None, 1, Action("timeout", "stopped")),
    # a user's cancel or Ctrl-C: never requeued, whoever launched the job
    ("cancelled", "slurm", "", 0, Action("cancelled", "cancelled")),
    ("cancelled", "submitit-local", None, 0, Action("cancelled", "cancelled")),
    ("interrupted", "slurm", "", 0, Action("interrupted", "stopped")),
    ("interrupted", "submitit-local", None, 0, Action("interrupted", "stopped")),
]


@pytest.mark.parametrize(
    "outcome,source,slurm_state,timeouts,want",
    TABLE,
    ids=[f"{t[0]}-{t[1]}-{t[2]}-{t[3]}" for t in TABLE],
)
def test_decide(outcome, source, slurm_state, timeouts, want):
    assert decide(outcome, source, slurm_state, timeouts, LIMIT) == want


def test_after_stop_counts_time_limit_stops_in_one_place(tmp_path):
    """Outside Slurm nothing is requeued, but every stop is recorded; timeouts are counted from
    stops.jsonl only (the counter the decision reads)."""
    import json

    from clusterflow import rundir
    from clusterflow.distributed import DistEnv
    from clusterflow.job.requeue import after_stop

    paths = rundir.RunPaths(str(tmp_path))
    env = DistEnv.from_env({})
    assert after_stop(paths, "timeout", env, {}, LIMIT, {"signal_at": 12.5}) == "timeout"
    assert after_stop(paths, "preempted", env, {}, LIMIT) == "preempted"
    assert after_stop(paths, "completed", env, {}, LIMIT) == "completed"
    stops = [json.loads(line) for line in open(paths.stops)]
    assert [s["reason"] for s in stops] == ["timeout", "preempted"] and stops[0][
        "signal_at"
    ] == 12.5
    assert rundir.count_stops(paths, "timeout") == 1
    assert rundir.read_json(paths.status)["state"] == "completed"


INTERACTIVE = [
    # inside `salloc`: Slurm requeues batch jobs only, so a stop is a clean stop, never a failure
    ("timeout", "slurm", "", 1, Action("stopped", "stopped")),
    ("timeout", "slurm", "", 3, Action("stopped", "stopped")),
    ("preempted", "slurm", "RUNNING", 0, Action("stopped", "stopped")),
    ("timeout", "torchrun", "", 1, Action("stopped", "stopped")),
    ("cancelled", "slurm", "", 0, Action("cancelled", "cancelled")),
    ("interrupted", "slurm", "", 0, Action("interrupted", "stopped")),
    ("completed", "slurm", "", 0, Action("completed", "completed")),
]


@pytest.mark.parametrize(
    "outcome,source,slurm_state,timeouts,want",
    INTERACTIVE,
    ids=[f"{t[0]}-{t[1]}-{t[2]}-{t[3]}" for t in INTERACTIVE],
)
def test_decide_in_an_interactive_allocation(outcome, source, slurm_state, timeouts, want):
    assert decide(outcome, source, slurm_state, timeouts, LIMIT, interactive=True) == want


def test_without_scontrol_in_path_the_batch_script_is_asked_to_requeue(tmp_path, monkeypatch):
    """A job in a container without Slurm's commands: Slurm's commands hidden from PATH, the
    stop asks for a requeue from outside (run's exit status 75) instead of failing."""
    import shutil

    from clusterflow import rundir
    from clusterflow.distributed import DistEnv
    from clusterflow.errors import EXIT_REQUEUE_OUTSIDE
    from clusterflow.job.requeue import after_stop

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    marker = tmp_path / ".clusterflow-requeue-123"
    monkeypatch.setenv("CLUSTERFLOW_REQUEUE_MARKER", str(marker))  # as the batch templates set it
    assert shutil.which("scontrol") is None
    environ = {"SLURM_JOB_ID": "123", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    environ.update(SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_JOB_NODELIST="node1")
    environ.update(SLURM_JOB_NUM_NODES="1", SLURM_TASKS_PER_NODE="1")
    env = DistEnv.from_env(environ)
    assert env.source == "slurm"
    paths = rundir.RunPaths(str(tmp_path))
    assert after_stop(paths, "timeout", env, environ, LIMIT) == "requeue-outside"
    assert rundir.read_json(paths.status)["state"] == "requeued"
    assert marker.exists()  # the templates requeue on it whatever srun's exit status says
    marker.unlink()
    # Preempted (SIGTERM): saved, and the batch script is asked to requeue too; exiting 0 would
    # end the job as COMPLETED, never to come back.
    assert after_stop(paths, "preempted", env, environ, LIMIT) == "requeue-outside"
    assert rundir.read_json(paths.status)["state"] == "requeued" and marker.exists()
    assert EXIT_REQUEUE_OUTSIDE == 75  # what slurm_templates/train.sbatch tests for


# What `scontrol show job -o` said on the local cluster while a job's steps got their SIGTERM.
BATCH_KILLED = {"JobState": "COMPLETING", "Reason": "NonZeroExitCode", "Restarts": "0",
                "ExitCode": "137:0", "Requeue": "1"}  # fmt: skip
REQUEUING = {"JobState": "COMPLETING", "Reason": "None", "Restarts": "1", "ExitCode": "0:0"}
# ... after a plain scancel (the cancel's SIGTERM ended the batch script), and after a `kill` of
# the batch script (SIGTERM too, but Slurm names a failed launch).
SCANCELLED = {"JobState": "COMPLETING", "Reason": "None", "Restarts": "0", "ExitCode": "0:15"}
TERM_KILLED = {**SCANCELLED, "Reason": "JobLaunchFailure"}
ENDS = (
    "Slurm ends job 7 without requeueing it (JobState COMPLETING, ExitCode 137:0, Reason "
    "NonZeroExitCode; Restarts 0)"
)


@pytest.mark.parametrize(
    "fields, restart_count, expected",
    [
        # the batch script died (SIGKILL): the job ends FAILED, no requeue counted
        (BATCH_KILLED, 0, ENDS),
        # scontrol requeue (or a preemption's requeue): Restarts counted beyond this attempt
        (REQUEUING, 0, None),
        ({**BATCH_KILLED, "Restarts": "2"}, 2, ENDS.replace("Restarts 0", "Restarts 2")),
        ({**BATCH_KILLED, "JobState": "FAILED"}, 0, ENDS.replace("COMPLETING", "FAILED")),
        ({**BATCH_KILLED, "JobState": "RUNNING"}, 0, None),  # a preemption's grace time
        ({**BATCH_KILLED, "JobState": "PENDING"}, 0, None),
        ({**BATCH_KILLED, "JobState": "CANCELLED"}, 0, None),  # scancel: cancelled, not failed
        (SCANCELLED, 0, None),  # scancel, as the job's own ranks see it
        (
            TERM_KILLED,
            0,
            ENDS.replace("137:0", "0:15").replace("NonZeroExitCode", "JobLaunchFailure"),
        ),
        ({**BATCH_KILLED, "Restarts": ""}, 0, None),  # Slurm did not say
        ({}, 0, None),  # scontrol did not answer
    ],
)
def test_slurm_says_when_it_ends_a_job_without_a_requeue(fields, restart_count, expected):
    from clusterflow.slurm.commands import not_requeued

    assert not_requeued("7", fields, restart_count) == expected


@pytest.mark.parametrize(
    "fields, restart_count, expected",
    [
        (SCANCELLED, 0, True),
        ({**SCANCELLED, "JobState": "CANCELLED"}, 0, True),
        ({**SCANCELLED, "Restarts": "2"}, 1, False),  # a requeue counted beyond this attempt
        ({**SCANCELLED, "Restarts": "2"}, 2, True),  # ... or up to it: this attempt's own
        (TERM_KILLED, 0, False),  # the batch script killed with SIGTERM
        (BATCH_KILLED, 0, False),
        (REQUEUING, 0, False),
        ({**SCANCELLED, "JobState": "RUNNING"}, 0, False),  # scancel --signal: still running
        ({}, 0, False),
    ],
)
def test_a_plain_scancel_is_told_from_the_fields_the_jobs_ranks_see(
    fields, restart_count, expected
):
    from clusterflow.slurm.commands import cancelled

    assert cancelled(fields, restart_count) is expected


@pytest.mark.parametrize(
    "slurm_state, ends, want",
    [
        (
            "COMPLETING",
            ENDS,
            Action(
                "failed", "failed", error=f"{ENDS}: the SIGTERM was the job's end, not a preemption"
            ),
        ),
        ("COMPLETING", None, Action("preempted", "requeued")),  # a requeue counted
        (
            "RUNNING",
            ENDS,
            Action("preempted", "requeued", requeue=True, why="the preemption signal (SIGTERM)"),
        ),
        ("CANCELLED", ENDS, Action("cancelled", "cancelled")),  # scancel
    ],
)
def test_a_sigterm_that_ends_the_job_for_good_is_a_failure_not_a_requeue(slurm_state, ends, want):
    assert decide("preempted", "slurm", slurm_state, 0, LIMIT, ends=ends) == want


def test_after_stop_names_the_command_that_resumes_a_job_slurm_does_not_requeue(
    tmp_path, monkeypatch
):
    """The ranks' SIGTERM came from their batch step's death: state failed, the cause and the
    resume command in status.json, the run dir let go of (a resubmission may take it)."""
    from clusterflow import rundir
    from clusterflow.distributed import DistEnv
    from clusterflow.job.requeue import after_stop
    from clusterflow.slurm import commands

    monkeypatch.setattr(commands, "job_fields", lambda job_id, timeout_s=30: BATCH_KILLED)
    monkeypatch.setattr(commands, "is_batch", lambda job_id, timeout_s=30: True)
    monkeypatch.setattr(commands, "available", lambda name: True)
    environ = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    environ.update(SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_JOB_NODELIST="node1")
    environ.update(SLURM_JOB_NUM_NODES="1", SLURM_TASKS_PER_NODE="1")
    paths = rundir.RunPaths(str(tmp_path))
    assert after_stop(
        paths, "preempted", DistEnv.from_env(environ), environ, LIMIT, {"signal_at": 1.0}
    ) == ("failed")
    st = rundir.read_json(paths.status)
    assert st["state"] == "failed", st
    assert st["error"] == (
        f"{ENDS}: the SIGTERM was the job's end, not a preemption; resume from its newest "
        f"checkpoint with: python -m clusterflow.submit {tmp_path}/config.yaml"
    )
    assert [s["reason"] for s in rundir.read_jsonl(paths.stops)] == ["preempted"]


def _fake_scontrol(folder):
    """An ``scontrol`` that writes its pid, works for a second and then succeeds: time for the
    test to send it the SIGTERM that Slurm sends every process of a job it requeues."""
    folder.mkdir()
    script = folder / "scontrol"
    script.write_text(
        '#!/bin/sh\necho $$ > "$(dirname "$0")/pid"\nsleep 1\necho "did $*"\n', encoding="utf-8"
    )
    script.chmod(0o755)
    return folder / "pid"


def _term_when_started(pid_file):
    def send():
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text().strip():
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        os.kill(int(pid_file.read_text()), signal.SIGTERM)

    t = threading.Thread(target=send)
    t.start()
    return t


@pytest.mark.parametrize("on_main_thread", [True, False])
def test_a_requeue_outlives_the_sigterm_slurm_sends_the_job_it_requeues(
    tmp_path, monkeypatch, on_main_thread
):
    """``scontrol requeue`` is a process of the job it requeues, and Slurm's SIGTERM to the job
    reaches it: the command still ends with its own answer (not killed: a requeue that happened
    read as one that failed), from the job's main thread as from the watchdog's."""
    pid_file = _fake_scontrol(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    out = {}
    sender = _term_when_started(pid_file)
    if on_main_thread:
        out["r"] = slurm_commands.requeue("123_1")
    else:
        worker = threading.Thread(target=lambda: out.update(r=slurm_commands.requeue("123_1")))
        worker.start()
        worker.join()
    sender.join()
    assert out["r"].ok and out["r"].stdout == "did requeue 123_1\n", out["r"]
    # the same command run as a question (no requeue) dies of the signal, as any process would
    pid_file.unlink()
    sender = _term_when_started(pid_file)
    asked = slurm_commands.run(["scontrol", "show", "job"], 30)
    sender.join()
    assert asked.returncode == -signal.SIGTERM, asked
