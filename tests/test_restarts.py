"""Restart inside the allocation, its pure parts as tables: which failed step a restart cures
(``classify``), on which nodes the next step runs (``plan``), the srun line, the step's own
nodelist in DistEnv, the restarts record and the config keys. The restart itself runs on the real
Slurm cluster in tests/test_slurm_restarts.py."""

import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO

from clusterflow import rundir
from clusterflow.config.job_config import from_dict
from clusterflow.distributed.env import DistEnv
from clusterflow.errors import UserError
from clusterflow.job import attempt
from clusterflow.job.restarts import (
    NODE_FAULT_RESTARTS_ENV,
    Driver,
    Fault,
    classify,
    extra_left_out,
    node_fault_restarts,
    plan,
)
from clusterflow.rundir import first_error, restarts, stragglers
from clusterflow.rundir.states import Cause
from clusterflow.slurm import outcome, steps

KILLED = (1, "node2", "Killed")
EXITED = (1, "node2", "Exited with exit code 1")
ECC = {"rank": 1, "host": "node2", "error": "CUDA error: uncorrectable ECC error", "time": 5.0}
STALL = {"rank": 1, "host": "node2", "error": "rank 1 on node2 stalled", "kind": "stall", "time": 5}
TASK = {"rank": 1, "host": "node2", "error": "task.target 'x:T' failed in loss: ValueError"}
BAD_INPUT = {"rank": 0, "host": "node1", "error": "task.params.size = 3: ...", "exit_code": 2}


@pytest.mark.parametrize(
    "state, first, srun_first, expected",
    [
        ("failed", None, KILLED, ("crash", "node2", False)),  # SIGKILL, OOM killer
        ("failed", TASK, KILLED, ("crash", "node2", False)),  # a peer's error after the kill
        ("failed", None, (0, "node1", "Segmentation fault"), ("crash", "node1", False)),
        ("failed", ECC, EXITED, ("node", "node2", True)),
        ("failed", STALL, (1, "node2", "Exited with exit code 86"), ("stall", "node2", True)),
        ("failed", {**STALL, "waiting": "all_reduce"}, None, ("stall", "node2", False)),
        # srun reported the stalled rank's kill (at 7.0) after the watchdog's record (at 5)
        ("failed", STALL, KILLED, ("stall", "node2", True)),
        ("failed", ECC, KILLED, ("node", "node2", True)),
        # a record written after srun's report of a signal is the kill's consequence
        ("failed", {**STALL, "time": 9}, KILLED, ("crash", "node2", False)),
        ("failed", TASK, EXITED, None),  # the task's own exception: fails as before
        ("failed", BAD_INPUT, None, None),
        ("failed", None, EXITED, None),  # nothing names a cause
        ("failed", None, None, None),
        ("requeued", ECC, KILLED, None),  # a rank requeued the job itself (a node fault, no spare)
        ("completed", None, None, None),
        ("stopped", None, KILLED, None),
        ("cancelled", None, KILLED, None),
    ],
)
def test_which_failures_a_restart_cures(state, first, srun_first, expected):
    fault = classify(state, first, srun_first, 7.0)
    assert (fault and (fault.cause, fault.host, fault.leave_out)) == expected


def crash(host="node2"):
    return Fault("crash", 1, host, "Killed", 1.0, leave_out=False)


def node(host="node2"):
    return Fault("node", 1, host, "CUDA error: uncorrectable ECC error", 1.0, leave_out=True)


ALLOC = ["node1", "node2", "node3"]


