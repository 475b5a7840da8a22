"""The goodput ledger and the straggler watch: pure checks over written records, then real 2-rank
local runs: one killed and resumed with no slow rank and one with rank 1 made three times as slow
per step (each shared by every assertion on it), and one launch that dies in start-up."""

import json
import os
import socket
import subprocess
import sys
import time

import clihelp
import launch
import pytest
import torch
from conftest import REPO, run_cli

from clusterflow import rundir
from clusterflow.checkpoint.checkpointer import STEP, Checkpointer
from clusterflow.checkpoint.train_state import TrainState
from clusterflow.config.job_config import load
from clusterflow.errors import UserError
from clusterflow.goodput import main as goodput_main
from clusterflow.manage import status as status_command
from clusterflow.observe import goodput, phases
from clusterflow.observe.context import JobContext
from clusterflow.observe.stragglers import StragglerWatch
from clusterflow.observe.timeline import AttemptTimeline
from clusterflow.rundir import faults, first_error, stragglers, timeline
from clusterflow.rundir.states import Cause

WINDOW_S = 2.0
# The test tasks (tests/testtasks.py) on the path of every process a run starts.
ENV = {
    "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "tests"), os.environ.get("PYTHONPATH", "")])
}
TASK = (
    "task.target=testtasks:SlowRankKill",
    "checkpoint.async=false",
    "dist.heartbeat_s=0.5",
    f"observe.straggler_window_s={WINDOW_S}",
)


def _sums_to_wall(row):
    parts = row["seconds"]
    assert all(v >= 0 for v in parts.values()), parts
    assert sum(parts.values()) == pytest.approx(row["wall_s"], rel=0.01, abs=1e-6)


# -- pure: the ledger over records written by hand --------------------------------------------


def _records(d, attempts, timelines):
    paths = rundir.RunPaths(str(d))
    os.makedirs(d, exist_ok=True)
    open(paths.config, "w").close()
    for a in attempts:
        rundir.append_jsonl(paths.attempts, a)
    for tl in timelines:
        timeline.write(paths, tl)
    return paths


def test_an_in_job_restart_is_its_own_attempt_with_no_queue_and_slurm_times_are_used(tmp_path):
    """Two attempts in one Slurm job and one Slurm run (a new srun step): the second starts when
    the first ended, its steps up to the first's last recorded step are recomputed."""
    job = {"job_id": "42", "source": "slurm", "restart_count": 0, "world_size": 4}
    paths = _records(
        tmp_path / "run",
        [{**job, "attempt": 0, "started_at": 1005.0}, {**job, "attempt": 1, "started_at": 1105}],
        [
            {
                "attempt": 0,
                "process_started_at": 1002.0,
                "restored_step": 0,
                "restore_s": 0.0,
                "first_step_at": 1010.0,
                "last_step": 50,
                "written_at": 1090.0,
                "seconds": {"train": 60.0, "eval": 5.0, "mining": 10.0, "checkpoint": 5.0},
                "commit": {
                    "step": 40,
                    "at": 1080.0,
                    "seconds": {"train": 50.0, "eval": 5.0, "mining": 10.0, "checkpoint": 4.0},
                },
            },
            {
                "attempt": 1,
                "process_started_at": 1100.0,
                "restored_step": 40,
                "restore_s": 3.0,
                "first_step_at": 1110.0,
                "last_step": 100,
                "written_at": 1170.0,
                "ended_at": 1170.0,
                "outcome": "completed",
                "seconds": {"train": 60.0},
            },
        ],
    )
    rundir.append_jsonl(paths.submissions, {"job_id": "42", "submitted_at": 900.0})
    runs = {"42": [{"restart": 0, "submit": 900, "start": 1000, "end": 1175, "source": "sacct"}]}
    book = goodput.ledger(paths, runs, running=False)
    first, second = book["attempts"]
    for row in (first, second):
        _sums_to_wall(row)
    assert first["seconds"]["queue_wait"] == 100  # submitted at 900, Slurm started it at 1000
    assert first["seconds"]["startup"] == 10  # to its first step at 1010
    # Killed after its last record (1090): no end of its own, the next attempt starts there.
    assert first["wall_s"] == 190 and first["seconds"]["other"] == 0
    assert first["seconds"]["eval"] == 5 and first["seconds"]["mining"] == 10
    # A checkpoint second after its last commit was work no attempt kept; steps 41-50 were
    # progress then, and are the next attempt's recomputed steps (counted once, there).
    assert first["seconds"]["lost"] == 1 and first["seconds"]["productive"] == 60
    assert second["seconds"]["queue_wait"] == 0
    assert second["sources"]["allocated"].startswith("previous attempt's end")
    assert second["seconds"]["restore"] == 3
    assert second["seconds"]["startup"] == 20 - 3  # 1090 -> 1110, less the restore
    assert second["steps"] == {
        "restored": 40,
        "last": 100,
        "committed": 40,
        "recomputed": 10,
        "lost": 0,
    }
    assert second["seconds"]["recomputed"] == pytest.approx(10)  # 10 of 60 steps of 60 s
    assert second["seconds"]["shutdown"] == 5  # 1170 -> Slurm's end 1175
    assert second["sources"]["ended"] == "sacct"
    total = book["total"]
    assert total["wall_s"] == 275  # from the submission to Slurm's end
    assert total["ratio"] == pytest.approx((first["seconds"]["productive"] + 50) / (275 - 100))


