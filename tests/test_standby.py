"""Warm restarts' parts that need no Slurm: the srun line a standby can run, the variables and
output files a standby process takes for a rank (as DistEnv reads them), srun's reports read in
ranks, and one real standby process (torch imported, waiting on a socket) that answers, refuses
an output file it cannot open, or becomes `python -m clusterflow.run` in-process. The restarts
themselves run on the real Slurm cluster in tests/test_slurm_recovery.py."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from conftest import REPO

from clusterflow.distributed.env import DistEnv
from clusterflow.job import standby
from clusterflow.slurm import steps

SUBMITIT = [
    "/usr/bin/srun", "--unbuffered", "--output", "/logs/%j/%j_%t_log.out", "--error",
    "/logs/%j/%j_%t_log.err", "--kill-on-bad-exit=1", "/venv/bin/python", "-u", "-m",
    "submitit.core._submit", "/logs/%j",
]  # fmt: skip
TEMPLATE = ["srun", "--kill-on-bad-exit=1", "python3", "-u", "-m", "clusterflow.run", "c.yaml"]


def test_the_standby_runs_the_steps_own_entry_and_output_files():
    p = standby.program(SUBMITIT)
    assert (p.srun, p.flags, p.python, p.module, p.args) == (
        "/usr/bin/srun",
        ("--unbuffered", "--kill-on-bad-exit=1"),
        ("/venv/bin/python", "-u"),
        "submitit.core._submit",
        ("/logs/%j",),
    )
    assert p.files == {"output": "/logs/%j/%j_%t_log.out", "error": "/logs/%j/%j_%t_log.err"}
    p = standby.program(TEMPLATE)
    assert (p.python, p.module, p.args, p.files) == (("python3", "-u"), "clusterflow.run", (
        "c.yaml",
    ), {})  # fmt: skip
    assert standby.program(["srun", "bash", "train.sh"]).startswith("the step's program is not")
    assert "cannot expand" in standby.program(["srun", "-o", "out\\%t", *TEMPLATE[2:]])


def test_with_warm_restarts_the_driver_ends_a_failed_step_itself():
    """srun's own --kill-on-bad-exit SIGTERMs the other ranks and refuses a SIGKILL while they
    exit: the driver's steps run without it (also against a cluster's KillOnBadExit=1)."""
    flags = ["--unbuffered", "--kill-on-bad-exit=1", "-K", "-K1", "--kill-on-bad-exit", "-c", "4"]
    assert steps.driver_ends_it(flags) == ["--kill-on-bad-exit=0", "--unbuffered", "-c", "4"]


def test_a_rank_files_are_named_as_srun_names_them():
    values = {"j": 12, "t": 1, "s": 3, "N": "node3", "n": 1, "J": "12.3"}
    assert steps.expand_pattern("/l/%j_%t_log.out", values) == "/l/12_1_log.out"
    assert steps.expand_pattern("%4t-%%-%N-%J", values) == "0001-%-node3-12.3"
    assert steps.expand_pattern("%Z", values) is None
    assert steps.output_flags(["-K", "-o/a/%t", "--open-mode=append"]) == (
        ["-K", "--open-mode=append"],
        {"output": "/a/%t", "error": "/a/%t"},
    )


def test_a_standby_process_takes_the_place_a_cold_step_would_give_it():
    """A process of a standby step on three nodes, told it is rank 1 of a step on node1 and
    node3: DistEnv reads the place srun would have given it there."""
    standby_step = {
        "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-3]", "SLURM_JOB_NUM_NODES": "3",
        "SLURM_STEP_NODELIST": "node[1-3]", "SLURM_STEP_NUM_NODES": "3", "SLURM_NTASKS": "3",
        "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x3)", "SLURM_TASKS_PER_NODE": "1(x3)",
        "CLUSTERFLOW_RESTART_IN_JOB": "0",
    }  # fmt: skip
    rank = {**standby_step, "CLUSTERFLOW_RESTART_IN_JOB": "2"}
    rank.update(steps.task_environment(["node1", "node3"], 1, 1))
    env = DistEnv.from_env(rank)
    assert (env.rank, env.world_size, env.node_rank, env.num_nodes, env.local_world_size) == (
        1,
        2,
        1,
        2,
        1,
    )
    assert (env.hosts, env.master_addr, env.restart_in_job) == (("node1", "node3"), "node1", 2)
    two = DistEnv.from_env({**rank, **steps.task_environment(["node1", "node3"], 2, 3)})
    assert (two.rank, two.world_size, two.local_rank, two.local_world_size) == (3, 4, 1, 2)


def test_srun_reports_of_a_warm_step_are_read_in_ranks():
    text = (
        f"{steps.STEP_MARK}node1,node2 at 08:00:00\nsrun: error: node2: task 1: Killed\n"
        f"{standby.PREFIX}srun: error: node2: task 1: Terminated\n"
        f"{steps.STEP_MARK}node1,node3 at 08:00:09"
        + steps.TASKS_MARK.format(tasks="0,2", ranks="0,1")
        + "\nsrun: error: node3: task 2: Killed\n"
    )
    assert steps.first_failure(text) == (1, "node3", "Killed")
    assert steps.first_failure(text.rsplit(steps.STEP_MARK, 1)[0]) == (1, "node2", "Killed")


@pytest.fixture
def driver():
    """The driver's side of a standby: a listening socket on this machine."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(300)
    yield server
    server.close()