@pytest.mark.parametrize(
    "fault, used, alloc, needed, faulty, avoid, expected",
    [
        (crash(), 0, ALLOC, 2, [], [], ("node1", "node3")),  # on the spare
        (crash(), 0, ALLOC[:2], 2, [], [], ("node1", "node2")),  # no spare: the same nodes
        (node(), 0, ALLOC, 2, [], [], ("node1", "node3")),
        (node(), 0, ALLOC[:2], 2, [], [], "too few healthy nodes: 1 of the allocation's 2"),
        (node("node3"), 1, ALLOC, 2, ["node2"], [], "too few healthy nodes: 1"),
        (crash("node3"), 1, ALLOC, 2, [], ["node2"], ("node1", "node2")),  # soft: comes back
        (crash(), 0, ALLOC, 2, [], ["node1"], ("node1", "node3")),  # crash host first, then avoid
        (crash(), 2, ALLOC, 2, [], [], "no restart left (cluster.restarts_in_job=2)"),
        (None, 0, ALLOC, 2, [], [], "not a failure a restart cures"),
        # a straggler (avoid) left out when enough nodes remain, kept when not
        (node("node1"), 0, ALLOC + ["node4"], 2, [], ["node2"], ("node3", "node4")),
        (node("node1"), 0, ALLOC, 2, [], ["node2"], ("node2", "node3")),
    ],
)
def test_where_the_next_step_runs(fault, used, alloc, needed, faulty, avoid, expected):
    p = plan(fault, used, 2, alloc, needed, faulty, avoid)
    if isinstance(expected, tuple):
        assert p.restart and p.nodes == expected
        assert p.left_out == tuple(h for h in alloc if h not in expected)
    else:
        assert not p.restart and p.why.startswith(expected), p.why


def test_a_rank_requeues_a_node_fault_itself_only_where_no_restart_would_cure_it():
    assert node_fault_restarts(0, 2, ALLOC, 2, [])
    assert not node_fault_restarts(2, 2, ALLOC, 2, [])  # exhausted: requeue without the node
    assert not node_fault_restarts(0, 2, ALLOC[:2], 2, [])  # no spare
    assert not node_fault_restarts(1, 2, ALLOC, 2, ["node2"])  # the spare is used up
    assert not attempt._restarted_here("node2", {})
    assert not attempt._restarted_here("node2", {NODE_FAULT_RESTARTS_ENV: "0"})
    assert attempt._restarted_here("node2", {NODE_FAULT_RESTARTS_ENV: "1"})


def test_srun_line_names_the_steps_nodes():
    argv = steps.srun_argv(["srun", "--kill-on-bad-exit=1", "python", "-m", "x"], ["n1", "n3"], 4)
    assert argv == [
        "srun",
        "--nodes=2",
        "--ntasks=8",
        "--ntasks-per-node=4",
        "--nodelist=n1,n3",
        "--kill-on-bad-exit=1",
        "python",
        "-m",
        "x",
    ]
    with pytest.raises(ValueError):
        steps.srun_argv(["python", "-m", "x"], ["n1"], 1)


def test_status_reads_the_newest_steps_report():
    text = (
        f"{steps.STEP_MARK}node1,node2 at 08:00:00\nsrun: error: node2: task 1: Killed\n"
        f"{steps.STEP_MARK}node1,node3 at 08:00:09\nsrun: error: node1: task 0: Segmentation "
        "fault\n"
    )
    assert outcome.first_task_failure(steps.last_step(text)) == (0, "node1", "Segmentation fault")
    assert steps.last_step("srun: error: x") == "srun: error: x"


def test_a_step_on_part_of_the_allocation_reads_its_own_nodes():
    base = {
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "node[1-3]",
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_TASKS_PER_NODE": "1(x3)",
    }
    step = {
        **base,
        "SLURM_STEP_NODELIST": "node[1,3]",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    }
    e = DistEnv.from_env(step)
    assert (e.hosts, e.num_nodes, e.master_addr, e.restart_in_job) == (
        ("node1", "node3"),
        2,
        "node1",
        0,
    )
    again = DistEnv.from_env({**step, "CLUSTERFLOW_RESTART_IN_JOB": "1"})
    assert again.restart_in_job == 1 and again.master_port != e.master_port
    assert DistEnv.from_env(base).hosts == ("node1", "node2", "node3")  # without srun's step vars