def test_clocks_that_disagree_never_make_a_negative_part(tmp_path):
    """A first step recorded before the process started and phases longer than the span: each
    instant is clamped between its neighbours and the phases scaled; the rest is explicit."""
    paths = _records(
        tmp_path / "run",
        [{"attempt": 0, "started_at": 100.0, "source": "local", "world_size": 1}],
        [
            {
                "attempt": 0,
                "process_started_at": 100.0,
                "first_step_at": 90.0,
                "last_step": 10,
                "written_at": 110.0,
                "ended_at": 110.0,
                "outcome": "completed",
                "seconds": {"train": 30.0, "eval": 10.0},
            }
        ],
    )
    (row,) = goodput.ledger(paths, running=False)["attempts"]
    _sums_to_wall(row)
    assert row["seconds"]["startup"] == 0
    assert row["seconds"]["productive"] + row["seconds"]["eval"] == pytest.approx(10)


def _logged(paths, attempt, at, ranks=(0, 1)):
    """Rank logs of ``attempt`` last written at ``at`` (their modification time)."""
    os.makedirs(paths.logs, exist_ok=True)
    for r in ranks:
        with open(paths.log_file(r, attempt), "a") as f:
            f.write("a line\n")
        os.utime(paths.log_file(r, attempt), (at, at))


LOCAL = {"source": "local", "world_size": 2, "job_id": "7"}


@pytest.mark.parametrize("damage", [b"", b"\x00\xff not json", b'{"attempt": 0, "first_step'])
def test_a_damaged_timeline_is_named_and_its_time_is_other_not_start_up(tmp_path, damage):
    """A timeline that is empty, garbage or cut short: named where damaged records are named
    (the ledger's and status's ``damaged_records``), and the attempt's time from its processes'
    start to its end, which the record would have split, is ``other``: not start-up."""
    paths = _records(
        tmp_path / "run",
        [{**LOCAL, "attempt": 0, "started_at": 104.0, "process_started_at": 100.0}],
        [],
    )
    os.makedirs(paths.timelines, exist_ok=True)
    with open(paths.timeline_file(0), "wb") as f:
        f.write(damage)
    _logged(paths, 0, 123.0)
    book = goodput.ledger(paths, running=False, now=200.0)
    (row,) = book["attempts"]
    _sums_to_wall(row)
    assert row["wall_s"] == 23 and row["seconds"]["other"] == 23, row["seconds"]
    assert row["seconds"]["startup"] == 0 and row["ratio"] == 0
    named = [w for w in book["damaged_records"] if w.startswith("timeline/attempt0.json")]
    assert named, book["damaged_records"]
    from clusterflow.manage import status

    shown = status.collect(paths)["damaged_records"]
    assert any(w.startswith("timeline/attempt0.json") for w in shown), shown
    # `goodput` says where that time went, as a warning beside the table and beside --json.
    said = "warning: attempt 0: 23.0 s of its 23.0 s allocated are counted as other, since its "
    code, out, err = clihelp.call(goodput_main, [paths.root])
    assert code == 0 and said + "timeline is damaged and cannot split them (timeline/" in out, out
    code, out, err = clihelp.call(goodput_main, [paths.root, "--json"])
    assert code == 0 and json.loads(out)["warnings"] and said in err, err


def test_an_attempt_that_failed_in_start_up_counts_from_its_processes_start(tmp_path):
    """No timeline (it died before its first step): its start-up runs from the earliest start of
    its ranks' processes (attempts.jsonl), not from the moment rank 0 recorded the attempt."""
    paths = _records(
        tmp_path / "run",
        [{**LOCAL, "attempt": 0, "started_at": 112.8, "process_started_at": 100.0}],
        [],
    )
    _logged(paths, 0, 113.0)
    (row,) = goodput.ledger(paths, running=False, now=200.0)["attempts"]
    _sums_to_wall(row)
    assert row["seconds"]["startup"] == pytest.approx(13.0) and row["wall_s"] == pytest.approx(13)
    assert row["sources"]["allocated"] == "attempts.jsonl (process start)"
    assert row["wall_s"] == pytest.approx(row["seconds"]["queue_wait"] + row["ended_at"] - 100.0)
    assert row["outcome"] is None and row["steps"]["last"] == 0


def _killed_then_completed(d, restored=8):
    """Attempt 0 killed after its last record at 120 (commit at step 8, last step 11), attempt 1
    resumed from step ``restored``, its processes started at 130, completed at 160."""
    return _records(
        d,
        [
            {**LOCAL, "attempt": 0, "started_at": 102.0, "process_started_at": 100.0},
            {**LOCAL, "attempt": 1, "started_at": 132.0, "process_started_at": 130.0},
        ],
        [
            {
                "attempt": 0,
                "process_started_at": 100.0,
                "first_step_at": 105.0,
                "last_step": 11,
                "written_at": 120.0,
                "seconds": {"train": 11.0, "eval": 1.0, "mining": 2.0, "checkpoint": 1.0},
                # The end of epoch 2 (eval, mining) came after the commit of step 8.
                "commit": {"step": 8, "at": 117.0, "seconds": {"train": 8.0, "checkpoint": 0.5}},
            },
            {
                "attempt": 1,
                "process_started_at": 130.0,
                "restored_step": restored,
                "restore_s": 1.0,
                "first_step_at": 135.0,
                "last_step": 18,
                "written_at": 160.0,
                "ended_at": 160.0,
                "outcome": "completed",
                "seconds": {"train": 20.0},
            },
        ],
    )


