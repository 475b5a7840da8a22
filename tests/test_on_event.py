"""``observe.on_event``: the user's command on fail, stall, requeue and complete, run once per
event, never waited for. The real runs that fire each event are in test_training.py (requeued
and completed, with a command that hangs), test_status_truth.py (failed, with a command that
fails) and test_observe.py (stalled); this file checks the runner itself."""

import json
import logging
import os
import signal
import time

import pytest

from clusterflow import rundir
from clusterflow.config.job_config import differences, load
from clusterflow.errors import UserError
from clusterflow.observe import events


def notify_script(folder, hang_on=""):
    """A command that appends ``EVENT ATTEMPT RUN_DIR PID`` to ``folder/events.txt`` (and,
    for the event ``hang_on``, then sleeps for ten minutes: a command that hangs)."""
    script = os.path.join(folder, "notify.sh")
    with open(script, "w") as f:
        f.write(
            'echo "$CLUSTERFLOW_EVENT $CLUSTERFLOW_ATTEMPT $CLUSTERFLOW_RUN_DIR $$" '
            f'>> "{folder}/events.txt"\n'
            f'if [ "$CLUSTERFLOW_EVENT" = "{hang_on}" ]; then exec sleep 600; fi\n'
        )
    return f"sh {script}", os.path.join(folder, "events.txt")


def fired(target):
    """The lines the notify script appended: (event, attempt, run dir, pid)."""
    if not os.path.exists(target):
        return []
    return [tuple(line.split()) for line in open(target).read().splitlines()]


def end_hanging(lines):
    """Kill the commands of ``lines`` that still run (``sleep 600`` from notify_script)."""
    for *_, pid in lines:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _wait_for(fn, timeout=60):
    deadline = time.monotonic() + timeout
    while not fn():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_each_event_of_an_attempt_runs_the_command_once_whoever_sees_it(tmp_path):
    paths = rundir.RunPaths(str(tmp_path / "run"))
    command, target = notify_script(str(tmp_path))
    rank0 = events.OnEvent(command, paths, "rank 0 on n1")
    rank1 = events.OnEvent(command, paths, "rank 1 on n2")
    assert rank1.fire(events.FAILED, 3, "rank 1: ValueError: boom")
    assert not rank0.fire(events.FAILED, 3, "rank 0: connection closed")  # the same event
    assert rank0.fire(events.REQUEUED, 3, "requeued")  # another event of that attempt
    assert rank0.fire(events.FAILED, 4, "again")  # the same event of the next attempt
    rank0.settle(), rank1.settle()
    assert sorted(line[:3] for line in fired(target)) == [
        ("failed", "3", paths.root),
        ("failed", "4", paths.root),
        ("requeued", "3", paths.root),
    ]
    record = json.load(open(paths.event_file(3, events.FAILED)))
    assert record["by"] == "rank 1 on n2" and record["message"] == "rank 1: ValueError: boom"
    log = open(paths.event_log).read()
    assert log.count("== ") == 3 and "failed, attempt 3 (rank 1 on n2)" in log


def test_the_command_is_not_waited_for_and_settle_is_bounded(tmp_path):
    """fire returns while the command still waits for a file that only appears afterwards; a
    command that never ends is left running after settle's bound."""
    paths = rundir.RunPaths(str(tmp_path / "run"))
    gate, out = tmp_path / "gate", tmp_path / "out"
    on = events.OnEvent(
        f"while [ ! -e {gate} ]; do sleep 0.05; done; echo $CLUSTERFLOW_EVENT > {out}", paths
    )
    assert on.fire(events.COMPLETED, 0, "done")
    assert not out.exists() and on.started[0].poll() is None  # still waiting: not waited for
    gate.touch()
    on.settle()
    assert out.read_text() == "completed\n"
    hang = events.OnEvent("exec sleep 600", paths)
    assert hang.fire(events.STALLED, 0, "stalled")
    hang.settle(timeout_s=0.2)
    assert hang.started[0].poll() is None  # left to run: the process that fired it exits now
    hang.started[0].kill()
    hang.started[0].wait()


def test_the_jobs_signals_right_after_fire_do_not_end_the_command(tmp_path):
    """A rank that requeues its job fires ``requeued`` while Slurm already sends SIGTERM to every
    process of the job: the command, signalled (its whole session, every stop signal) the moment
    fire returns, still runs to its end; what it runs ignores them too, and a pipe still ends a
    writer quietly (SIGPIPE's default is back)."""
    paths = rundir.RunPaths(str(tmp_path / "run"))
    gate, out = tmp_path / "gate", tmp_path / "out"
    on = events.OnEvent(
        f"while [ ! -e {gate} ]; do sleep 0.05; done; "
        f"yes | head -n 1 > /dev/null; grep SigIgn /proc/self/status >> {out}; "
        f"echo $CLUSTERFLOW_EVENT >> {out}",
        paths,
    )
    assert on.fire(events.REQUEUED, 1, "requeued after the time-limit signal")
    session = on.started[0].pid  # its own session: the group's id is its pid
    for sig in events.JOB_SIGNALS:
        os.killpg(session, sig)
    gate.touch()
    on.settle(timeout_s=120)
    assert on.started[0].returncode == 0
    ignored, event = out.read_text().splitlines()
    mask = int(ignored.split()[1], 16)
    assert all(mask & (1 << (sig - 1)) for sig in events.JOB_SIGNALS), ignored
    assert not mask & (1 << (signal.SIGPIPE - 1)), ignored
    assert event == "requeued"


def test_a_failing_command_is_logged_and_changes_nothing_else(tmp_path, caplog):
    paths = rundir.RunPaths(str(tmp_path / "run"))
    on = events.OnEvent("echo about to fail; exit 3", paths)
    with caplog.at_level(logging.WARNING, logger="clusterflow.observe"):
        assert on.fire(events.FAILED, 0, "x")
        on.settle()
        _wait_for(lambda: "exited with 3" in caplog.text)
    assert "about to fail" in open(paths.event_log).read()


def test_no_command_no_event(tmp_path):
    paths = rundir.RunPaths(str(tmp_path / "run"))
    assert not events.OnEvent("", paths).fire(events.FAILED, 0, "x")
    assert not events.OnEvent("  ", paths).fire(events.COMPLETED, 0, "x")
    assert not os.path.exists(paths.events)


def test_the_command_may_change_on_resume_and_must_be_text(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("observe: {on_event: 'mail -s done me'}\n")
    saved = load(str(cfg)).to_dict()
    assert load(str(cfg)).observe.on_event == "mail -s done me"
    requested = load(str(cfg), ["observe.on_event=curl -d @- https://chat.example/hook"])
    assert differences(saved, requested.to_dict()) == []
    with pytest.raises(UserError, match="observe.on_event"):
        load(str(cfg), ["observe.on_event=a\0b"])