def test_the_record_joins_each_restart_with_its_first_step(tmp_path):
    paths = rundir.RunPaths(str(tmp_path))
    assert not restarts.note_first_step(paths, 0, 1)  # a fresh start is no restart
    restarts.record_restart(
        paths, job_id="7", restart=1, failed_attempt=0, next_attempt=1, cause="crash",
        rank=1, host="node2", error="Killed", fault_at=100.0, restart_at=103.0,
        nodes=["node1", "node3"], left_out=["node2"],
    )  # fmt: skip
    (r,) = restarts.read(paths)
    assert "recovery_s" not in r  # not trained again yet
    assert restarts.note_first_step(paths, 1, 9)
    (r,) = restarts.read(paths)
    assert r["first_step"] == 9 and r["recovery_s"] == round(r["first_step_at"] - 100.0, 3)
    with open(paths.restarts, "a") as f:
        f.write('{"event": "restart", "fault_at": "x"\n')  # cut by a kill
    assert len(restarts.read(paths)) == 1


@pytest.mark.parametrize("key", ["restarts_in_job", "spare_nodes"])
def test_the_keys_refuse_a_negative_count(key):
    with pytest.raises(UserError, match=rf"^cluster\.{key} = -1: must be >= 0"):
        from_dict({"cluster": {key: -1}})


def test_the_job_allocates_the_spares_and_runs_the_driver(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "clusterflow.submit",
            "configs/tiny.yaml",
            f"run.dir={tmp_path}/run",
            "cluster.nodes=2",
            "cluster.spare_nodes=1",
            "--dry-run",
        ],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --nodes=3\n" in out.stdout
    assert f"-m clusterflow.job.restarts {tmp_path}/run/config.yaml -- srun " in out.stdout


def test_the_driver_runs_on_all_but_the_spare_nodes(tmp_path):
    cfg = from_dict({"run": {"dir": str(tmp_path)}, "cluster": {"nodes": 2, "spare_nodes": 1}})
    environ = {"SLURM_JOB_NODELIST": "node[1-3]", "SLURM_NTASKS_PER_NODE": "2"}
    d = Driver(cfg, ["srun", "x"], environ)
    assert (d.allocation, d.needed, d.per_node, d.limit) == (["node1", "node2", "node3"], 2, 2, 2)
    assert d._env(0)[NODE_FAULT_RESTARTS_ENV] == "1"
    assert d._env(2)[NODE_FAULT_RESTARTS_ENV] == "0"
    assert d._env(1)["CLUSTERFLOW_RESTART_IN_JOB"] == "1"


@pytest.mark.parametrize("exclude", [True, False])
def test_a_restart_leaves_the_named_stragglers_out_when_asked(tmp_path, exclude):
    """cluster.exclude_stragglers: the nodes of the ranks the straggler watch named (any
    attempt) are left out of the next step; off, nobody is."""
    cfg = from_dict(
        {"run": {"dir": str(tmp_path)}, "cluster": {"nodes": 2, "exclude_stragglers": exclude}}
    )
    paths = rundir.RunPaths(str(tmp_path))
    assert extra_left_out(cfg, paths) == []
    stragglers.record(paths, attempt=0, rank=3, node="node2", ratio=1.5)
    stragglers.record(paths, attempt=1, rank=1, node="node1", ratio=1.3)
    assert extra_left_out(cfg, paths) == (["node1", "node2"] if exclude else [])


def test_the_driver_waits_for_a_record_that_lands_after_srun_reported_the_exit(tmp_path):
    """The stalled rank wrote its record before exiting 86; on a shared filesystem the batch
    node may see it later than srun's report. The driver waits for it (up to RECORD_WAIT_S)."""
    cfg = from_dict({"run": {"dir": str(tmp_path)}, "cluster": {"nodes": 1, "spare_nodes": 1}})
    d = Driver(cfg, ["srun", "x"], {"SLURM_JOB_NODELIST": "node[1-2]"})
    started = time.time()
    end = steps.StepEnd(1, (1, "node2", "Exited with exit code 86"), started + 1, started)

    def land() -> None:
        time.sleep(1.0)
        first_error.record(d.paths, 0, 1, "rank 1 on node2 stalled", host="node2", kind=Cause.STALL)

    writer = threading.Thread(target=land)
    writer.start()
    fault = d._fault(end)
    writer.join()
    assert fault is not None and (fault.cause, fault.host) == ("stall", "node2")