def test_a_copied_run_dir_gets_no_copy_time(tmp_path):
    """``cp -r`` gives every file the copy's time: a recorded end (``ended_at``) is trusted over
    the rank logs' modification time, and a killed attempt's log time later than the next
    attempt's start is the copy's: the attempt ends at its last record, as in the original."""
    original = _killed_then_completed(tmp_path / "run")
    _logged(original, 0, 125.0)  # killed 5 s after its last record
    _logged(original, 1, 160.5)
    copy = _killed_then_completed(tmp_path / "copy")
    for n in (0, 1):
        _logged(copy, n, 5000.0)  # the copy, an hour and more later
    first, second = goodput.ledger(copy, running=False, now=6000.0)["attempts"]
    for row in (first, second):
        _sums_to_wall(row)
    # Killed: the eval, mining and save after its commit are lost; no copy time.
    assert first["ended_at"] == 120.0 and first["seconds"]["lost"] == pytest.approx(3.5)
    assert first["sources"]["ended"] == "timeline"
    assert second["ended_at"] == 160.0 and second["seconds"]["shutdown"] == 0
    assert second["wall_s"] == 40 and second["sources"]["ended"] == "timeline"
    # The original: the logs tell when the killed attempt's processes died (5 s lost more).
    first, second = goodput.ledger(original, running=False, now=6000.0)["attempts"]
    assert first["ended_at"] == 125.0 and first["seconds"]["lost"] == pytest.approx(5 + 3.5)
    assert first["sources"]["ended"] == "rank logs (last line)"
    assert second["ended_at"] == 160.0 and second["seconds"]["shutdown"] == 0


def test_a_timeline_that_lags_its_own_last_commit_is_corrected_by_the_next_restore(tmp_path):
    """Killed between committing step 12 and recording it: the next attempt resumed from step
    12, so the killed one committed it; its eval and mining before that commit were kept."""
    paths = _killed_then_completed(tmp_path / "run", restored=12)
    first, second = goodput.ledger(paths, running=False, now=6000.0)["attempts"]
    for row in (first, second):
        _sums_to_wall(row)
    assert first["seconds"]["eval"] == 1 and first["seconds"]["mining"] == 2
    assert first["seconds"]["lost"] == 0
    assert first["steps"]["committed"] == 12 and first["steps"]["last"] == 12
    assert second["steps"]["recomputed"] == 0 and second["steps"]["restored"] == 12
    # Each of the run's 18 steps is productive in exactly one attempt.
    kept = [r["steps"] for r in (first, second)]
    assert sum(s["last"] - s["restored"] - s["recomputed"] - s["lost"] for s in kept) == 18, kept
    assert first["seconds"]["productive"] > 0 and second["outcome"] == "completed"


@pytest.mark.parametrize("outcome", ["failed", None])
@pytest.mark.parametrize("committed", [True, False])
def test_eval_and_mining_an_attempt_abandoned_are_lost(tmp_path, outcome, committed):
    """An attempt that ended without completing (a failure ends the loop with a record; a kill
    leaves none) and a restart inside the job resumed from its last commit, or from where it had
    started itself when it committed nothing: its eval, mining and saves after that commit are
    lost, not useful."""
    job = {"job_id": "42", "source": "slurm", "restart_count": 0, "world_size": 2}
    done = {"train": 20.0, "eval": 4.0, "mining": 6.0, "checkpoint": 1.0}
    first = {
        "attempt": 0,
        "process_started_at": 1000.0,
        "restored_step": 0,
        "first_step_at": 1010.0,
        "last_step": 20,
        "written_at": 1045.0,
        "seconds": done,
    }
    if committed:
        first["commit"] = {"step": 10, "at": 1025.0, "seconds": {"train": 10.0, "checkpoint": 0.5}}
    if outcome:
        first.update(outcome=outcome, ended_at=1046.0)
    second = {
        "attempt": 1,
        "process_started_at": 1050.0,
        "restored_step": 10 if committed else 0,
        "first_step_at": 1060.0,
        "last_step": 40,
        "written_at": 1100.0,
        "ended_at": 1100.0,
        "outcome": "completed",
        "seconds": {"train": 40.0},
    }
    paths = _records(
        tmp_path / "run",
        [{**job, "attempt": 0, "started_at": 1001.0}, {**job, "attempt": 1, "started_at": 1051}],
        [first, second],
    )
    row = goodput.ledger(paths, running=False, now=2000.0)["attempts"][0]
    _sums_to_wall(row)
    assert row["seconds"]["eval"] == 0 and row["seconds"]["mining"] == 0, row["seconds"]
    after_ckpt = 0.5 if committed else 1.0
    assert row["seconds"]["checkpoint_stall"] == pytest.approx(1.0 - after_ckpt)
    assert row["seconds"]["lost"] == pytest.approx(4 + 6 + after_ckpt)


def test_negative_seconds_in_a_timeline_are_named_and_never_make_a_negative_part(tmp_path):
    """A timeline that is valid JSON but holds negative durations: each is named as damaged and
    ignored; no part is negative."""
    paths = _records(
        tmp_path / "run",
        [{**LOCAL, "attempt": 0, "started_at": 101.0}],
        [
            {
                "attempt": 0,
                "process_started_at": 100.0,
                "restored_step": 0,
                "restore_s": -50.0,
                "first_step_at": 110.0,
                "last_step": 10,
                "written_at": 130.0,
                "ended_at": 130.0,
                "outcome": "completed",
                "seconds": {"train": -30.0, "eval": 5.0},
                "commit": {"step": 10, "at": 129.0, "seconds": {"train": -1.0}},
            }
        ],
    )
    book = goodput.ledger(paths, running=False, now=200.0)
    (row,) = book["attempts"]
    _sums_to_wall(row)
    said = " | ".join(book["damaged_records"])
    for field in ("restore_s", "seconds", "commit"):
        assert f"timeline/attempt0.json: {field} is " in said, said
    assert row["seconds"]["startup"] == 10 and row["seconds"]["other"] == 20


# -- each attempt's fault, and what the ledger charges it --------------------------------------

JOB = {"job_id": "7", "source": "slurm", "world_size": 2}


