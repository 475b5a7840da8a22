"""Restart inside the allocation, its pure parts as tables: which failed step a restart cures
(``classify``), on which nodes the next step runs (``plan``), the srun line, the step's own
nodelist in DistEnv, the restarts record and the config keys. The restart itself runs on the real
Slurm cluster in tests/test_slurm_restarts.py."""

import json
import os
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
from clusterflow.job import restarts as restarts_module
from clusterflow.job.restarts import (
    NODE_FAULT_RESTARTS_ENV,
    Driver,
    Fault,
    classify,
    extra_left_out,
    node_fault_restarts,
    plan,
    silent_peer,
)
from clusterflow.rundir import first_error, restarts, stragglers
from clusterflow.rundir import tries as tries_module
from clusterflow.rundir.states import Cause
from clusterflow.slurm import outcome, steps

KILLED = (1, "node2", "Killed")
EXITED = (1, "node2", "Exited with exit code 1")
ECC = {"rank": 1, "host": "node2", "error": "CUDA error: uncorrectable ECC error", "time": 5.0}
STALL = {"rank": 1, "host": "node2", "error": "rank 1 on node2 stalled", "kind": "stall", "time": 5}
TASK = {"rank": 1, "host": "node2", "error": "task.target 'x:T' failed in loss: ValueError"}
BAD_INPUT = {"rank": 0, "host": "node1", "error": "task.params.size = 3: ...", "exit_code": 2}
FULL = {
    "rank": 0,
    "host": "node1",
    "time": 5.0,
    "error": "no space left on tmpfs (mounted at /ck) writing checkpoint step 8 to "
    "/ck/run/checkpoints/step-8 (it needs about 0.3 MB, 0.0 MB free); free space there and "
    "resubmit: the run resumes from its last committed checkpoint",
}


