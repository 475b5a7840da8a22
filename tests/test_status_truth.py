"""Status that never lies: a run whose processes are all gone is not 'running'; damaged records
neither crash status nor block a resume; under --local a dead rank ends the job at once, named."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import launch
import pytest
from conftest import REPO, run_cli, weights_equal
from test_on_event import fired, notify_script

from clusterflow.manage.status import render


@pytest.fixture(autouse=True)
def _tasks_importable(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.join(REPO, "tests"))
    monkeypatch.delenv("CLUSTERFLOW_TEST_KILL_AT", raising=False)


def status(run_dir):
    out = run_cli("clusterflow.status", run_dir, "--json")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
    return json.loads(out.stdout)


def wait_for(fn, timeout=180):
    t0 = time.time()
    while time.time() - t0 < timeout:
        value = fn()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out")


def test_a_run_whose_processes_were_all_killed_is_not_running(tmp_path):
    d = str(tmp_path / "run")
    procs = launch.start(
        2,
        "configs/tiny.yaml",
        [f"run.dir={d}", "task.target=testtasks:Slow", "task.params.step_sleep=0.3"],
        d,
    )
    live = wait_for(
        lambda: (
            os.path.exists(os.path.join(d, "status.json"))
            and (s := status(d))["global_step"] >= 2
            and s
        )
    )
    assert live["state"] == "running" and live["alive"] is True
    launch.kill(procs)
    launch.wait(procs)
    dead = status(d)
    assert dead["state"] == "failed" and dead["alive"] is False
    assert (
        dead["liveness"].startswith("no live process since ")
        and "its 2 process(es) on " in dead["liveness"]
    )
    assert (
        f"last step {dead['global_step']}" in dead["liveness"] and dead["error"] == dead["liveness"]
    )
    text = run_cli("clusterflow.status", d).stdout
    assert "state        failed" in text and "liveness     no live process since" in text


DAMAGE = {
    "garbage bytes": b"\x00\xff\xfe garbage \x89PNG\r\n\x1a\n" * 20,
    "non-object JSON": b"[1, 2, 3]\n",
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_records_neither_crash_status_nor_block_resume(
    tmp_path, damage, tiny_one_process_model
):
    d = str(tmp_path / "run")
    # One process, as `python -m clusterflow.run` alone runs; saves are synchronous, so a kill at
    # step 10 finds step 8 committed, never still being written.
    over = [
        f"run.dir={d}",
        "task.target=testtasks:KillAtEnv",
        "checkpoint.async=false",
    ]
    assert (
        run_cli(
            "clusterflow.run", "configs/tiny.yaml", *over, env={"CLUSTERFLOW_TEST_KILL_AT": "10"}
        ).returncode
        == -9
    )
    for name in ("status.json", "attempts.jsonl", "config.yaml"):
        with open(os.path.join(d, name), "wb") as f:
            f.write(DAMAGE[damage])
    s = status(d)
    assert (
        s["state"] == "failed" and s["alive"] is False
    )  # the lease left by the killed process says so
    named = [w.split()[0].rstrip(":") for w in s["damaged_records"]]
    assert sorted(set(named)) == ["attempts.jsonl", "config.yaml", "status.json"], named
    assert s["latest_checkpoint"].endswith("step-8")
    out = run_cli("clusterflow.run", "configs/tiny.yaml", *over)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "config.yaml is damaged" in out.stderr and "resumed from" in out.stdout
    # Every line counts epochs from 1, as the steps' log lines do: step 8 of tiny.yaml's 6-step
    # epochs is step 2 of epoch 2, in status, in the resume's line, and the next step's line.
    epoch, step = 8 // 6 + 1, 8 % 6
    progress = r"^progress +epoch (\d+)/3, step (\d+)/\S+ of the epoch, global step 8$"
    said = [
        re.search(progress, render(s), re.MULTILINE),
        re.search(r"resumed from \S+/step-8: epoch (\d+), step (\d+) of the epoch", out.stdout),
        re.search(r"epoch (\d+) step (\d+)/6 \(global 9\)", out.stdout),
    ]
    assert [m and tuple(map(int, m.groups())) for m in said] == [
        (epoch, step),
        (epoch, step),
        (epoch, step + 1),
    ], (render(s), out.stdout)
    assert weights_equal(os.path.join(d, "model.pt"), tiny_one_process_model)
    s = status(d)
    assert s["state"] == "completed" and s["attempts"] >= 1
    # status.json and config.yaml were replaced; the damaged lines the resume appended after are
    # still in attempts.jsonl, and still named.
    assert [w for w in s["damaged_records"] if not w.startswith("attempts.jsonl")] == []
    assert [n for n in os.listdir(d) if n.startswith("config.yaml.damaged-")]


def rank_pid(run_dir, rank):
    """The pid of a --local task of this run dir (its command line names the run dir's submitit
    folder)."""
    folder = os.path.join(run_dir, "logs", "submitit")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if (
            folder.encode() in cmd
            and b"submitit.core._submit" in cmd
            and f"SUBMITIT_LOCAL_GLOBALID={rank}".encode() in env
        ):
            return int(pid)
    return None


def test_a_rank_killed_before_the_rendezvous_ends_the_local_job_at_once(tmp_path):
    d = str(tmp_path / "run")
    t0 = time.time()
    sub = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "clusterflow.submit",
            "configs/tiny.yaml",
            f"run.dir={d}",
            "dist.timeout_s=600",
            "--local",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pid = wait_for(lambda: rank_pid(d, 1), timeout=60)
    os.kill(
        pid, signal.SIGKILL
    )  # within moments of its start: rank 0 waits for it at the rendezvous
    out, err = sub.communicate(timeout=300)
    assert sub.returncode == 1, out + err
    assert time.time() - t0 < 600  # ended by the watcher, not by dist.timeout_s (600 s)
    # The watcher may see rank 1 only after it is gone (its pid then unknown to it): both forms name
    # it.
    expected = "died first, before the rendezvous: it recorded no Python error: killed by a signal"
    assert f"rank 1 (pid {pid}) {expected}" in err or f"rank 1 {expected}" in err, err
    s = status(d)
    assert s["state"] == "failed" and s["error"].startswith("rank 1") and expected in s["error"]


def test_a_rank_killed_by_a_signal_in_native_code_is_named_with_the_signal(tmp_path):
    d = str(tmp_path / "run")
    out = run_cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        f"run.dir={d}",
        "task.target=testtasks:AbortInLoss",
        "cluster.tasks_per_node=1",
        "--local",
    )
    assert out.returncode == 1, out.stdout + out.stderr
    named = "died first, during the run: it recorded no Python error: killed by SIGABRT (Aborted)"
    assert named in out.stderr and "testtasks.py" in out.stderr, out.stderr
    assert named in status(d)["error"]


def test_a_rank_that_raises_is_named_with_its_own_error_not_a_peers(tmp_path):
    """Also: observe.on_event runs its command once for the failure, and a command that fails
    (exit 3) changes nothing of what the run says."""
    d = str(tmp_path / "run")
    command, told = notify_script(str(tmp_path))
    out = run_cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        f"run.dir={d}",
        "task.target=testtasks:CrashOnRank1",
        f"observe.on_event={command}; exit 3",
        "--local",
    )
    assert out.returncode == 1, out.stdout + out.stderr
    # Named by the watcher when it sees rank 1 gone while rank 0 still runs, or, when both ranks
    # ended before it looked, by the cause rank 1 recorded: either way rank 1 and its own error.
    named = (
        "rank 1 (pid " in out.stderr
        and "died first, during the run: task.target 'testtasks:CrashOnRank1' failed in loss"
        in out.stderr
    ) or "error: rank 1: task.target 'testtasks:CrashOnRank1' failed in loss" in out.stderr
    assert named and "ValueError: deliberate failure in the test task" in out.stderr, out.stderr
    s = status(d)
    assert s["state"] == "failed" and "rank 1" in s["error"] and "deliberate failure" in s["error"]
    assert "Connection closed" not in s["error"]
    assert [line[:3] for line in fired(told)] == [("failed", "0", d)]