def _trained(n, restored=0, last=None, tier=None, outcome=None, **more):
    """Attempt n's timeline: restored at 1000 + 100 n + 5, first step 10 s later, one step a
    second up to ``last``."""
    last = restored + 10 if last is None else last
    tl = {
        "attempt": n,
        "job_id": "7",
        "world_size": 2,
        "process_started_at": 1000.0 + 100 * n,
        "restored_step": restored,
        "first_step_at": 1000.0 + 100 * n + 15,
        "last_step": last,
        "written_at": 1000.0 + 100 * n + 15 + (last - restored),
        "seconds": {"train": float(last - restored)},
        **({"restored_from": tier[0], "restored_where": tier[1]} if tier else {}),
        **({"outcome": outcome, "ended_at": 1000.0 + 100 * n + 60} if outcome else {}),
        **more,
    }
    return tl


def _faulty_run(d):
    """Eleven attempts of one Slurm job, each ended by a fault as its witness records it (but
    attempt 9, which the user stopped after its fault's note); the last completes."""
    paths = _records(
        d,
        [
            {**JOB, "attempt": n, "restart_count": n, "started_at": 1000.0 + 100 * n}
            for n in range(12)
        ],
        [
            _trained(0, last=12),
            _trained(1, restored=12, tier=("memory", "memory of node1")),
            _trained(2, restored=20, tier=("replica", "replica of node1 on node3")),
            _trained(3, restored=30, tier=("shared", "shared filesystem"), outcome="timeout"),
            _trained(4, restored=40, outcome="preempted"),
            _trained(5, restored=50, outcome="preempted"),
            _trained(6, restored=60),
            _trained(7, restored=64),
            _trained(8, restored=70),
            _trained(9, restored=70, outcome="interrupted"),
            _trained(10, restored=80, last=90),
            _trained(11, restored=88, last=95, outcome="completed"),
        ],
    )
    restart = {"event": "restart", "job_id": "7", "restart": 1}
    rundir.append_jsonl(
        paths.restarts,
        {**restart, "failed_attempt": 0, "next_attempt": 1, "cause": "crash", "rank": 1,
         "host": "node2", "error": "Killed", "fault_at": 1100.0},
    )  # fmt: skip
    first_error.record(paths, 1, 0, "rank 0 on node1 stalled 30 s", host="node1",
                       kind=Cause.STALL, time=1199.0)  # fmt: skip
    rundir.append_jsonl(
        paths.restarts,
        {**restart, "failed_attempt": 1, "next_attempt": 2, "cause": "stall", "rank": 0,
         "host": "node1", "error": "rank 0 on node1 stalled 30 s", "fault_at": 1201.0},
    )  # fmt: skip
    stop = {"job_id": "7"}
    rundir.append_jsonl(paths.stops, {**stop, "attempt": 3, "reason": "timeout", "how": "end",
                        "due_at": 1340.0, "end_at": 1349.0, "save_s": 2.0, "step": 40,
                        "at": 1344.0})  # fmt: skip
    rundir.append_jsonl(paths.stops, {**stop, "attempt": 4, "reason": "preempted",
                        "slurm_state": "RUNNING", "signal_at": 1450.0, "step": 50})  # fmt: skip
    rundir.append_jsonl(paths.stops, {**stop, "attempt": 5, "reason": "preempted",
                        "slurm_state": "COMPLETING", "signal_at": 1550.0, "step": 60})  # fmt: skip
    full = "no space left on /dev/sdb1 (mounted at /scratch) writing checkpoint step 70"
    first_error.record(paths, 6, 0, full, host="node1", time=1650.0)
    # attempt 7: no record at all (the whole job SIGKILLed), a later attempt began
    lost = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]"
    first_error.record(paths, 10, 1, lost, host="node2", time=2070.0)  # a peer killed itself
    first_error.record(paths, 8, 1, "CUDA error: an illegal memory access", host="node2",
                       time=1840.0)  # fmt: skip
    rundir.append_jsonl(paths.stops, {**stop, "attempt": 8, "reason": "node_failure", "rank": 1,
                        "node": "node2", "error": "CUDA error", "at": 1841.0})  # fmt: skip
    faults.note(paths, 9, faults.FaultKind.NO_PROGRESS, at=1960.0, step=70,
                message="step 71 failed 3 times", samples=[3, 17])  # fmt: skip
    rundir.append_jsonl(paths.stops, {**stop, "attempt": 9, "reason": "interrupted"})
    return paths


def test_each_attempts_fault_is_named_from_the_record_of_its_witness(tmp_path):
    paths = _faulty_run(tmp_path / "run")
    found = faults.read(paths)
    kinds = [(f["attempt"], f["kind"], f["at"]) for f in found]
    assert kinds == [
        (0, "killed", 1100.0),  # srun saw rank 1 end by a signal; the driver restarted
        (1, "hang", 1201.0),
        (2, "killed", 1225.0),  # nothing recorded: its timeline's last write
        (3, "time_limit", 1340.0),  # decided by the job's watch of its end
        (4, "preemption", 1450.0),  # Slurm still ran the job: it requeued itself
        (5, "requeue", 1550.0),  # Slurm requeued it (scontrol requeue)
        (6, "disk_full", 1650.0),
        (7, "killed", 1725.0),
        (8, "node_lost", 1841.0),
        (9, "no_progress", 1960.0),
        (10, "killed", 2070.0),  # rank 1 saw its peer's connection close: the peer died
    ], kinds  # attempt 9's Ctrl-C after it is the user's, not a fault; attempt 11 completed
    by = {f["attempt"]: f for f in found}
    assert by[0]["in_job"] and (by[0]["rank"], by[0]["host"]) == (1, "node2")
    assert by[3]["how"] == "end" and by[3]["end_at"] == 1349.0 and by[3]["save_s"] == 2.0
    assert "9.0 s away, closer than two saves of 2.0 s" in by[3]["message"]
    assert (by[8]["rank"], by[8]["host"]) == (1, "node2") and by[9]["samples"] == [3, 17]
    assert (
        by[10]["rank"] is None
        and "a peer ended without a word; rank 1 on node2 saw" in (by[10]["message"])
    )
    # Where the state came from, how long until training again, the steps trained again.
    assert (by[0]["restored_from"], by[0]["restored_where"]) == ("memory", "memory of node1")
    assert by[0]["recovered_by"] == 1 and by[0]["recovery_s"] == 1115.0 - 1100.0
    assert by[0]["steps_lost"] == 0 and by[2]["steps_lost"] == 0  # 12 -> 12, 30 -> 30
    assert by[1]["restored_from"] == "replica" and by[3]["restored_from"] == "shared"
    assert by[3]["step"] == 40 and by[3]["steps_lost"] == 0
    assert by[6]["steps_lost"] == 70 - 64 and by[7]["restored_step"] == 70
    said = faults.describe(by[0])
    assert said == (
        "attempt 0: killed, rank 1 on node2 at "
        + time.strftime("%H:%M:%S", time.localtime(1100.0))
        + " (Killed); training again 15.0 s later (attempt 1, in the job) from the memory "
        "snapshot at step 12 (memory of node1); 0 step(s) trained again"
    )
    assert "from the disk checkpoint at step 40" in faults.describe(by[3])


