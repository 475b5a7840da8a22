"""Why Slurm ended a job: sacct and scontrol text -> a verdict (table tests), and the real local
cluster."""

import os
import subprocess
import time

import pytest

from clusterflow.slurm.outcome import Verdict, ask, parse_sacct, parse_scontrol

# `sacct -j JOB -D -P -n --format=JobID,State,ExitCode,Reason,Start,End,NodeList`, in the shapes
# Slurm's documentation and public reports show (job row, then .batch / .extern / numbered srun
# steps).
T0, T1 = "2026-03-01T10:00:00", "2026-03-01T11:00:00"
OOM_ON_STEP = f"""\
1234|FAILED|1:0|None|{T0}|{T1}|gpu[01-02]
1234.batch|FAILED|1:0||{T0}|{T1}|gpu01
1234.extern|COMPLETED|0:0||{T0}|{T1}|gpu[01-02]
1234.0|OUT_OF_MEMORY|0:125||{T0}|{T1}|gpu[01-02]
"""
OOM_ON_JOB = f"""\
1234|OUT_OF_MEMORY|0:125|None|{T0}|{T1}|gpu01
1234.batch|OUT_OF_MEMORY|0:125||{T0}|{T1}|gpu01
1234.extern|COMPLETED|0:0||{T0}|{T1}|gpu01
"""
NODE_FAIL = f"""\
1234|NODE_FAIL|1:0|None|{T0}|{T1}|gpu[01-02]
1234.batch|CANCELLED|0:15||{T0}|{T1}|gpu01
1234.extern|CANCELLED||{T0}|{T1}|gpu[01-02]
1234.0|CANCELLED|0:15||{T0}|{T1}|gpu[01-02]
"""
TIMEOUT = f"""\
1234|TIMEOUT|0:0|None|{T0}|{T1}|gpu01
1234.batch|CANCELLED|0:15||{T0}|{T1}|gpu01
1234.extern|COMPLETED|0:0||{T0}|{T1}|gpu01
1234.0|CANCELLED|0:15||{T0}|{T1}|gpu01
"""
CANCELLED_BY = f"""\
1234|CANCELLED by 1000|0:0|None|{T0}|{T1}|gpu01
1234.batch|CANCELLED|0:15||{T0}|{T1}|gpu01
1234.extern|COMPLETED|0:0||{T0}|{T1}|gpu01
"""
CANCELLED_PENDING = "1234|CANCELLED by 0|0:0|Dependency|None|2026-03-01T09:00:00|None assigned\n"
PREEMPTED = f"""\
1234|PREEMPTED|0:15|None|{T0}|{T1}|gpu01
1234.batch|CANCELLED|0:15||{T0}|{T1}|gpu01
1234.extern|COMPLETED|0:0||{T0}|{T1}|gpu01
"""
FAILED_EXIT = f"""\
1234|FAILED|2:0|None|{T0}|{T1}|gpu01
1234.batch|FAILED|2:0||{T0}|{T1}|gpu01
1234.extern|COMPLETED|0:0||{T0}|{T1}|gpu01
"""
FAILED_SIGNAL = f"""\
1234|FAILED|0:0|None|{T0}|{T1}|gpu01
1234.batch|COMPLETED|0:0||{T0}|{T1}|gpu01
1234.0|FAILED|0:9||{T0}|{T1}|gpu01
"""
STALLED = f"""\
1234|FAILED|86:0|None|{T0}|{T1}|gpu[01-02]
1234.batch|FAILED|86:0||{T0}|{T1}|gpu01
1234.0|FAILED|86:0||{T0}|{T1}|gpu[01-02]
"""
COMPLETED = f"""\
1234|COMPLETED|0:0|None|{T0}|{T1}|gpu01
1234.batch|COMPLETED|0:0||{T0}|{T1}|gpu01
1234.extern|COMPLETED|0:0||{T0}|{T1}|gpu01
1234.0|COMPLETED|0:0||{T0}|{T1}|gpu01
"""
COMPLETED_STEP_SIGNALLED = f"""\
239023|COMPLETED|0:0|None|{T0}|{T1}|cn001
239023.batch|COMPLETED|0:0||{T0}|{T1}|cn001
239023.extern|COMPLETED|0:0||{T0}|{T1}|cn001
239023.0|CANCELLED|0:10||{T0}|{T1}|cn001
"""
# -D on a job preempted (requeued) twice, then killed for memory on its third attempt
REQUEUED_THEN_OOM = f"""\
1234|PREEMPTED|0:15|None|2026-03-01T08:00:00|2026-03-01T08:30:00|gpu01
1234.batch|CANCELLED|0:15||2026-03-01T08:00:00|2026-03-01T08:30:00|gpu01
1234|REQUEUED|0:0|None|2026-03-01T08:32:00|2026-03-01T09:00:00|gpu02
1234.batch|CANCELLED|0:15||2026-03-01T08:32:00|2026-03-01T09:00:00|gpu02
1234|OUT_OF_MEMORY|0:125|None|{T0}|{T1}|gpu03
1234.batch|OUT_OF_MEMORY|0:125||{T0}|{T1}|gpu03
"""
REQUEUED_PENDING = f"""\
1234|PREEMPTED|0:15|None|{T0}|{T1}|gpu01
1234.batch|CANCELLED|0:15||{T0}|{T1}|gpu01
1234|PENDING|0:0|BeginTime|Unknown|Unknown|None assigned
"""
RUNNING = f"1234|RUNNING|0:0|None|{T0}|Unknown|gpu01\n1234.batch|RUNNING|0:0||{T0}|Unknown|gpu01\n"
ARRAY_TASK = (
    f"1234_7|TIMEOUT|0:0|None|{T0}|{T1}|gpu01\n1234_7.batch|CANCELLED|0:15||{T0}|{T1}|gpu01\n"
)
HETJOB = f"""\
1234+0|FAILED|1:0|None|{T0}|{T1}|gpu01
1234+0.batch|FAILED|1:0||{T0}|{T1}|gpu01
1234+1|OUT_OF_MEMORY|0:125|None|{T0}|{T1}|cpu01
"""


