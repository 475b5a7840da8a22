"""Heartbeats and the stall watchdog wired into real runs (submit --local, gloo), the status side
(manage/ranks.py), and the config keys. The Slurm versions are in test_slurm_stall.py."""

import json
import os
import re
import time

import pytest
from clihelp import call
from conftest import REPO, run_cli
from test_on_event import fired, notify_script

from clusterflow import rundir
from clusterflow.config.job_config import load
from clusterflow.errors import UserError
from clusterflow.launch import submit
from clusterflow.manage import ranks as rank_status
from clusterflow.manage import verdict
from clusterflow.observe import phases
from clusterflow.rundir import first_error, saved_config

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize(
    "overrides, limit",
    [
        ([], 300.0),
        (["dist.timeout_s=60"], 30.0),
        (["dist.stall_s=45"], 45.0),
        (["dist.stall_s=0"], None),
    ],
)
def test_stall_limit(overrides, limit):
    assert load("configs/tiny.yaml", overrides).dist.stall_limit_s == limit


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["dist.stall_s=600"],
            "dist.stall_s = 600: must be 0 (off), or at least 1 s and below dist.timeout_s (600 s)",
        ),
        (
            ["dist.stall_s=soon"],
            "dist.stall_s = 'soon': must be auto, 0 (off) or a number of seconds",
        ),
        (["dist.bucket_cap_mb=0"], "dist.bucket_cap_mb = 0: must be between 1 and 1048576 (1 TB)"),
        (
            ["dist.heartbeat_s=-1"],
            "dist.heartbeat_s = -1.0: must be 0 (off) or between 0.1 and 3600 seconds",
        ),
        (
            ["cluster.gpus=first"],
            "cluster.gpus = 'first': must be auto, a count of GPUs, or a list of GPU indices",
        ),
        (["cluster.gpus=[1,1]"], "cluster.gpus = [1, 1]: must list distinct GPU indices"),
    ],
)
def test_refused(overrides, message):
    with pytest.raises(
        UserError,
        match=message.replace("(", r"\(")
        .replace(")", r"\)")
        .replace("[", r"\[")
        .replace("]", r"\]"),
    ):
        load("configs/tiny.yaml", overrides)


def test_cluster_gpus_as_written_on_the_command_line():
    assert load("configs/tiny.yaml", ["cluster.gpus=0,2"]).cluster.gpus == [0, 2]
    assert load("configs/tiny.yaml", ["cluster.gpus=[3]"]).cluster.gpus == [3]


def test_phases_hand_every_change_and_tick_to_the_beat():
    seen = []
    p = phases.Phases()
    p.beat = lambda step, phase: seen.append((step, phase))
    p.set(phases.TRAIN)
    p.tick(5)
    with p.enter(phases.MINING_EMBED):
        p.tick()
    assert seen == [
        (0, "train"),
        (5, "train"),
        (5, "mining embed"),
        (5, "mining embed"),
        (5, "train"),
    ]


def _run_dir(tmp_path, attempt_started, heartbeat_s=1):
    paths = rundir.RunPaths(str(tmp_path))
    os.makedirs(paths.heartbeats)
    with open(paths.config, "w") as f:
        f.write(f"dist: {{heartbeat_s: {heartbeat_s}}}\n")
    for r in (0, 1):
        with open(paths.heartbeat_file(r), "w") as f:
            json.dump(
                {
                    "rank": r,
                    "host": f"node{r + 1}",
                    "time": time.time() - 40 * r,
                    "step": 7,
                    "phase": "train",
                    "step_time_s": 0.1,
                    "progress_at": time.time(),
                },
                f,
            )
    return paths, {"attempt": 0, "started_at": attempt_started}


def test_status_of_a_running_job_marks_a_silent_rank(tmp_path):
    paths, last = _run_dir(tmp_path, time.time() - 100)
    out = {"state": "running", "world_size": 2, "job_id": "", "error": None}
    rank_status.extend(out, paths, saved_config.read_plain(paths)[0], last, None)
    assert [(r["rank"], r["host"], r["silent"]) for r in out["ranks"]] == [
        (0, "node1", False),
        (1, "node2", True),
    ]
    assert out["ranks_summary"].startswith("rank 1 on node2 is silent (last heartbeat 40 s ago)")
    assert out["slurm"] is None and out["error"] is None
    assert "rank 1 on node2 is silent" in rank_status.table(out)


def test_a_stall_is_the_error_a_peers_later_failure_is_not(tmp_path):
    paths, last = _run_dir(tmp_path, time.time() - 100)
    assert first_error.record(
        rundir.RunPaths(str(tmp_path)),
        0,
        1,
        "rank 1 on node2 stalled 60 s at step 20 in train (x.py:3 f)",
        host="node2",
        kind="stall",
        step=20,
        phase="train",
        stalled_s=60.0,
        where="x.py:3 f",
    )
    assert not first_error.record(
        rundir.RunPaths(str(tmp_path)),
        0,
        0,
        "RuntimeError: Connection closed by peer",
        host="node1",
    )
    decided = verdict.decide(
        verdict.Evidence(
            recorded_state="failed",
            recorded_error="rank 0: RuntimeError: Connection closed by peer",
            attempts=1,
            first_error=first_error.read(rundir.RunPaths(str(tmp_path)), 0),
        )
    )
    assert decided.error == "rank 1 on node2 stalled 60 s at step 20 in train (x.py:3 f)"
    assert decided.stalled["rank"] == 1 and decided.stalled["host"] == "node2"
    out = {"state": decided.state, "world_size": 2, "job_id": "", "error": decided.error}
    rank_status.extend(out, paths, saved_config.read_plain(paths)[0], last, None)
    assert not any(r["silent"] for r in out["ranks"])  # a finished run's ranks are quiet by design
    assert out["ranks_summary"] is None


