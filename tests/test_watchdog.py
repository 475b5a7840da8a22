"""The stall watchdog for real: processes that hang, get their stacks dumped, name themselves first,
and exit."""

import json
import os
import pickle
import re
import socket
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO

from clusterflow import rundir
from clusterflow.distributed import free_port
from clusterflow.errors import EXIT_STALLED
from clusterflow.observe.heartbeat import quiet_after
from clusterflow.observe.watchdog import (
    _active_in,
    describe_frame,
    flight_recorder_env,
    waiting_in_collective,
)
from clusterflow.rundir import first_error

PROGRAM = os.path.join(REPO, "tests", "stall_program.py")
STALL_S = 3


def _env(**extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCH_FR", "TORCH_NCCL"))
    }
    env.pop("RANK", None)
    env.update(extra)
    return env


def _run(run_dir, mode, **env):
    return subprocess.Popen(
        [sys.executable, PROGRAM, str(run_dir), mode, str(STALL_S)],
        cwd=REPO,
        env=_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _two_ranks(run_dir, mode):
    port = str(free_port())
    procs = [_run(run_dir, mode, RANK=str(r), WORLD_SIZE="2", MASTER_PORT=port) for r in (0, 1)]
    # generous bound (torch start-up on a busy 2-core machine + stall + grace), not a timing claim
    outs = [p.communicate(timeout=180)[0] for p in procs]
    return [p.returncode for p in procs], outs


def test_a_stalled_loop_dumps_its_stacks_records_the_cause_and_exits(tmp_path):
    p = _run(tmp_path, "stall")
    out, _ = p.communicate(
        timeout=STALL_S + 30
    )  # must end by itself within stall_s + a few seconds
    assert p.returncode == EXIT_STALLED, out
    rec = first_error.read(rundir.RunPaths(str(tmp_path)), 0)
    assert (
        rec["kind"] == "stall" and rec["rank"] == 0 and rec["step"] == 5 and rec["phase"] == "train"
    )
    # The watchdog looks once a second, and a loaded machine can delay a look: 3 s or a few more.
    said = re.search(r"stalled (\d+) s at step 5 in train", rec["error"])
    assert rec["error"].startswith("rank 0 on ") and said and 3 <= int(said.group(1)) <= 13, rec[
        "error"
    ]
    assert "stall_program.py:" in rec["error"] and "sleeping_in_loss" in rec["error"]
    assert "sleeping_in_loss" in rec["traceback"]
    log = (tmp_path / "logs" / "rank0.attempt0.log").read_text()
    assert "clusterflow watchdog: rank 0 on" in log
    # faulthandler's dump of every thread: the loop, the heartbeat writer, the watchdog itself
    sleep_line = 1 + open(PROGRAM).read().split("\n").index("    time.sleep(3600)")
    assert (
        f"line {sleep_line} in sleeping_in_loss" in log
        and "in _run" in log
        and log.count("(most recent call first)") >= 3
    )
    assert "sleeping_in_loss" in (tmp_path / "stalls" / "attempt0" / "rank0.stacks.txt").read_text()
    assert f"exiting with {EXIT_STALLED}" in out
    beat = json.loads((tmp_path / "heartbeats" / "rank0.json").read_text())
    assert beat["step"] == 5 and beat["phase"] == "train"


def test_the_mining_wait_has_its_own_allowance(tmp_path):
    """A wait three times stall_s long, inside the mining-wait allowance, is not a stall."""
    p = _run(tmp_path, "mining-wait")
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and "finished" in out, out
    assert first_error.read(rundir.RunPaths(str(tmp_path)), 0) is None
    assert not (tmp_path / "stalls").exists()


def test_two_ranks_the_stalled_one_is_named_not_the_peer_waiting_for_it(tmp_path):
    codes, outs = _two_ranks(tmp_path, "ranks")
    assert codes[1] == EXIT_STALLED, outs[1]
    # rank 0's all_reduce failed once rank 1 was gone; its error path (a recorder dump of several
    # seconds, longer than stall_s) ran with the watchdog stopped by `with`, so it exits 1, not 86
    assert codes[0] == 1, outs[0]
    assert "first cause recorded: False" in outs[0]  # ... and its error did not overwrite the cause
    rec = first_error.read(rundir.RunPaths(str(tmp_path)), 0)
    assert (
        rec["rank"] == 1 and "rank 1 on " in rec["error"] and "sleeping_in_loss" in rec["error"]
    ), rec
    assert "waiting in" not in rec["error"]
    # the flight recorder (gloo's, torch >= 2.8) was on; the stalled rank dumped it, the failed peer
    # too
    stalls = tmp_path / "stalls" / "attempt0"
    ours = pickle.loads((stalls / "flight_recorder_rank_1").read_bytes())
    assert [e["profiling_name"] for e in ours["entries"]] == ["gloo:all_reduce"] * 2
    peer = pickle.loads((stalls / "flight_recorder_rank_0").read_bytes())
    assert [e["collective_seq_id"] for e in peer["entries"]] == [
        1,
        2,
        3,
    ]  # rank 0 entered #3, rank 1 never did
    assert first_error.headline(rec) == rec["error"]
    # The recorder's variables by the names torch reads: no rank warns about an older one.
    assert not [line for out in outs for line in out.splitlines() if "is deprecated" in line]


def test_a_frozen_peer_is_named_by_its_quiet_heartbeat_not_the_rank_waiting_for_it(tmp_path):
    """Rank 1 stops (SIGSTOP) before its third all_reduce, its heartbeat thread with it; rank 0
    waits for it in the collective. Rank 0's watchdog reads the heartbeats and names rank 1 as
    soon as it has been quiet long enough, without the victim's grace (ten minutes here: only
    that reading ends rank 0 within the test's wait)."""
    port = str(free_port())
    procs = [
        _run(tmp_path, "frozen", RANK=str(r), WORLD_SIZE="2", MASTER_PORT=port) for r in (0, 1)
    ]
    try:
        out, _ = procs[0].communicate(timeout=180)
    finally:
        procs[1].kill()  # SIGKILL ends a stopped process
        procs[1].communicate(timeout=60)
    assert procs[0].returncode == EXIT_STALLED, out
    rec = first_error.read(rundir.RunPaths(str(tmp_path)), 0)
    assert rec["rank"] == 0 and rec["kind"] == "stall" and rec["step"] == 2, rec
    assert (rec["silent_rank"], rec["silent_host"]) == (1, socket.gethostname()), rec
    assert rec["silent_s"] > quiet_after(0.2, STALL_S), rec
    assert rec["error"].startswith(
        f"rank 1 on {socket.gethostname()} stopped: no heartbeat for "
    ), rec["error"]
    assert "no progress (a frozen process or node); rank 0 on " in rec["error"]
    assert "waiting in " in rec["error"]


def test_a_rank_waiting_for_the_stop_agreement_is_a_victim_not_the_cause(tmp_path):
    """Rank 0 waits in the stop agreement's started all-reduce (gloo, read a step later) for rank
    1, which sleeps in its own code and went quiet a second after rank 0: rank 0 gets the victim's
    grace, so rank 1 is the one named, not waiting."""
    codes, outs = _two_ranks(tmp_path, "agree")
    assert codes[1] == EXIT_STALLED, outs[1]
    assert codes[0] == 1 and "first cause recorded: False" in outs[0], outs[0]
    rec = first_error.read(rundir.RunPaths(str(tmp_path)), 0)
    assert rec["rank"] == 1 and "sleeping_in_loss" in rec["error"], rec
    assert rec["waiting"] is None and "waiting in" not in rec["error"], rec


def test_a_rank_stuck_in_mining_embed_is_named_with_its_phase(tmp_path):
    codes, outs = _two_ranks(tmp_path, "embed")
    assert codes[1] == EXIT_STALLED, outs[1]
    rec = first_error.read(rundir.RunPaths(str(tmp_path)), 0)
    assert (
        rec["rank"] == 1 and "in mining embed" in rec["error"] and "embedding_batch" in rec["error"]
    ), rec


RECORDER = textwrap.dedent("""
    import os, sys, time
    from clusterflow import rundir
    from clusterflow.rundir import first_error
    run_dir, who, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
    while time.time() < start:
        pass
    paths = rundir.RunPaths(run_dir)
    print(first_error.record(paths, 0, int(who), f"error from {who}", host=f"host{who}"))
""")


def test_first_cause_the_first_process_to_record_wins(tmp_path):
    def record(who, start=0.0):
        return subprocess.run(
            [sys.executable, "-c", RECORDER, str(tmp_path), str(who), str(start)],
            check=False,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()

    assert record(1) == "True"
    assert record(0) == "False"
    rec = first_error.read(rundir.RunPaths(str(tmp_path)), 0)
    assert (rec["rank"], rec["host"], rec["error"]) == (1, "host1", "error from 1")
    # the next attempt records its own first cause
    assert first_error.record(rundir.RunPaths(str(tmp_path)), 1, 0, "later attempt") is True
    assert not [n for n in os.listdir(tmp_path / "errors") if n.endswith(".tmp")]


def test_first_cause_six_processes_racing_exactly_one_wins(tmp_path):
    import time

    start = time.time() + 3  # all spin until the same instant, then record at once
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RECORDER, str(tmp_path), str(r), str(start)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(6)
    ]
    results = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert sorted(results) == ["False"] * 5 + ["True"], results
    winner = results.index("True")
    assert first_error.read(rundir.RunPaths(str(tmp_path)), 0)["rank"] == winner


def test_flight_recorder_env_keeps_what_the_user_set(tmp_path):
    env = flight_recorder_env(rundir.RunPaths(str(tmp_path)), 2, {"TORCH_FR_BUFFER_SIZE": "0"})
    assert "TORCH_FR_BUFFER_SIZE" not in env  # the user turned the recorder off: respected
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    prefix = str(tmp_path / "stalls" / "attempt2" / "nccl_trace_rank_")
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == prefix
    # Under the older name: torch reads it when the current one is not set, so it is not set.
    old = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    assert "TORCH_FR_BUFFER_SIZE" not in flight_recorder_env(rundir.RunPaths(str(tmp_path)), 2, old)
    assert os.path.isdir(
        os.path.dirname(prefix)
    )  # torch writes the file but does not create its folder


@pytest.mark.parametrize(
    "status,entries,expected",
    [
        (
            {"0": {"last_enqueued_collective": 2, "last_completed_collective": 2}},
            [],
            None,
        ),  # gloo: all done
        (
            {"0": {"last_enqueued_collective": 3, "last_completed_collective": 2}},
            [{"collective_seq_id": 3, "pg_id": 0, "profiling_name": "nccl:all_reduce"}],
            "nccl:all_reduce #3 (flight recorder)",
        ),
        (
            {
                "0": {"last_enqueued_collective": 1, "last_completed_collective": 1},
                "1": {"last_enqueued_collective": 7, "last_completed_collective": 5},
            },
            [{"collective_seq_id": 7, "pg_id": 1, "profiling_name": "nccl:broadcast"}],
            "nccl:broadcast #7 (flight recorder)",
        ),
        (
            {
                "0": {"last_enqueued_collective": 73, "last_completed_collective": 72},
                "1": {"last_enqueued_collective": 6, "last_completed_collective": 6},
            },
            [
                {"collective_seq_id": 72, "pg_id": 0, "profiling_name": "gloo:broadcast"},
                {"collective_seq_id": 73, "pg_id": 0, "profiling_name": "gloo:broadcast"},
            ],
            None,
        ),  # gloo: its completed counter lags; the stack decides
        (
            {
                "0": {"last_enqueued_collective": 9, "last_completed_collective": 8},
                "1": {"last_enqueued_collective": 3, "last_completed_collective": 2},
            },
            [
                {"collective_seq_id": 9, "pg_id": 0, "profiling_name": "gloo:all_reduce"},
                {"collective_seq_id": 3, "pg_id": 1, "profiling_name": "nccl:all_gather"},
            ],
            "nccl:all_gather #3 (flight recorder)",
        ),  # a gloo side group beside an NCCL one
        (
            {"0": {"last_enqueued_collective": 4, "last_completed_collective": -1}},
            [],
            "a collective #4 (flight recorder)",
        ),
        ({}, [], None),
    ],
)
def test_active_collective_from_a_recorder_dump(status, entries, expected):
    assert _active_in({"pg_status": status, "entries": entries}) == expected


def test_describe_frame_names_the_users_code_under_a_library_frame():
    import queue
    import sys as _sys
    import threading

    q: queue.Queue = queue.Queue()
    seen = {}

    def users_loader():
        q.get()  # blocks inside the standard library

    t = threading.Thread(target=users_loader, daemon=True)
    t.start()
    while "text" not in seen:
        frame = _sys._current_frames().get(t.ident)
        names = (
            [f.name for f in __import__("traceback").extract_stack(frame)]
            if frame is not None
            else []
        )
        if (
            "users_loader" in names and names[-1] != "users_loader"
        ):  # inside q.get, under users_loader
            seen["text"] = describe_frame(frame)
            seen["waiting"] = waiting_in_collective(frame)
    q.put(None)
    assert seen["text"].startswith("threading.py:") or seen["text"].startswith("queue.py:"), seen
    assert "called from tests/test_watchdog.py:" in seen["text"] and seen["text"].endswith(
        "users_loader"
    )
    assert seen["waiting"] is None
    assert describe_frame(None) == "no Python frame"