@pytest.mark.parametrize(
    "text,state,code,sig,extra",
    [
        (OOM_ON_STEP, "OUT_OF_MEMORY", 0, 125, {"step": "1234.0", "nodes": "gpu[01-02]"}),
        (OOM_ON_JOB, "OUT_OF_MEMORY", 0, 125, {"step": "1234"}),
        (NODE_FAIL, "NODE_FAIL", 1, 0, {"nodes": "gpu[01-02]", "step": None}),
        (TIMEOUT, "TIMEOUT", 0, 0, {}),
        (CANCELLED_BY, "CANCELLED", 0, 0, {"by": "1000"}),
        (
            CANCELLED_PENDING,
            "CANCELLED",
            0,
            0,
            {"by": "0", "reason": "Dependency", "nodes": "None assigned"},
        ),
        (PREEMPTED, "PREEMPTED", 0, 15, {}),
        (FAILED_EXIT, "FAILED", 2, 0, {}),
        (FAILED_SIGNAL, "FAILED", 0, 9, {"step": "1234.0"}),
        (STALLED, "FAILED", 86, 0, {}),
        (COMPLETED, "COMPLETED", 0, 0, {"step": None}),
        (COMPLETED_STEP_SIGNALLED, "COMPLETED", 0, 10, {"step": "239023.0"}),
        (REQUEUED_THEN_OOM, "OUT_OF_MEMORY", 0, 125, {"attempts": 3, "nodes": "gpu03"}),
        (REQUEUED_PENDING, "PENDING", 0, 0, {"attempts": 2, "reason": "BeginTime"}),
        (RUNNING, "RUNNING", 0, 0, {}),
        (ARRAY_TASK, "TIMEOUT", 0, 0, {}),
        (HETJOB, "OUT_OF_MEMORY", 0, 125, {"step": "1234+1", "attempts": 1}),
    ],
)
def test_parse_sacct(text, state, code, sig, extra):
    v = parse_sacct(text)
    assert (v.state, v.exit_code, v.signal, v.source) == (state, code, sig, "sacct")
    for key, value in extra.items():
        assert getattr(v, key) == value, key