def test_with_heartbeats_off_no_rank_is_called_silent(tmp_path):
    paths, last = _run_dir(tmp_path, time.time() - 100, heartbeat_s=0)
    out = {"state": "running", "world_size": 2, "job_id": "", "error": None}
    rank_status.extend(out, paths, saved_config.read_plain(paths)[0], last, None)
    assert out["ranks"] == [] and out["ranks_summary"] is None
    assert rank_status.table(out).startswith("no heartbeats in this attempt")


def test_heartbeats_of_an_earlier_attempt_are_not_shown(tmp_path):
    paths, last = _run_dir(tmp_path, time.time() + 600)
    out = {"state": "running", "world_size": 2, "job_id": "", "error": None}
    rank_status.extend(out, paths, saved_config.read_plain(paths)[0], last, None)
    assert [r["heartbeat_age_s"] for r in out["ranks"]] == [None, None]


def test_a_stalled_rank_ends_a_local_job_fast_and_is_named(tmp_path):
    """Also: observe.on_event runs its command for the stall (the attempt's first cause) and
    for the failure it leads to, once each."""
    d = str(tmp_path / "run")
    command, told = notify_script(str(tmp_path))
    t0 = time.time()
    out = run_cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        f"run.dir={d}",
        "task.target=testtasks:StallOnRank1",
        "dist.stall_s=5",
        "dist.heartbeat_s=0.5",
        f"observe.on_event={command}",
        "--local",
        env={"PYTHONPATH": TESTS},
        timeout=300,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    # Ended by the watchdog, not by the collective's timeout (dist.timeout_s, 600 s by default):
    # how much sooner depends on the machine's load, the stalled seconds below on the watchdog.
    assert time.time() - t0 < 600
    # At least dist.stall_s; how many more depends on the load (the watchdog looks once a second),
    # and fewer than the collective's timeout, which would have ended the job otherwise.
    said = re.search(r"stalled (\d+) s at step 2 in train", out.stderr)
    assert "rank 1 (pid" in out.stderr and said and 5 <= int(said.group(1)) < 600, out.stderr
    st = json.loads(run_cli("clusterflow.status", d, "--json").stdout)
    assert st["state"] == "failed"
    # the task's file as it ran: tests/testtasks.py, or its copy frozen into RUN_DIR/code/ at
    # submission
    assert st["error"].startswith("rank 1 on ") and re.search(
        r"stalled \d+ s at step 2 in train \(", st["error"]
    ), st["error"]
    assert "testtasks.py:" in st["error"], st["error"]
    assert st["error"].endswith("sleeping_in_loss)"), st["error"]
    assert [r["rank"] for r in st["ranks"]] == [0, 1] and {r["step"] for r in st["ranks"]} == {2}
    log = open(os.path.join(d, "logs", "rank1.attempt0.log")).read()
    assert "clusterflow watchdog: rank 1 on" in log and "in sleeping_in_loss" in log
    stalls = os.path.join(d, "stalls", "attempt0")
    assert "rank1.stacks.txt" in os.listdir(stalls)
    assert {"flight_recorder_rank_0", "flight_recorder_rank_1"} <= set(
        os.listdir(stalls)
    )  # the peer's too
    assert sorted(line[:3] for line in fired(told)) == [("failed", "0", d), ("stalled", "0", d)]
    stalled = json.load(open(rundir.RunPaths(d).event_file(0, "stalled")))
    assert stalled["by"].startswith("rank 1 on ") and "stalled" in stalled["message"]


def test_local_gpus_are_chosen_before_anything_is_written(tmp_path, monkeypatch):
    d = str(tmp_path / "run")
    monkeypatch.chdir(REPO)  # in-process (tests/clihelp.call, as python -m runs it)
    args = ["configs/tiny.yaml", f"run.dir={d}", "cluster.gpus_per_node=2", "--local"]
    code, _, err = call(submit.main, args)
    assert code == 2 and "Traceback" not in err, err
    assert "cluster.gpus_per_node=2 asks for GPUs, but NVML sees none on this machine" in err
    assert not os.path.exists(d)


def test_a_hung_mining_search_is_named_by_rank_0_not_by_a_waiting_peers_timeout(tmp_path):
    """Rank 0 hangs in its k-NN search while rank 1 waits for the labels: the first cause is rank
    0's stall in the search, not rank 1's collective timing out."""
    d = str(tmp_path / "run")
    out = run_cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        f"run.dir={d}",
        "task.target=testtasks:HangInSearchOnRank0",
        "dist.stall_s=5",
        "dist.heartbeat_s=0.5",
        "mining.timeout_s=10",
        "--local",
        env={"PYTHONPATH": TESTS},
        timeout=300,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    first = first_error.read(
        rundir.RunPaths(d), 0
    )  # what status and a Slurm job's end report as the cause
    assert first["rank"] == 0 and first["kind"] == "stall", first
    assert " in mining search (" in first["error"], first
    assert first["error"].endswith("hanging_in_knn_search)"), first
    st = json.loads(run_cli("clusterflow.status", d, "--json").stdout)
    assert st["state"] == "failed" and "rank 0 on " in st["error"], st
    assert "Timed out" not in st["error"], st["error"]