@pytest.mark.parametrize(
    "state, first, srun_first, expected",
    [
        ("failed", None, KILLED, ("crash", "node2", False)),  # SIGKILL, OOM killer
        ("failed", TASK, KILLED, ("crash", "node2", False)),  # a peer's error after the kill
        ("failed", None, (0, "node1", "Segmentation fault"), ("crash", "node1", False)),
        ("failed", ECC, EXITED, ("node", "node2", True)),
        ("failed", STALL, (1, "node2", "Exited with exit code 86"), ("stall", "node2", True)),
        # a waiting rank, nobody's heartbeat silent: its node is used again
        ("failed", {**STALL, "waiting": "all_reduce"}, None, ("stall", "node2", False)),
        # srun reported the stalled rank's kill (at 7.0) after the watchdog's record (at 5)
        ("failed", STALL, KILLED, ("stall", "node2", True)),
        ("failed", ECC, KILLED, ("node", "node2", True)),
        # a record written after srun's report of a signal is the kill's consequence
        ("failed", {**STALL, "time": 9}, KILLED, ("crash", "node2", False)),
        # a full disk: the step runs again where it ran, once the disk has room
        ("failed", FULL, (0, "node1", "Exited with exit code 1"), ("disk", "node1", False)),
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
    "fault, alloc, needed, faulty, avoid, expected",
    [
        (crash(), ALLOC, 2, [], [], ("node1", "node3")),  # on the spare
        (crash(), ALLOC[:2], 2, [], [], ("node1", "node2")),  # no spare: the same nodes
        (node(), ALLOC, 2, [], [], ("node1", "node3")),
        (node(), ALLOC[:2], 2, [], [], "too few healthy nodes: 1 of the allocation's 2"),
        (node("node3"), ALLOC, 2, ["node2"], [], "too few healthy nodes: 1"),
        (crash("node3"), ALLOC, 2, [], ["node2"], ("node1", "node2")),  # soft: comes back
        (crash(), ALLOC, 2, [], ["node1"], ("node1", "node3")),  # crash host first, then avoid
        (None, ALLOC, 2, [], [], "not a failure a restart cures"),
        # a straggler (avoid) left out when enough nodes remain, kept when not
        (node("node1"), ALLOC + ["node4"], 2, [], ["node2"], ("node3", "node4")),
        (node("node1"), ALLOC, 2, [], ["node2"], ("node2", "node3")),
    ],
)
def test_where_the_next_step_runs(fault, alloc, needed, faulty, avoid, expected):
    p = plan(fault, alloc, needed, faulty, avoid)
    if isinstance(expected, tuple):
        assert p.restart and p.nodes == expected
        assert p.left_out == tuple(h for h in alloc if h not in expected)
    else:
        assert not p.restart and p.why.startswith(expected), p.why


def frozen(host="node2", avoid=True):
    """A stall whose cause is rank 1's silent heartbeat (``avoid``: its node always left out),
    or a rank that waited."""
    return Fault("stall", 1, host, "no heartbeat for 20 s", 1.0, leave_out=avoid, avoid=avoid)


@pytest.mark.parametrize(
    "fault, alloc, faulty, expected",
    [
        (node(), ALLOC[:2], [], (("node1",), True)),  # a device error, no spare: node1 alone
        (frozen(), ALLOC[:2], [], (("node1",), True)),  # a frozen rank's node: left out too
        (frozen(), ALLOC, [], (("node1", "node3"), False)),  # with a spare the world stays
        (crash(), ALLOC[:2], [], (("node1", "node2"), False)),  # a crash's node is used again
        (frozen(avoid=False), ALLOC[:2], [], (("node1", "node2"), False)),  # it only waited
        (node("node1"), ALLOC[:2], ["node2"], "too few healthy nodes: 0"),  # nothing left
    ],
)
def test_without_a_spare_the_job_shrinks_to_its_healthy_nodes(fault, alloc, faulty, expected):
    p = plan(fault, alloc, 2, faulty, (), shrink=True)
    if isinstance(expected, tuple):
        assert p.restart and (p.nodes, p.shrunk) == expected
        assert p.left_out == tuple(h for h in alloc if h not in expected[0])
    else:
        assert not p.restart and p.why.startswith(expected), p.why
    # cluster.shrink=false: as before, never on fewer nodes (no restart, or the same nodes)
    assert not plan(fault, alloc, 2, faulty, ()).shrunk


def test_a_rank_requeues_a_node_fault_itself_only_where_no_restart_would_cure_it():
    assert node_fault_restarts(2, ALLOC[:2], 2, [], shrink=True)  # the job shrinks instead
    assert not node_fault_restarts(2, ALLOC[:2], 2, ["node2"], shrink=True)  # one node left
    assert node_fault_restarts(2, ALLOC, 2, [])
    # restarts in the job off: the rank requeues without the node
    assert not node_fault_restarts(0, ALLOC, 2, [])
    assert not node_fault_restarts(2, ALLOC[:2], 2, [])  # no spare
    assert not node_fault_restarts(2, ALLOC, 2, ["node2"])  # the spare is used up
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
    # however many restarts came before: a fault after progress is restarted here
    assert d._env(2)[NODE_FAULT_RESTARTS_ENV] == "1"
    d.faulty += ["node2", "node3"]  # one node left: the rank requeues without its node
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


def test_a_record_written_before_srun_reported_a_peers_signal_is_waited_for(tmp_path):
    """Under load srun may report a peer's signal first (the stalled rank still dumping its
    stacks, or its record not yet visible on the batch node): the stall recorded before that
    report is the cause, so the driver waits for it before calling the step a crash."""
    cfg = from_dict({"run": {"dir": str(tmp_path)}, "cluster": {"nodes": 1, "spare_nodes": 1}})
    d = Driver(cfg, ["srun", "x"], {"SLURM_JOB_NODELIST": "node[1-2]"})
    started = time.time()
    end = steps.StepEnd(137, (0, "node1", "Killed"), started + 1, started)

    def land() -> None:
        time.sleep(1.0)  # visible a second after srun's report, stamped before it
        first_error.record(
            d.paths, 0, 1, "rank 1 on node2 stalled", host="node2", kind=Cause.STALL,
            time=started + 0.5,
        )  # fmt: skip

    writer = threading.Thread(target=land)
    writer.start()
    fault = d._fault(end)
    writer.join()
    assert fault is not None, "no fault"
    assert (fault.cause, fault.rank, fault.host, fault.leave_out) == ("stall", 1, "node2", True)


# The healthy rank 0 waited in a collective until its watchdog ended it (at 100.0); rank 1's
# process froze (SIGSTOP, a hung node): its heartbeat thread stopped with it.
VICTIM = {
    "rank": 0,
    "host": "node1",
    "kind": "stall",
    "error": "rank 0 on node1 stalled 20 s at step 3 in train (...), waiting in allreduce",
    "waiting": "allreduce (torch/distributed/distributed_c10d.py)",
    "time": 100.0,
}


def beat(rank, host, at, every_s=0.5, paused=(None, None)):
    return {
        "rank": rank,
        "host": host,
        "time": at,
        "heartbeat_s": every_s,
        "paused_from": paused[0],
        "paused_to": paused[1],
    }


@pytest.mark.parametrize(
    "beats, expected",
    [
        # rank 1 quiet for 22 s when the watchdog fired; rank 0 wrote 0.3 s before
        ([beat(0, "node1", 99.7), beat(1, "node2", 78.0)], (1, "node2", 22.0)),
        # Slurm's SIGCONT before the step's SIGTERM woke it: it wrote again after the record, and
        # its longest pause spans the record's time
        (
            [beat(0, "node1", 99.7), beat(1, "node2", 101.2, paused=(78.0, 100.9))],
            (1, "node2", 22.0),
        ),
        # a long pause that ended before the record (a slow start) is no silence then
        ([beat(0, "node1", 99.7), beat(1, "node2", 101.2, paused=(40.0, 70.0))], None),
        # every rank wrote within 1.5 periods and 2 s: nobody went silent (the waiting rank stays
        # blamed)
        ([beat(0, "node1", 99.7), beat(1, "node2", 98.9)], None),
        # the quietest of two silent ranks
        ([beat(0, "node1", 99.7), beat(1, "node2", 80), beat(2, "node2", 60)], (2, "node2", 40.0)),
        # slow heartbeats (10 s): 15 s without one is within 1.5 periods and a margin
        ([beat(0, "node1", 99, 10), beat(1, "node2", 85, 10)], None),
        ([beat(0, "node1", 99, 10), beat(1, "node2", 70, 10)], (1, "node2", 30.0)),
        ([], None),  # heartbeats off
    ],
)
def test_the_rank_whose_heartbeat_went_silent_is_found(beats, expected):
    assert silent_peer(VICTIM, beats) == expected


def test_a_long_stall_limit_asks_a_longer_silence():
    """Half the watchdog's limit at least: a shared filesystem may show a heartbeat tens of
    seconds late, which a limit of minutes leaves room for."""
    beats = [beat(0, "node1", 99, 10), beat(1, "node2", 75, 10)]
    assert silent_peer(VICTIM, beats, stall_s=10) == (1, "node2", 25.0)
    assert silent_peer(VICTIM, beats, stall_s=60) is None


def test_a_waiting_ranks_stall_blames_the_rank_whose_heartbeat_went_silent():
    """SIGSTOP on rank 1: the healthy rank 0, waiting for it, is the one the watchdog ends. The
    silent rank is the cause: named, and its node left out where a spare allows; the waiting
    rank's node is used again (docs/restarts.md)."""
    fault = classify("failed", VICTIM, (0, "node1", "Exited with exit code 86"), 101.0,
                     silent=(1, "node2", 22.0))  # fmt: skip
    assert (fault.cause, fault.rank, fault.host) == ("stall", 1, "node2")
    assert "no heartbeat for 22 s" in fault.error and "rank 0 on node1" in fault.error
    p = plan(fault, ALLOC, 2)
    assert p.nodes == ("node1", "node3") and p.left_out == ("node2",)
    # no spare: never the frozen rank's node again (the job shrinks, or is requeued without it)
    assert plan(fault, ALLOC[:2], 2, shrink=True).nodes == ("node1",)
    assert plan(fault, ALLOC[:2], 2).why.startswith("too few healthy nodes")
    # nobody silent: the waiting rank's own node is used again, not left out
    waiting = classify("failed", VICTIM, (0, "node1", "Exited with exit code 86"), 101.0)
    assert (waiting.cause, waiting.rank, waiting.host) == ("stall", 0, "node1")
    assert plan(waiting, ALLOC, 2).nodes == ("node1", "node2")
    # the waiting rank's watchdog named the rank that stopped (it read the heartbeats itself)
    named = {
        **VICTIM,
        "silent_rank": 1,
        "silent_host": "node2",
        "silent_s": 12.0,
        "error": "rank 1 on node2 stopped: no heartbeat for 12 s, ...; rank 0 on node1 ...",
    }
    fault = classify("failed", named, (0, "node1", "Exited with exit code 86"), 101.0)
    assert (fault.cause, fault.rank, fault.host, fault.leave_out) == ("stall", 1, "node2", True)
    assert fault.error == named["error"]


def test_the_driver_reads_the_heartbeats_of_the_failed_step(tmp_path):
    cfg = from_dict(
        {
            "run": {"dir": str(tmp_path)},
            "cluster": {"nodes": 2, "spare_nodes": 1},
            "dist": {"stall_s": 20},
        }
    )
    d = Driver(cfg, ["srun", "x"], {"SLURM_JOB_NODELIST": "node[1-3]"})
    now = time.time()
    os.makedirs(d.paths.heartbeats, exist_ok=True)
    # rank 1 was frozen from now - 25 until the step's end woke it (SIGCONT), after the record
    for b in (beat(0, "node1", now - 0.2), beat(1, "node2", now + 2, paused=(now - 25, now + 1.5))):
        with open(d.paths.heartbeat_file(b["rank"]), "w") as f:
            json.dump({**b, "step": 3, "phase": "train"}, f)
    first_error.record(
        d.paths, 0, 0, VICTIM["error"], host="node1", kind=Cause.STALL,
        waiting=VICTIM["waiting"],
    )  # fmt: skip
    end = steps.StepEnd(86, (0, "node1", "Exited with exit code 86"), now, now - 60, now)
    fault = d._fault(end)
    assert (fault.cause, fault.rank, fault.host) == ("stall", 1, "node2"), fault


def test_the_batch_step_exits_with_the_code_of_the_task_that_failed_first(tmp_path, monkeypatch):
    """Bad input on one rank (exit 2): srun ends its peers with SIGTERM and itself returns 143,
    which would read like a SIGTERM in sacct; the batch step exits 2, as the README says, and a
    task killed by a signal first keeps srun's own status."""
    monkeypatch.setattr(restarts_module, "RECORD_WAIT_S", 0.2)
    srun = tmp_path / "srun"
    srun.write_text(
        "#!/bin/sh\n"
        'echo "srun: error: node1: task 0: $FIRST" >&2\n'
        'echo "srun: error: node2: task 1: Terminated" >&2\n'
        "exit 143\n"
    )
    srun.chmod(0o755)
    cfg = from_dict({"run": {"dir": str(tmp_path / "run")}, "cluster": {"nodes": 2}})
    for first, code in (("Exited with exit code 2", 2), ("Killed", 143)):
        environ = {**os.environ, "SLURM_JOB_NODELIST": "node[1-2]", "FIRST": first}
        d = Driver(cfg, [str(srun), "x"], environ)
        d.limit = 0  # no restart: the step's end is the job's
        assert d.run() == code, first


FAKE_SRUN = """#!/bin/sh
# A node check (job/nodecheck.py's step): one line per node of --nodelist; $UNFIT's node fails.
case "$*" in *clusterflow.job.nodecheck*)
  for a in "$@"; do case "$a" in --nodelist=*) nodes="${a#--nodelist=}";; esac; done
  for n in $(echo "$nodes" | tr , ' '); do
    p='[]'
    [ "$n" = "$UNFIT" ] && p='["the memory folder /dev/shm/x is not writable"]'
    echo "{\\"node\\": \\"$n\\", \\"problems\\": $p}"
  done
  echo "$nodes" >> "$CHECKED"
  exit 0;;
esac
# A training step: rank 1 on the step's second node is killed, $CRASHES times in all.
n=$(cat "$COUNT" 2>/dev/null || echo 0); echo $((n + 1)) > "$COUNT"
for a in "$@"; do case "$a" in --nodelist=*) echo "${a#--nodelist=}" >> "$STEPS";; esac; done
if [ "$n" -lt "$CRASHES" ]; then
  echo "srun: error: node2: task 1: Killed" >&2
  exit 137
fi
exit 0
"""


def _fake_driver(tmp_path, monkeypatch, crashes, unfit="", limit=2):
    monkeypatch.setattr(restarts_module, "RECORD_WAIT_S", 0.2)
    monkeypatch.setattr(restarts_module, "KILLED_RECORD_WAIT_S", 0.1)
    srun = tmp_path / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(0o755)
    run = tmp_path / "run"
    cfg = from_dict(
        {
            "run": {"dir": str(run)},
            "cluster": {"nodes": 2, "spare_nodes": 1, "restarts_in_job": limit},
        }
    )
    os.makedirs(run, exist_ok=True)
    (run / "config.yaml").write_text("run: {dir: .}\n")
    environ = {
        **os.environ,
        "SLURM_JOB_NODELIST": "node[1-3]",
        "SLURM_JOB_ID": "77",
        "UNFIT": unfit,
        "CRASHES": str(crashes),
        "COUNT": str(tmp_path / "count"),
        "STEPS": str(tmp_path / "steps"),
        "CHECKED": str(tmp_path / "checked"),
    }
    return Driver(cfg, [str(srun), "x"], environ)


def test_a_node_that_fails_its_check_is_left_out_and_named(tmp_path, monkeypatch, capsys):
    """Rank 1 on node2 killed; the spare node3 fails its check before the restart uses it: it
    is named and left out, and the step runs again on node1 and node2 (no spare left)."""
    d = _fake_driver(tmp_path, monkeypatch, crashes=1, unfit="node3")
    assert d.run() == 0
    assert (tmp_path / "steps").read_text().split() == ["node1,node2", "node1,node2"]
    # node3 checked first (the plan's choice), then node2 once node3 was out
    assert (tmp_path / "checked").read_text().split() == ["node1,node3", "node2"]
    (r,) = restarts.read(d.paths)
    assert r["nodes"] == ["node1", "node2"] and r["left_out"] == ["node3"], r
    assert r["unfit"] == {"node3": "the memory folder /dev/shm/x is not writable"}, r
    said = capsys.readouterr().err
    assert (
        "clusterflow: node node3 left out of the restart: the memory folder /dev/shm/x is not "
        "writable" in said
    ), said
    assert d.faulty == ["node3"]


def test_a_step_that_keeps_failing_without_progress_ends_the_job_failed(
    tmp_path, monkeypatch, capsys
):
    """Nothing committed between the faults: restarts_in_job=1 allows one restart of the step,
    the second fault ends the job failed, saying so in status.json."""
    d = _fake_driver(tmp_path, monkeypatch, crashes=5, limit=1)
    assert d.run() == 137
    assert (tmp_path / "count").read_text().strip() == "2"  # two tries of the step, no third
    record, _ = rundir.read_object(d.paths.status)
    assert record["state"] == "failed", record
    assert record["error"].startswith("no progress past step 0: tried 2 times"), record
    assert "rank 1 on node2: Killed (crash)" in record["error"]
    assert [x["tries"] for x in tries_module.read(d.paths)] == [1, 2]
    said = capsys.readouterr().err
    assert "restart 1 in job 77 after rank 1 on node2: Killed (crash)" in said, said
    assert "try 2 of at most 2" in said, said
    assert "not restarted in the job after rank 1 on node2: Killed (crash): no progress" in said


def test_a_full_disk_is_waited_for_until_it_has_room(tmp_path, monkeypatch, capsys):
    cfg = from_dict({"run": {"dir": str(tmp_path)}, "cluster": {"nodes": 1}})
    d = Driver(cfg, ["srun", "x"], {"SLURM_JOB_NODELIST": "node1"})
    fault = classify("failed", FULL, (0, "node1", "Exited with exit code 1"), 7.0)
    assert fault.room == ("/ck/run/checkpoints/step-8", 300_000)
    free = iter([0, 1000, 17 * 2**20])
    monkeypatch.setattr(restarts_module.diskfull, "free_bytes", lambda path: next(free))
    monkeypatch.setattr(restarts_module, "ROOM_POLL_S", 0.01)
    assert d._room(fault.room)
    said = capsys.readouterr().err
    assert "waiting for room on /ck/run/checkpoints/step-8's filesystem" in said, said
    assert f"{17 * 2**20} bytes free on /ck/run/checkpoints/step-8's filesystem" in said
    monkeypatch.setattr(restarts_module.diskfull, "free_bytes", lambda path: 0)
    monkeypatch.setattr(restarts_module, "ROOM_WAIT_S", 0.05)
    assert not d._room(fault.room)


def test_a_frozen_rank_without_a_spare_is_requeued_without_its_node_by_the_driver(
    tmp_path, monkeypatch, fake_slurm
):
    """No spare and cluster.shrink=false: the frozen rank cannot requeue the job itself, so the
    driver does, leaving the frozen rank's node out; the fault is one try of the step."""
    monkeypatch.setattr(restarts_module, "RECORD_WAIT_S", 0.2)
    fake_slurm.answer(
        "scontrol",
        stdout="JobId=77 BatchFlag=1 Partition=wide NumNodes=2 ExcNodeList=(null) "
        "ReqNodeList=(null)\n",
    )
    fake_slurm.answer("sinfo", stdout="node[1-3]\n")
    srun = tmp_path / "srun"
    srun.write_text(
        "#!/bin/sh\necho 'srun: error: node1: task 0: Exited with exit code 86' >&2\nexit 86\n"
    )
    srun.chmod(0o755)
    run = tmp_path / "run"
    cluster = {"nodes": 2, "shrink": False}
    cfg = from_dict({"run": {"dir": str(run)}, "cluster": cluster, "dist": {"stall_s": 10}})
    run.mkdir()
    (run / "config.yaml").write_text("run: {dir: .}\n")
    environ = {**os.environ, "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "77"}
    d = Driver(cfg, [str(srun), "x"], environ)
    first_error.record(
        d.paths, 0, 0, "rank 1 on node2 stopped: no heartbeat for 12 s, no progress (...); ...",
        host="node1", kind=Cause.STALL, time=time.time() + 5, waiting="all_gather (...)",
        silent_rank=1, silent_host="node2", silent_s=12.0,
    )  # fmt: skip
    assert d.run() == 0  # requeued: the job comes back without node2
    calls = fake_slurm.calls()
    assert "scontrol requeue 77" in calls, calls
    assert "scontrol update JobId=77 ExcNodeList=node2" in calls, calls
    record, _ = rundir.read_object(d.paths.status)
    assert record["state"] == "requeued", record
    (fault,) = tries_module.read(d.paths)
    assert (fault["rank"], fault["host"], fault["cause"]) == (1, "node2", "stall"), fault
    assert fault["tries"] == 1, fault
    assert restarts.read(d.paths) == []  # no restart inside the job