@pytest.mark.parametrize(
    "text,line",
    [
        (
            OOM_ON_STEP,
            (
                "OUT_OF_MEMORY: step 1234.0 was killed for exceeding its host memory on "
                "gpu[01-02]; a CUDA out-of-memory is a Python error in the rank log instead; "
                "raise cluster.mem_gb or lower data.num_workers"
            ),
        ),
        (
            NODE_FAIL,
            (
                "NODE_FAIL: a node failed on gpu[01-02]; resubmit the same config to resume from "
                "the last checkpoint"
            ),
        ),
        (
            TIMEOUT,
            (
                "TIMEOUT: the time limit was reached; raise cluster.time_min or resubmit to resume "
                "from the last checkpoint"
            ),
        ),
        (CANCELLED_BY, "CANCELLED: cancelled by uid 1000 (scancel or an administrator)"),
        (
            PREEMPTED,
            "PREEMPTED: preempted by a higher-priority job and not requeued; resubmit to resume",
        ),
        (FAILED_EXIT, "FAILED: exit code 2 on gpu01; see the rank logs"),
        (FAILED_SIGNAL, "FAILED: killed by signal 9 (SIGKILL) on gpu01; see the rank logs"),
        (
            STALLED,
            (
                "FAILED: exit code 86: a rank's stall watchdog ended it, see "
                "errors/first.attempt*.json"
            ),
        ),
        (COMPLETED, "COMPLETED: exit code 0"),
        (
            COMPLETED_STEP_SIGNALLED,
            (
                "COMPLETED: the job script exited 0, but step 239023.0 was killed by signal 10 "
                "(SIGUSR1)"
            ),
        ),
        (
            REQUEUED_THEN_OOM,
            (
                "OUT_OF_MEMORY: step 1234 was killed for exceeding its host memory on gpu03; a "
                "CUDA out-of-memory is a Python error in the rank log instead; raise "
                "cluster.mem_gb or lower data.num_workers (last of 3 attempts)"
            ),
        ),
    ],
)
def test_verdict_lines(text, line):
    assert parse_sacct(text).line() == line


@pytest.mark.parametrize("text", ["", "\n", "JobID|State|ExitCode\n", "sacct: error: something\n"])
def test_parse_sacct_without_records(text):
    assert parse_sacct(text) is None


def test_ended_and_to_dict():
    v = parse_sacct(TIMEOUT)
    assert v.ended and not parse_sacct(RUNNING).ended
    d = v.to_dict()
    assert d["state"] == "TIMEOUT" and d["line"].startswith("TIMEOUT: ") and d["source"] == "sacct"


# `scontrol show job -o JOB` (22.05); Command= holds spaces and key=value words of its own.
SCONTROL = (
    "JobId=77 JobName=clusterflow UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 "
    "Nice=0 Account=(null) QOS=(null) JobState={state} Reason={reason} Dependency=(null) Requeue=1 "
    "Restarts={restarts} BatchFlag=1 Reboot=0 ExitCode={code} RunTime=00:00:29 TimeLimit=00:10:00 "
    "TimeMin=N/A NodeList=node[1-2] BatchHost=node1 NumNodes=2 NumCPUs=2 NumTasks=2 "
    "Command=/work/slurm_templates/train.sbatch configs/tiny.yaml run.dir=/tmp/x Reason=fake "
    "ExitCode=9:9 WorkDir=/work StdErr=/tmp/x/slurm-77.out StdIn=/dev/null "
    "StdOut=/tmp/x/slurm-77.out Power=\n"
)