def test_the_ledger_charges_each_fault_its_downtime_and_the_steps_trained_again(tmp_path):
    """Attempt 0 is killed after step 20 (commit 16), attempt 1 dies in its start-up, attempt 2
    resumes from step 16: fault 0's downtime ends at fault 1, fault 1's at attempt 2's first
    step, and attempt 2's four steps trained again are fault 0's (fault 1 lost none)."""
    local = {"job_id": "local", "source": "local", "world_size": 2}
    tl0 = _trained(0, last=20, commit={"step": 16, "at": 1031.0, "seconds": {"train": 16.0}})
    tl2 = _trained(2, restored=16, last=40, outcome="completed")
    attempts = [{**local, "attempt": n, "started_at": 1000.0 + 100 * n} for n in range(3)]
    paths = _records(tmp_path / "run", attempts, [tl0, tl2])
    first_error.record(paths, 1, 0, "ValueError: bad config in the task", host="h", time=1110.0)
    book = goodput.ledger(paths, running=False)
    f0, f1 = book["faults"]
    assert (f0["kind"], f0["at"], f0["steps_lost"]) == ("killed", 1035.0, 4)
    assert (f1["kind"], f1["at"], f1["steps_lost"]) == ("error", 1110.0, None)
    assert f0["recovered_by"] == f1["recovered_by"] == 2 and f0["recovery_s"] == 1215.0 - 1035.0
    assert book["attempts"][2]["seconds"]["recomputed"] == pytest.approx(4.0)
    assert f0["downtime_s"] == 1110.0 - 1035.0 and f0["retrained_s"] == pytest.approx(4.0)
    assert f1["downtime_s"] == 1215.0 - 1110.0 and f1["retrained_s"] == 0
    assert f0["lost_s"] == pytest.approx(75.0 + 4.0) and f0["lost_gpu_s"] == pytest.approx(158.0)
    assert [r["fault"] for r in book["attempts"]] == [f0, f1, None]
    assert book["faults_by_kind"] == {
        "killed": {"count": 1, "lost_s": f0["lost_s"], "lost_gpu_s": f0["lost_gpu_s"]},
        "error": {"count": 1, "lost_s": 105.0, "lost_gpu_s": 210.0},
    }
    table = goodput.render(book)
    assert (
        f"fault: {faults.describe(f0)}; charged 79.0 s (75.0 s without training + 4.0 s "
        "training steps again)"
    ) in table, table
    # status shows the same faults, charged, and sums them up by kind.
    shown = status_command.collect(paths, queue_state=lambda job: None)
    assert shown["faults"] == book["faults"]
    text = status_command.render(shown)
    assert "faults       2: killed x1, error x1; 184.0 s lost to them" in text, text
    assert f"fault        {faults.describe(f1)}" in text, text
    # While the run still recovers, the time since the fault is charged until now.
    st = goodput.ledger(_records(tmp_path / "now", attempts[:1], [tl0]), running=False)
    assert st["faults"] == []  # nothing says attempt 0 ended: no later attempt, no record
    rundir.append_jsonl(rundir.RunPaths(str(tmp_path / "now")).attempts, {**local, "attempt": 1})
    (waiting,) = goodput.ledger(rundir.RunPaths(str(tmp_path / "now")), running=True, now=1100.0)[
        "faults"
    ]
    assert waiting["recovered_by"] is None and waiting["downtime_s"] == 1100.0 - 1035.0


def test_a_straggler_is_named_once_after_its_window_and_a_recovered_rank_starts_over(tmp_path):
    paths = rundir.RunPaths(str(tmp_path))

    def ranks(*busy):
        return [
            {"rank": r, "host": f"n{r}", "phase": "train", "silent": False, "busy_s": b}
            for r, b in enumerate(busy)
        ]

    watch = StragglerWatch(paths, attempt=3, ratio=1.2, window_s=10)
    assert watch.update(ranks(1.0, 1.0, 1.5), now=0) == []
    assert watch.update(ranks(1.0, 1.0, 1.1), now=5) == []  # recovered: the clock starts over
    assert watch.update(ranks(1.0, 1.0, 1.5), now=6) == []
    assert watch.update(ranks(1.0, 1.0, 1.5), now=15) == []  # 9 s: not yet
    mining = [{**r, "phase": "mining embed"} for r in ranks(1.0, 1.0, 1.0)]
    assert watch.update(mining, now=16) == []  # not training: no score, the clock runs on
    assert watch.update(ranks(1.0, 1.0, 1.5), now=16) == [2]
    assert watch.update(ranks(1.0, 1.0, 1.5), now=30) == []  # named once per attempt
    (named,) = stragglers.read(paths)
    assert named["rank"] == 2 and named["node"] == "n2" and named["ratio"] == 1.5
    assert named["attempt"] == 3 and named["time"] - named["since"] == 10
    assert stragglers.straggler_nodes(paths) == ["n2"]
    assert stragglers.straggler_nodes(paths, attempt=4) == []


