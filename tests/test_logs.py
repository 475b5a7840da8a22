"""python -m clusterflow.logs: one rank's log across attempts, and following new attempts
with -f."""

import io
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO, run_cli

from clusterflow import rundir
from clusterflow.manage import logs
from clusterflow.rundir import lease, transitions


def make_run(tmp_path):
    d = str(tmp_path / "run")
    os.makedirs(os.path.join(d, "logs"))
    with open(os.path.join(d, "config.yaml"), "w") as f:
        f.write("run: {dir: x}\n")
    return d


def attempt(d, a, job, hosts=("node1",)):
    rundir.append_jsonl(
        rundir.RunPaths(d).attempts,
        {
            "attempt": a,
            "job_id": job,
            "started_at": 1.7e9 + a,
            "hosts": list(hosts),
            "source": "slurm",
        },
    )


def live_attempt(d, a, job):
    """An attempt of a local job whose process is alive (this test's own)."""
    me = [socket.gethostname(), os.getpid(), lease.process_start(os.getpid())]
    rundir.append_jsonl(
        rundir.RunPaths(d).attempts,
        {
            "attempt": a,
            "job_id": job,
            "started_at": 1.7e9 + a,
            "hosts": [me[0]],
            "source": "submitit-local",
            "procs": [me],
        },
    )


def append(d, rank, a, text):
    with open(rundir.RunPaths(d).log_file(rank, a), "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()


def test_prints_every_attempt_in_order_under_a_header(tmp_path):
    d = make_run(tmp_path)
    for a in (0, 1, 2, 10):  # numeric order, not 0, 1, 10, 2
        attempt(d, a, str(500 + a), hosts=("node2", "node1"))
        append(d, 0, a, f"rank0 attempt {a} line\n")
        append(d, 1, a, f"rank1 attempt {a} line\n")
    out = io.StringIO()
    logs.show(rundir.RunPaths(d), 0, out)
    lines = out.getvalue().splitlines()
    assert [ln for ln in lines if not ln.startswith("==>") and ln] == [
        f"rank0 attempt {a} line" for a in (0, 1, 2, 10)
    ]
    assert lines[0].startswith(
        f"==> {rundir.RunPaths(d).log_file(0, 0)} (attempt 0, job 500, started "
    )
    assert lines[0].endswith("on node1,node2) <==")
    cli = run_cli("clusterflow.logs", d, "--rank", "1")
    assert (
        cli.returncode == 0
        and "rank1 attempt 10 line" in cli.stdout
        and "rank0" not in cli.stdout.replace("rank1", "")
    )


def test_bad_arguments_are_one_line_errors(tmp_path):
    d = make_run(tmp_path)
    append(d, 0, 0, "x\n")
    append(d, 1, 0, "x\n")
    out = run_cli("clusterflow.logs", d, "--rank", "5")
    assert (
        out.returncode == 2
        and "rank 5 has no logs" in out.stderr
        and "ranks with logs: 0, 1" in out.stderr
    )
    out = run_cli("clusterflow.logs", str(tmp_path / "nope"))
    assert out.returncode == 2 and "does not exist" in out.stderr
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text(json.dumps({"version": 1, "members": []}))
    out = run_cli("clusterflow.logs", str(sweep))
    assert out.returncode == 2 and "is a sweep; logs follows one run" in out.stderr
    empty = make_run(tmp_path / "e")
    out = run_cli("clusterflow.logs", empty)
    assert out.returncode == 0 and "no log yet" in out.stderr


def test_a_character_split_between_two_writes_stays_whole(tmp_path):
    d = make_run(tmp_path)
    text = "épreuve ✓\n".encode()
    path = rundir.RunPaths(d).log_file(0, 0)
    tail = logs.Tail(path)
    out = io.StringIO()
    with open(path, "wb") as f:
        f.write(text[:1])
        f.flush()
        tail.drain(out)
        f.write(text[1:])
        f.flush()
        tail.drain(out)
    assert out.getvalue() == "épreuve ✓\n"


def _reader(proc):
    lines = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _expect(lines, want, timeout=30):
    deadline = time.time() + timeout
    seen = []
    while time.time() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line)
        if want in line:
            return seen
    raise AssertionError(f"{want!r} not printed; got {seen}")


@pytest.mark.parametrize("end", ["completed", "cancelled"])
def test_follow_switches_to_new_attempts_and_stops_when_the_run_ends(tmp_path, end):
    d = make_run(tmp_path)
    live_attempt(d, 0, "900")
    append(d, 0, 0, "first attempt starts\n")
    transitions.mark_running(rundir.RunPaths(d))
    proc = subprocess.Popen(
        [sys.executable, "-m", "clusterflow.logs", d, "-f"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = _reader(proc)
        _expect(lines, "first attempt starts")
        append(d, 0, 0, "first attempt saves and is preempted\n")
        _expect(lines, "is preempted")
        # not an end: the follower waits for the next attempt
        transitions.mark_requeued(rundir.RunPaths(d))
        time.sleep(1.0)
        assert proc.poll() is None
        live_attempt(d, 1, "900")
        append(d, 0, 1, "second attempt resumes\n")
        seen = _expect(lines, "second attempt resumes")
        assert any(
            s.startswith(f"==> {rundir.RunPaths(d).log_file(0, 1)} (attempt 1, job 900")
            for s in seen
        )
        if end == "completed":
            transitions.mark_completed(rundir.RunPaths(d))
        else:
            with open(os.path.join(d, "cancelled.json"), "w") as f:
                f.write("{}")
            # The job trains on until it has seen the marker: its lines are still followed
            # (written after the grace a follower that ended at the marker would have taken).
            time.sleep(2.0)
            append(d, 0, 1, "still training just after the cancel\n")
            _expect(lines, "still training")
            transitions.mark_cancelled(rundir.RunPaths(d))
        append(d, 0, 1, "last line, written just after the final state\n")
        _expect(lines, "last line")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