def _standby_process(server, *command, token="t0ken"):
    env = {**os.environ, standby.TOKEN_ENV: token, "SLURMD_NODENAME": "node9"}
    env.update(SLURM_PROCID="4", SLURM_LOCALID="1", SLURM_STEP_ID="5")
    argv = [sys.executable, "-u", "-m", "clusterflow.job.warm", "--driver"]
    argv += [f"127.0.0.1:{server.getsockname()[1]}", "--", "-m", "clusterflow.run", *command]
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)


def _say(conn, message):
    conn.sendall((json.dumps(message) + "\n").encode())


def test_a_standby_process_answers_then_becomes_a_rank_in_process(driver, tmp_path):
    """Two real standby processes: one refuses an output file it cannot open and leaves; the
    other becomes `python -m clusterflow.run ... --check` with the variables it was given, its
    output in the file named, and exits with the command's status."""
    check = ["configs/tiny.yaml", f"run.dir={tmp_path}/run", "--check"]
    procs = [_standby_process(driver, *check) for _ in range(2)]
    conns = []
    for _ in procs:
        conn, _ = driver.accept()
        reader = conn.makefile("r")
        hello = json.loads(reader.readline())
        assert (hello["token"], hello["node"], hello["local"], hello["task"], hello["step"]) == (
            "t0ken",
            "node9",
            1,
            4,
            "5",
        )
        conns.append((conn, reader, hello["pid"]))
    (a, a_lines, a_pid), (b, b_lines, b_pid) = sorted(
        conns, key=lambda c: [p.pid for p in procs].index(c[2])
    )
    _say(a, {"do": "ping"})
    assert json.loads(a_lines.readline()) == {"pong": a_pid}
    _say(a, {"do": "become", "env": {}, "stdout": str(tmp_path / "no" / "out")})
    assert "cannot open the rank's output file" in json.loads(a_lines.readline())["refused"]
    assert procs[0].wait(timeout=60) == 0

    out = tmp_path / "rank.out"
    # Not a Slurm step here: the rank runs as one process once Slurm's variables are gone.
    gone = [standby.TOKEN_ENV, "SLURM_PROCID", "SLURM_LOCALID"]
    order = {"do": "become", "env": {}, "unset": gone}
    _say(b, {**order, "stdout": str(out), "stderr": str(out), "append": True})
    assert json.loads(b_lines.readline()) == {"ack": b_pid}
    assert procs[1].wait(timeout=300) == 0
    assert procs[1].stdout.read() == ""  # its output went where srun would have put the rank's
    assert "ok: clusterflow.tasks.pseudo_id:PseudoIDTask with 192 training samples" in (
        out.read_text()
    )


def test_a_waiting_standby_process_leaves_on_a_stop_signal(driver):
    """Preemption's SIGTERM or the time limit's signal reach a standby step too: a process that
    waits has nothing to save and leaves with 0, so srun reports nothing."""
    proc = _standby_process(driver, "configs/tiny.yaml")
    conn, _ = driver.accept()
    assert json.loads(conn.makefile("r").readline())["pid"] == proc.pid
    proc.send_signal(signal.SIGUSR2)
    assert proc.wait(timeout=60) == 0
    conn.close()


def test_a_standby_still_importing_is_ended_when_it_is_closed(tmp_path, capfd):
    """The job's training ended while its standby's processes still import (they have not said
    hello): close ends the step at once instead of waiting out their imports, and its process
    never gets to look for the driver. srun here runs the one task itself (no Slurm)."""
    srun = tmp_path / "srun"
    srun.write_text('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n')
    srun.chmod(0o755)
    prog = standby.program([str(srun), "--kill-on-bad-exit=1", sys.executable, "-u", *TEMPLATE[4:]])
    assert isinstance(prog, standby.Program), prog
    env = {**os.environ, "SLURMD_NODENAME": "node9"}
    # The task's module to import ahead: a slow one, so that the process is still importing
    # when close comes (were it waited for, it would then look for the driver, and say so).
    slow = tmp_path / "slowimport.py"
    slow.write_text("import time\ntime.sleep(2)\n")
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    said = []
    warm = standby.Standby(
        prog, ["node9"], 1, env, preload="slowimport", run_dir=str(tmp_path), say=said.append
    )
    try:
        warm.close()
        assert warm.step.proc.poll() is not None  # ended, not left to finish its imports
    finally:
        warm.step.proc.kill()
        warm.step.proc.wait()
    assert "cannot reach the driver" not in capfd.readouterr().out