def test_straggler_keys_are_checked(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run: {dir: x}\n")
    assert load(str(cfg)).observe.straggler_ratio == 1.2
    assert load(str(cfg)).cluster.exclude_stragglers is False
    with pytest.raises(UserError, match=r"observe.straggler_ratio = 1.0: must be 0 \(off\)"):
        load(str(cfg), ["observe.straggler_ratio=1.0"])
    with pytest.raises(UserError, match="observe.straggler_window_s = -1"):
        load(str(cfg), ["observe.straggler_window_s=-1"])


# -- the writer: rank 0's timeline ---------------------------------------------------------------


def test_each_timeline_write_carries_the_step_the_loop_has_trained(tmp_path):
    """The commit of step 8, reported from the save's write thread after the loop trained step 10
    (no progress write between: they are at most one a second), records step 10 as trained."""
    paths = rundir.RunPaths(str(tmp_path))
    clock = phases.Phases()
    tl = AttemptTimeline(paths, 3, clock, world_size=1)
    tl.restored(0, 0.1)
    clock.tick(1)
    tl.first_step(1)
    for step in range(2, 11):
        clock.tick(step)
        tl.progress(step)
    tl.committed(8)
    rec = timeline.read_all(paths).records[3]
    assert rec["commit"]["step"] == 8 and rec["last_step"] == 10, rec


def test_a_commit_is_recorded_before_the_checkpoints_are_pruned(tmp_path):
    """The timeline hears of a commit as soon as it is published: before the retention's pruning
    (a synchronous delete on an object store), so a kill then leaves no record behind."""
    cfg = load(None, [f"run.dir={tmp_path}", "checkpoint.every_steps=1", "checkpoint.async=false"])
    said = []
    model = torch.nn.Linear(3, 2)
    state = TrainState()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = Checkpointer(
        JobContext(cfg, rundir.RunPaths(cfg.run.dir)),
        model,
        {"optimizer": opt},
        state,
        steps_per_epoch=100,
        after_commit=lambda step, seconds: said.append(("timeline", step)),
    )
    prune = ck.store.prune
    ck.store.prune = lambda: (said.append(("prune", state.global_step)), prune())
    for _ in range(3):
        state.step_done()
        ck.save(STEP)
    assert said == [(what, step) for step in (1, 2, 3) for what in ("timeline", "prune")], said


# -- the CLI's refusals -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "what, said",
    [
        ("missing", "does not exist"),
        ("not a run dir", "no config.yaml"),
        ("a file", "is a file, not a run dir"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, what, said):
    target = tmp_path / "nothing"
    if what == "not a run dir":
        target.mkdir()
    if what == "a file":
        target.write_text("run: {}\n")
    out = run_cli("clusterflow.goodput", str(target), "--json")
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(target) in lines[0]
    assert said in lines[0], lines[0]


# -- a real run, killed and resumed, no slow rank ------------------------------------------------


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """configs/tiny.yaml on 2 local ranks, 0.4 s per step, killed at step 12 (checkpoint at 8,
    the timeline's last record at step 9 to 11), then resumed to the end."""
    d = str(tmp_path_factory.mktemp("goodput") / "run")
    args = ("clusterflow.submit", "configs/tiny.yaml", f"run.dir={d}", *TASK)
    # No rank is slowed here; a loaded machine (the suite's parallel workers) can still delay one
    # rank's compute by a fifth of a step, so the watch looks for twice the median, not 1.2x.
    args += ("task.params.step_sleep=0.4", "observe.straggler_ratio=2.0", "--local")
    killed = run_cli(*args, env={**ENV, "CLUSTERFLOW_TEST_KILL_AT": "12"})
    assert killed.returncode != 0, killed.stdout + killed.stderr
    done = run_cli(*args, env=ENV)
    assert done.returncode == 0, done.stdout + done.stderr
    out = run_cli("clusterflow.goodput", d, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    return d, json.loads(out.stdout)


def test_every_attempt_of_a_killed_and_resumed_run_sums_to_its_wall_time(resumed):
    d, book = resumed
    first, second = book["attempts"]
    for row in book["attempts"]:
        _sums_to_wall(row)
    assert sum(book["total"]["seconds"].values()) == pytest.approx(book["total"]["wall_s"], 0.01)
    # Killed in step 12, it last recorded step 9, 10 or 11: rank 0 records progress at most once
    # a second (0.4 s steps), and what it trained after its last record is its lost tail.
    last = first["steps"]["last"]
    assert first["outcome"] is None and 9 <= last <= 11, first["steps"]
    assert last == timeline.read_all(rundir.RunPaths(d)).records[0]["last_step"]
    assert second["outcome"] == "completed" and second["steps"]["restored"] == 8
    assert second["steps"]["recomputed"] == last - 8  # trained by the killed attempt
    for k in ("restore", "recomputed", "productive", "mining", "startup"):
        assert second["seconds"][k] > 0, k
    assert first["seconds"]["productive"] > 0 and first["seconds"]["checkpoint_stall"] > 0
    assert second["ranks"] == 2 and 0 < book["total"]["ratio"] < 1
    assert book["total"]["gpu_seconds"]["productive"] == pytest.approx(
        2 * book["total"]["seconds"]["productive"]
    )


def test_the_kill_is_a_fault_charged_its_downtime_and_the_steps_trained_again(resumed):
    """SIGKILL left no record of the kill: the fault is the killed attempt's, at its last record;
    the next attempt resumed from the disk checkpoint at step 8 and trained the steps after it
    again, which the ledger charges to the kill with the time until that attempt's first step."""
    d, book = resumed
    first, second = book["attempts"]
    tls = timeline.read_all(rundir.RunPaths(d)).records
    (f,) = book["faults"]
    assert (f["attempt"], f["kind"], f["at"]) == (0, "killed", tls[0]["written_at"])
    assert f["recovered_by"] == 1 and f["restored_step"] == 8 and f["restored_from"] == "shared"
    assert f["steps_lost"] == first["steps"]["last"] - 8 > 0
    assert f["recovery_s"] == pytest.approx(tls[1]["first_step_at"] - f["at"], abs=1e-3)
    assert f["downtime_s"] == pytest.approx(f["recovery_s"], abs=1e-3)
    assert f["retrained_s"] == pytest.approx(second["seconds"]["recomputed"]) and f["retrained_s"]
    assert first["fault"] == f and second["fault"] is None
    assert book["faults_by_kind"]["killed"]["count"] == 1
    table = run_cli("clusterflow.goodput", d).stdout
    assert f"fault: {faults.describe(f)}; charged {f['lost_s']:.1f} s" in table, table
    assert "from the disk checkpoint at step 8" in table, table
    shown = json.loads(run_cli("clusterflow.status", d, "--json").stdout)
    assert [(g["kind"], g["restored_step"]) for g in shown["faults"]] == [("killed", 8)]


STARTUP_PHASES = [
    "imports",
    "rendezvous",
    "run dir",
    "task data",
    "model",
    "restore",
    "first batch",
    "first step",
]


def test_each_attempt_records_its_start_up_by_phase(resumed):
    """Rank 0's start-up, phase by phase from its process's start to the end of its first step,
    in the timeline, the ledger's --json and its table: the phases, in order, add up to that span
    (one clock read ends one phase and starts the next); the resumed attempt read a checkpoint."""
    d, book = resumed
    records = timeline.read_all(rundir.RunPaths(d)).records
    # attempts.jsonl holds the first start of the attempt's ranks' processes, before rank 0's
    # record of the attempt: where the start-up of an attempt dead before its timeline begins.
    recs = [json.loads(line) for line in open(rundir.RunPaths(d).attempts)]
    assert [rec["attempt"] for rec in recs] == sorted(records) == [0, 1]
    for rec in recs:
        tl = records[rec["attempt"]]
        assert rec["process_started_at"] <= tl["process_started_at"] < rec["started_at"]
    for row in book["attempts"]:
        rec, got = records[row["attempt"]], row["startup_phases"]
        assert rec["startup"] == got
        assert list(got) == STARTUP_PHASES, got
        assert all(v >= 0 for v in got.values()), got
        assert sum(got.values()) <= rec["first_step_at"] - rec["process_started_at"] + 1e-6
    assert book["attempts"][1]["startup_phases"]["restore"] > 0
    table = run_cli("clusterflow.goodput", d)
    assert table.returncode == 0, table.stderr
    for row in book["attempts"]:
        assert f"start-up of attempt {row['attempt']} (rank 0, s): imports " in table.stdout


def test_nobody_is_named_when_no_rank_is_slow(resumed):
    d, book = resumed
    paths = rundir.RunPaths(d)
    # The watch had what it needs: busy times in the heartbeats, training longer than the window.
    beats = [json.load(open(paths.heartbeat_file(r))) for r in (0, 1)]
    assert all(b.get("busy_s") for b in beats), beats
    assert timeline.read_all(paths).records[1]["seconds"]["train"] > WINDOW_S
    assert not os.path.exists(paths.stragglers)
    assert all(row["stragglers"] == [] for row in book["attempts"])


def test_status_tensorboard_and_the_table_show_the_ratio(resumed, tmp_path):
    d, book = resumed
    out = run_cli("clusterflow.status", d, "--json")
    status = json.loads(out.stdout)
    assert status["goodput"]["ratio"] == pytest.approx(book["total"]["ratio"], rel=1e-6)
    assert "goodput " in run_cli("clusterflow.status", d).stdout
    rows = [json.loads(line) for line in open(rundir.RunPaths(d).metrics)]
    ends = [r for r in rows if "goodput/ratio" in r]
    assert [r["attempt"] for r in ends] == [1] and 0 < ends[0]["goodput/ratio"] < 1
    png = tmp_path / "g.png"
    table = run_cli("clusterflow.cli", "goodput", d, "--plot", str(png))
    assert table.returncode == 0, table.stderr
    assert "recomputed steps" in table.stdout and "goodput" in table.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- a real launch that dies in start-up ----------------------------------------------------------


@pytest.mark.slow
def test_an_attempt_dead_in_start_up_counts_from_its_processes_start(tmp_path):
    """A real 2-rank launch whose task raises while it is built, before its first record: rank 0
    recorded the attempt with the first start of its ranks' processes, and its start-up runs from
    there, not from the moment rank 0 recorded the attempt. (The ledger's rules for such an
    attempt beside a kill are checked on written records above; this is the record a real death
    in start-up leaves.)"""
    d = str(tmp_path / "run")
    overrides = [f"run.dir={d}", *TASK, "task.target=testtasks:FailAtStart"]
    codes = launch.run(
        2, "configs/tiny.yaml", overrides, str(tmp_path / "logs"),
        env={**ENV, "CLUSTERFLOW_TEST_FAIL_START": "1"},
    )  # fmt: skip
    assert codes[0] != 0, codes
    paths = rundir.RunPaths(d)
    assert "CLUSTERFLOW_TEST_FAIL_START" in open(paths.log_file(0, 0)).read()
    (rec,) = [json.loads(line) for line in open(paths.attempts)]
    assert not timeline.read_all(paths).records  # dead before its first record
    began = rec["process_started_at"]
    assert began < rec["started_at"]
    (dead,) = goodput.ledger(paths, running=False)["attempts"]
    _sums_to_wall(dead)
    assert dead["outcome"] is None and dead["steps"]["last"] == 0
    assert dead["sources"]["allocated"] == "attempts.jsonl (process start)", dead["sources"]
    assert dead["seconds"]["startup"] >= rec["started_at"] - began
    assert dead["wall_s"] == pytest.approx(dead["seconds"]["queue_wait"] + dead["ended_at"] - began)


# -- a real run with rank 1 made three times as slow per step --------------------------------------


@pytest.fixture(scope="module")
def straggling(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("straggler") / "run")
    out = run_cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        f"run.dir={d}",
        *TASK,
        # rank 1 three times as slow: a margin that CPU contention from the rest of the suite
        # (four workers on two cores) cannot close; the 1.2 threshold itself is tested above
        "task.params.step_sleep=0.1",
        "task.params.slow_rank=1",
        "task.params.slow_factor=3",
        "mining.enabled=false",
        "train.eval_every_epochs=0",
        "train.epochs=5",
        "--local",
        env=ENV,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return d


def test_a_slowed_rank_is_named_with_its_node_in_the_log_status_and_ledger(straggling):
    d = straggling
    paths = rundir.RunPaths(d)
    host = socket.gethostname()
    (named,) = stragglers.read(paths)
    assert named["rank"] == 1 and named["node"] == host and named["attempt"] == 0
    assert named["ratio"] > 1.2 and named["time"] - named["since"] >= WINDOW_S
    assert stragglers.straggler_nodes(paths) == [host]
    log = open(paths.log_file(0, 0)).read()
    assert f"straggler: rank 1 on {host} at " in log
    ranks = run_cli("clusterflow.status", d, "--ranks").stdout
    assert f"straggler: rank 1 on {host}" in ranks
    table = run_cli("clusterflow.goodput", d).stdout
    assert f"straggler: attempt 0 rank 1 on {host}" in table


def test_plot_without_matplotlib_is_refused_in_one_line(resumed, tmp_path):
    d, _ = resumed
    code = (
        "import sys; sys.modules['matplotlib'] = None; "
        "from clusterflow.manage.goodput import main; sys.exit(main(sys.argv[1:]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, d, "--plot", str(tmp_path / "g.png")],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        "error: --plot needs matplotlib, which is not installed; pip install 'clusterflow[plot]'"
    )
    assert not (tmp_path / "g.png").exists()


def test_a_sweep_dir_gives_one_object_with_every_member_that_started_and_a_total(tmp_path, capsys):
    from clusterflow.manage.goodput import main

    sweep = tmp_path / "sweep"
    members = [{"name": "lr-0.1"}, {"name": "lr-0.2"}, {"name": "lr-0.3"}]
    os.makedirs(sweep)
    (sweep / "sweep.json").write_text(json.dumps({"version": 1, "members": members, "keys": []}))
    for name, ranks, train in (("lr-0.1", 2, 8), ("lr-0.2", 1, 4)):
        _records(
            sweep / name,
            [{"attempt": 0, "started_at": 10.0, "source": "local", "world_size": ranks}],
            [
                {
                    "attempt": 0,
                    "process_started_at": 9.0,
                    "first_step_at": 12.0,
                    "last_step": 4,
                    "written_at": 20.0,
                    "ended_at": 20.0,
                    "outcome": "completed",
                    "seconds": {"train": train},
                }
            ],
        )
    assert main([str(sweep), "--json"]) == 0
    book = json.loads(capsys.readouterr().out)
    assert book["sweep_dir"] == str(sweep)
    # lr-0.3 has not started (no config.yaml): not a member of the ledger, but named.
    first, second = book["members"]
    assert first["run_dir"].endswith("lr-0.1") and first["total"]["ratio"] == pytest.approx(8 / 11)
    assert second["total"]["ratio"] == pytest.approx(4 / 11)
    assert book["not_started"] == ["lr-0.3"]
    total = book["total"]
    assert total["allocated_gpu_s"] == pytest.approx(2 * 11 + 11)
    assert total["ratio"] == pytest.approx((2 * 8 + 4) / (2 * 11 + 11))
    assert total["wall_s"] == pytest.approx(22)
    assert main([str(sweep)]) == 0
    table = capsys.readouterr().out
    assert "sweep total: 2 members started (not started: lr-0.3), goodput 60.6% of" in table


def test_the_plot_keeps_its_axis_label_clear_of_the_legend(tmp_path, monkeypatch):
    """The x-axis label and the tick labels are drawn where the legend is not, and inside the
    image, for one attempt and for many."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # it wraps Figure.savefig when first imported: before the patch
    from matplotlib.figure import Figure
    from matplotlib.legend import Legend

    from clusterflow.manage import goodput as command

    drawn = []
    save = Figure.savefig

    def keep(fig, *args, **kwargs):
        """Save, then note where the label, the tick labels and the legend were drawn."""
        save(fig, *args, **kwargs)
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[0]
        (legend,) = fig.findobj(Legend)
        ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
        drawn.append(
            (
                fig.bbox,
                legend.get_window_extent(renderer),
                ax.xaxis.label.get_window_extent(renderer),
                ticks,
            )
        )

    monkeypatch.setattr(Figure, "savefig", keep)
    for n in (1, 6):
        paths = _records(
            tmp_path / f"run{n}",
            [{**LOCAL, "attempt": a, "started_at": 10.0 * a} for a in range(n)],
            [
                {"attempt": a, "process_started_at": 10.0 * a, "first_step_at": 10.0 * a + 3}
                for a in range(n)
            ],
        )
        command.plot([goodput.ledger(paths, running=False, now=10.0 * n)], str(tmp_path / "g.png"))
        image, box, label, ticks = drawn[-1]
        assert ticks
        for shown in (label, *ticks):
            assert not shown.overlaps(box), (n, shown, box)
        for shown in (label, box):
            assert shown.y0 >= 0 and shown.x0 >= 0 and shown.x1 <= image.x1, (n, shown)
