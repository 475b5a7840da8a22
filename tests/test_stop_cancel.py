"""Cancel means cancel, Ctrl-C means stop (issue 23): real local runs of configs/tiny.yaml, driven
as a user drives them from a terminal."""

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from clihelp import call
from conftest import REPO, run_cli, weights_equal

from clusterflow import rundir
from clusterflow.launch import submit
from clusterflow.rundir import cancel_marker, lease


def _env():
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        e.pop(k, None)
    return e


def _start(args, out_dir):
    """`python -m clusterflow.submit ...` in its own process group, as a terminal starts it: with
    SIGINT's default disposition whatever the test process's (a child inherits an ignored
    SIGINT, and a Ctrl-C before submit installs its own handler would then be lost)."""
    held = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "clusterflow.submit", *args],
            cwd=REPO,
            env=_env(),
            stdout=open(os.path.join(out_dir, "stdout.txt"), "w"),
            stderr=open(os.path.join(out_dir, "stderr.txt"), "w"),
            start_new_session=True,
        )
    finally:
        signal.signal(signal.SIGINT, held)
    proc.out_dir = out_dir
    return proc


def _until(what, proc):
    """Poll ``what()`` until it is true; the submit process must still be running meanwhile."""
    while not what():
        if proc.poll() is not None:
            said = "".join(
                open(os.path.join(proc.out_dir, name)).read()[-3000:]
                for name in ("stdout.txt", "stderr.txt")
            )
            pytest.fail(f"submit ended (exit {proc.returncode}) before the awaited moment:\n{said}")
        time.sleep(0.05)


def _attempt(run_dir):
    """The first attempt's record once it lists its processes, else None."""
    try:
        with open(os.path.join(run_dir, "attempts.jsonl")) as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return None
    return lines[0] if lines and lines[0].get("procs") else None