@pytest.mark.parametrize(
    "state,reason,restarts,code,expect",
    [
        ("COMPLETED", "None", 0, "0:0", ("COMPLETED", 0, 0, 1, "None")),
        ("OUT_OF_MEMORY", "OutOfMemory", 0, "0:125", ("OUT_OF_MEMORY", 0, 125, 1, "OutOfMemory")),
        ("NODE_FAIL", "NodeDown", 2, "1:0", ("NODE_FAIL", 1, 0, 3, "NodeDown")),
        ("TIMEOUT", "TimeLimit", 0, "0:0", ("TIMEOUT", 0, 0, 1, "TimeLimit")),
        ("FAILED", "NonZeroExitCode", 1, "3:0", ("FAILED", 3, 0, 2, "NonZeroExitCode")),
        ("PENDING", "BeginTime", 1, "0:0", ("PENDING", 0, 0, 2, "BeginTime")),
    ],
)
def test_parse_scontrol(state, reason, restarts, code, expect):
    v = parse_scontrol(SCONTROL.format(state=state, reason=reason, restarts=restarts, code=code))
    assert (v.state, v.exit_code, v.signal, v.attempts, v.reason) == expect
    assert v.source == "scontrol" and v.nodes == "node[1-2]"


@pytest.mark.parametrize("text", ["", "slurm_load_jobs error: Invalid job id specified\n"])
def test_parse_scontrol_without_a_record(text):
    assert parse_scontrol(text) is None


def test_ask_refuses_what_is_not_a_job_id():
    v = ask("12; rm -rf /")
    assert v == Verdict("UNKNOWN", "none", note="'12; rm -rf /' is not a Slurm job id")


# -- the real local cluster (no slurmdbd, so sacct fails and scontrol answers) ---------------------


def _sbatch(tmp_path, *args):
    out = subprocess.run(
        ["sbatch", "--parsable", f"--output={tmp_path}/slurm-%j.out", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def _until(job_id, states, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = parse_scontrol(
            subprocess.run(
                ["scontrol", "show", "job", "-o", job_id],
                check=False,
                capture_output=True,
                text=True,
            ).stdout
        )
        if v is not None and v.state in states:
            return v
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} never reached {states}")


@pytest.mark.slurm
def test_ask_the_local_cluster_falls_back_to_scontrol(cluster, tmp_path):
    failed = _sbatch(tmp_path, "--wrap", "exit 3")
    killed = _sbatch(tmp_path, "--wrap", "kill -9 $$")
    sleeper = _sbatch(tmp_path, "--wrap", "sleep 300")
    _until(sleeper, ("RUNNING",))
    subprocess.run(["scancel", sleeper], check=True, timeout=30)
    for job in (failed, killed, sleeper):
        _until(job, ("FAILED", "CANCELLED", "COMPLETED"))
    v = ask(failed)
    assert (v.state, v.exit_code, v.signal, v.source) == ("FAILED", 3, 0, "scontrol"), v
    assert (
        v.note
        == "sacct unavailable (Slurm accounting storage is disabled); this is scontrol's record"
    )
    assert v.line() == (
        f"FAILED: exit code 3 on {v.nodes}; see the rank logs; sacct unavailable (Slurm accounting "
        "storage is disabled); this is scontrol's record"
    )
    v = ask(killed)
    assert (v.state, v.signal) == ("FAILED", 9), v
    v = ask(sleeper)
    assert v.state == "CANCELLED" and v.source == "scontrol", v
    print("\n".join(ask(j).line() for j in (failed, killed, sleeper)))
    gone = ask("999999")
    assert gone.state == "UNKNOWN" and gone.source == "none"
    assert gone.note.startswith(
        "sacct unavailable (Slurm accounting storage is disabled); scontrol: "
    )
    assert "Invalid job id" in gone.note
    assert os.path.exists(tmp_path / f"slurm-{failed}.out")