def _status(run_dir):
    r = run_cli("clusterflow.status", run_dir, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _signal_ranks(record, sig):
    for _, pid, start in record["procs"]:
        if lease.process_start(pid) == start:
            os.kill(pid, sig)


def _workers(record):
    """The ranks' child processes: their DataLoader workers."""
    out = []
    for _, pid, _ in record["procs"]:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{pid}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def test_cancelling_a_local_sweep_stops_the_running_member_and_starts_no_other(tmp_path):
    """submit configs/tiny.yaml train.epochs=2 run.dir=SW --sweep train.lr=0.001,0.002,0.003
    --local, then `cancel SW` while member 1 runs (its ranks held still with SIGSTOP so that it
    cannot finish first): member 1 stops cancelled without completing, members 2 and 3 never
    start, and status says `running` (cancel requested), never `cancelled`, while member 1's
    processes live."""
    sw = str(tmp_path / "SW")
    proc = _start(
        [
            "configs/tiny.yaml",
            "train.epochs=2",
            f"run.dir={sw}",
            "--sweep",
            "train.lr=0.001,0.002,0.003",
            "--local",
        ],
        str(tmp_path),
    )
    try:
        _until(lambda: glob.glob(os.path.join(sw, "lr=0.001-*")), proc)
        first = glob.glob(os.path.join(sw, "lr=0.001-*"))[0]
        _until(lambda: _attempt(first), proc)
        record = _attempt(first)
        _signal_ranks(record, signal.SIGSTOP)
        try:
            r = run_cli("clusterflow.cancel", sw)
            assert r.returncode == 0, r.stderr
            seen = _status(first)
            assert seen["state"] == "running", seen
            assert "cancel requested" in (seen.get("note") or ""), seen
        finally:
            _signal_ranks(record, signal.SIGCONT)
        assert proc.wait(timeout=300) == 0, open(tmp_path / "stderr.txt").read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    members = sorted(glob.glob(os.path.join(sw, "lr=*")))
    assert len(members) == 3
    for m in members:
        assert _status(m)["state"] == "cancelled", m
        assert not os.path.exists(os.path.join(m, "model.pt")), m
    others = [m for m in members if m != first]
    for m in others:
        assert not os.path.exists(os.path.join(m, "attempts.jsonl")), f"{m} started"
    out = open(tmp_path / "stdout.txt").read()
    assert "cancelled by the user" in out


def test_a_job_started_after_the_cancel_trains_nothing(tmp_path):
    """A job that starts when the run is already cancelled (it was queued, or requeued): state
    cancelled, exit 0, no step trained."""
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    cancel_marker.mark(rundir.RunPaths(run_dir), None)
    r = run_cli("clusterflow.run", "configs/tiny.yaml", "train.epochs=1", f"run.dir={run_dir}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cancelled by the user" in r.stdout
    assert _status(run_dir)["state"] == "cancelled"
    assert not glob.glob(os.path.join(run_dir, "checkpoints", "step-*"))
    assert not os.path.exists(os.path.join(run_dir, "attempts.jsonl"))


def _newest_step(run_dir):
    steps = [
        int(p.rsplit("-", 1)[1]) for p in glob.glob(os.path.join(run_dir, "checkpoints", "step-*"))
    ]
    return max(steps) if steps else None


def _logged_a_step(run_dir):
    try:
        with open(os.path.join(run_dir, "logs", "rank0.attempt0.log")) as f:
            return "step 1/6" in f.read()
    except OSError:
        return False


def test_ctrl_c_on_submit_local_saves_stops_and_resumes_exactly(tmp_path, tiny_two_rank_run):
    """Ctrl-C (SIGINT to the terminal's process group) on `submit configs/tiny.yaml --local`
    once a step is logged: no traceback, state `stopped`, a checkpoint at the step reached and
    a line saying how to resume; running the same command again completes with the weights of an
    uninterrupted run (the session's 2-rank reference: an uninterrupted `submit --local` run of
    tiny.yaml gives its weights bitwise, test_run_dir.py's killed-holder test shows). (The ranks
    are held still with SIGSTOP from the moment the step is seen until the group has been
    signalled, so that the run cannot finish first.)"""
    run_dir = str(tmp_path / "run")
    proc = _start(["configs/tiny.yaml", f"run.dir={run_dir}", "--local"], str(tmp_path))
    try:
        _until(lambda: _logged_a_step(run_dir), proc)
        record = _attempt(run_dir)
        _signal_ranks(record, signal.SIGSTOP)
        try:
            os.killpg(proc.pid, signal.SIGINT)
        finally:
            _signal_ranks(record, signal.SIGCONT)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = open(tmp_path / "stderr.txt").read()
    out = open(tmp_path / "stdout.txt").read()
    assert code == 130, out + err
    assert "Traceback" not in err, err
    seen = _status(run_dir)
    assert seen["state"] == "stopped", seen
    assert 1 <= seen["global_step"] < 18
    assert _newest_step(run_dir) == seen["global_step"], (seen, out)
    assert "resume by running the same command again" in out
    assert not os.path.exists(os.path.join(run_dir, "model.pt"))

    again = run_cli("clusterflow.submit", "configs/tiny.yaml", f"run.dir={run_dir}", "--local")
    assert again.returncode == 0, again.stdout + again.stderr
    ref = os.path.join(tiny_two_rank_run, "model.pt")
    assert weights_equal(os.path.join(run_dir, "model.pt"), ref)


def test_logs_follow_ends_after_the_job_is_killed_with_sigkill(tmp_path):
    """`logs -f` of a local run whose processes are all killed with kill -9 (nothing of the job
    can record its end) ends, saying what status saw, instead of following forever. (One rank:
    a second proves nothing more about the follower.)"""
    run_dir = str(tmp_path / "run")
    args = ["configs/tiny.yaml", f"run.dir={run_dir}", "cluster.tasks_per_node=1", "--local"]
    proc = _start(args, str(tmp_path))
    follower = None
    try:
        _until(lambda: _logged_a_step(run_dir), proc)
        record = _attempt(run_dir)
        _signal_ranks(record, signal.SIGSTOP)  # it must not finish before the kill
        follower = subprocess.Popen(
            [sys.executable, "-m", "clusterflow.logs", run_dir, "-f"],
            cwd=REPO,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        _signal_ranks(record, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        out, err = follower.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if follower is not None and follower.poll() is None:
            follower.kill()
    assert follower.returncode == 0, err
    assert "step 1/6" in out
    assert "status says failed" in err, err


@pytest.mark.slow
def test_sigterm_to_a_local_job_says_how_to_resume(tmp_path):
    """`kill` (SIGTERM) of every process of a local job, its ranks' DataLoader workers too (as
    Slurm signals a job): saved and stopped; submit says so, with how to resume, and exits 143
    (not a failure's 1); the same command then completes."""
    run_dir = str(tmp_path / "run")
    args = ["configs/tiny.yaml", f"run.dir={run_dir}", "data.num_workers=1", "--local"]
    proc = _start(args, str(tmp_path))
    try:
        _until(lambda: _logged_a_step(run_dir), proc)
        record = _attempt(run_dir)
        _signal_ranks(record, signal.SIGSTOP)
        try:
            workers = _workers(record)
            assert len(workers) == 2, workers  # one a rank
            _signal_ranks(record, signal.SIGTERM)
            for pid in workers:
                os.kill(pid, signal.SIGTERM)
        finally:
            _signal_ranks(record, signal.SIGCONT)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = open(tmp_path / "stdout.txt").read()
    assert code == 143, out + open(tmp_path / "stderr.txt").read()
    assert "stopped by SIGTERM" in out and "resume by running the same command again" in out
    assert _status(run_dir)["state"] == "stopped"
    again = run_cli("clusterflow.submit", *args)
    assert again.returncode == 0, again.stdout + again.stderr
    seen = _status(run_dir)
    assert seen["state"] == "completed" and seen["attempts"] == 2, seen


@pytest.mark.slow
def test_sigterm_to_submit_local_alone_stops_the_ranks_with_a_save(tmp_path):
    """SIGTERM to the `submit --local` process only (`kill PID`, a workflow manager; not its
    process group): submit passes it on, the ranks save at the step reached and end `stopped`
    with a `preempted` stop line, and submit says so and exits 143 once no rank is left."""
    run_dir = str(tmp_path / "run")
    proc = _start(["configs/tiny.yaml", f"run.dir={run_dir}", "--local"], str(tmp_path))
    try:
        _until(lambda: _logged_a_step(run_dir), proc)
        record = _attempt(run_dir)
        _signal_ranks(record, signal.SIGSTOP)  # it must not finish before the signal
        try:
            os.kill(proc.pid, signal.SIGTERM)
            time.sleep(0.5)  # submit acts on it while the ranks are held
        finally:
            _signal_ranks(record, signal.SIGCONT)
        code = proc.wait(timeout=300)
        alive = [pid for _, pid, start in record["procs"] if lease.process_start(pid) == start]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # ranks that outlived submit
    out = open(tmp_path / "stdout.txt").read()
    err = open(tmp_path / "stderr.txt").read()
    assert code == 143, out + err
    assert alive == [], out + err
    assert "Traceback" not in err, err
    assert "stopped by SIGTERM" in out and "resume by running the same command again" in out
    seen = _status(run_dir)
    assert seen["state"] == "stopped" and 1 <= seen["global_step"] < 18, seen
    assert _newest_step(run_dir) == seen["global_step"], (seen, out)
    with open(os.path.join(run_dir, "stops.jsonl")) as f:
        assert [json.loads(line)["reason"] for line in f] == ["preempted"]


def test_a_second_submit_into_a_running_local_run_names_the_cancel_that_stops_it(
    tmp_path, monkeypatch
):
    """The refusal names `clusterflow cancel RUN_DIR`, and that cancel does stop the local run.
    (One rank: that every rank stops is the sweep-cancel test's claim. The second submit is
    refused before anything starts: it runs in-process, tests/clihelp.call.)"""
    run_dir = str(tmp_path / "run")
    args = ["configs/tiny.yaml", f"run.dir={run_dir}", "cluster.tasks_per_node=1", "--local"]
    proc = _start(args, str(tmp_path))
    try:
        _until(lambda: _logged_a_step(run_dir), proc)
        record = _attempt(run_dir)
        _signal_ranks(record, signal.SIGSTOP)
        try:
            monkeypatch.chdir(REPO)
            code, out, err = call(submit.main, args)
            assert code == 2, out + err
            assert f"python -m clusterflow.cancel {run_dir}" in err
            assert run_cli("clusterflow.cancel", run_dir).returncode == 0
        finally:
            _signal_ranks(record, signal.SIGCONT)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0
    assert _status(run_dir)["state"] == "cancelled"
    assert not os.path.exists(os.path.join(run_dir, "model.pt"))


def test_ctrl_c_while_the_local_job_starts_is_not_lost(tmp_path):
    """Ctrl-C right after `submit --local` began starting the job (its submitit folder exists,
    the rank may not): held back, not lost; the rank stops at its first steps, `stopped`. (One
    rank: a second proves nothing more about the held-back signal.)"""
    run_dir = str(tmp_path / "run")
    args = ["configs/tiny.yaml", f"run.dir={run_dir}", "cluster.tasks_per_node=1", "--local"]
    proc = _start(args, str(tmp_path))
    try:
        _until(lambda: os.path.exists(os.path.join(run_dir, "logs", "submitit")), proc)
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = open(tmp_path / "stderr.txt").read()
    assert code == 130, err
    assert "Traceback" not in err, err
    assert _status(run_dir)["state"] == "stopped"
    assert not os.path.exists(os.path.join(run_dir, "model.pt"))
