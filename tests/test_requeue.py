"""The whole after-stop policy as a table, without a cluster (like submitit's
test_requeuing_checkpointable)."""

import pytest

from clusterflow.job.requeue import NO_SCONTROL, Action, decide

LIMIT = 2
TABLE = [
    # outcome, source, slurm_state, timeouts so far (this one included) -> action
    ("completed", "slurm", "RUNNING", 0, Action("completed", "completed")),
    ("completed", "single", None, 0, Action("completed", "completed")),
    (
        "timeout",
        "slurm",
        "",
        1,
        Action("timeout", "requeued", requeue=True, why="the time-limit signal"),
    ),
    (
        "timeout",
        "torchrun",
        "",
        2,
        Action("timeout", "requeued", requeue=True, why="the time-limit signal"),
    ),
    (
        "timeout",
        "slurm",
        "",
        3,
        Action(
            "timeout",
            "stopped",
            error="time limit reached 3 times (cluster.max_timeout_requeues=2); "
            "resume by submitting the same config again",
        ),
    ),
    (
        "preempted",
        "slurm",
        "RUNNING",
        0,
        Action("preempted", "requeued", requeue=True, why="the preemption signal (SIGTERM)"),
    ),
    (
        "preempted",
        "slurm",
        "RUNNING",
        5,
        Action("preempted", "requeued", requeue=True, why="the preemption signal (SIGTERM)"),
    ),
    (
        "preempted",
        "slurm",
        "COMPLETING",
        0,
        Action("preempted", "requeued"),
    ),  # scontrol requeue under way
    ("preempted", "slurm", "CANCELLED", 0, Action("preempted", "stopped")),  # scancel
    ("preempted", "slurm", "", 0, Action("preempted", "requeued")),  # scontrol did not answer
    # a container without scontrol: the batch script outside requeues (exit 75)
    (
        "preempted",
        "slurm",
        NO_SCONTROL,
        0,
        Action("preempted", "requeued", requeue=True, why="the preemption signal (SIGTERM)"),
    ),
    ("preempted", "single", None, 0, Action("preempted", "requeued")),
    (
        "timeout",
        "torchrun",
        None,
        9,
        Action("timeout", "requeued"),
    ),  # torchrun outside Slurm: nobody requeues
    ("preempted", "submitit-local", None, 0, Action("preempted", "stopped")),
    ("timeout", "submitit-local", None, 1, Action("timeout", "stopped")),
    # a user's cancel or Ctrl-C: never requeued, whoever launched the job
    ("cancelled", "slurm", "", 0, Action("cancelled", "cancelled")),
    ("cancelled", "submitit-local", None, 0, Action("cancelled", "cancelled")),
    ("interrupted", "slurm", "", 0, Action("interrupted", "stopped")),
    ("interrupted", "submitit-local", None, 0, Action("interrupted", "stopped")),
]


@pytest.mark.parametrize(
    "outcome,source,slurm_state,timeouts,want",
    TABLE,
    ids=[f"{t[0]}-{t[1]}-{t[2]}-{t[3]}" for t in TABLE],
)
def test_decide(outcome, source, slurm_state, timeouts, want):
    assert decide(outcome, source, slurm_state, timeouts, LIMIT) == want


def test_after_stop_counts_time_limit_stops_in_one_place(tmp_path):
    """Outside Slurm nothing is requeued, but every stop is recorded; timeouts are counted from
    stops.jsonl only (the counter the decision reads)."""
    import json

    from clusterflow import rundir
    from clusterflow.distributed import DistEnv
    from clusterflow.job.requeue import after_stop

    paths = rundir.RunPaths(str(tmp_path))
    env = DistEnv.from_env({})
    assert after_stop(paths, "timeout", env, {}, LIMIT, 12.5) == "timeout"
    assert after_stop(paths, "preempted", env, {}, LIMIT, None) == "preempted"
    assert after_stop(paths, "completed", env, {}, LIMIT, None) == "completed"
    stops = [json.loads(line) for line in open(paths.stops)]
    assert [s["reason"] for s in stops] == ["timeout", "preempted"] and stops[0][
        "signal_at"
    ] == 12.5
    assert rundir.count_stops(paths, "timeout") == 1
    assert rundir.read_json(paths.status)["state"] == "completed"


INTERACTIVE = [
    # inside `salloc`: Slurm requeues batch jobs only, so a stop is a clean stop, never a failure
    ("timeout", "slurm", "", 1, Action("stopped", "stopped")),
    ("timeout", "slurm", "", 3, Action("stopped", "stopped")),
    ("preempted", "slurm", "RUNNING", 0, Action("stopped", "stopped")),
    ("timeout", "torchrun", "", 1, Action("stopped", "stopped")),
    ("cancelled", "slurm", "", 0, Action("cancelled", "cancelled")),
    ("interrupted", "slurm", "", 0, Action("interrupted", "stopped")),
    ("completed", "slurm", "", 0, Action("completed", "completed")),
]


@pytest.mark.parametrize(
    "outcome,source,slurm_state,timeouts,want",
    INTERACTIVE,
    ids=[f"{t[0]}-{t[1]}-{t[2]}-{t[3]}" for t in INTERACTIVE],
)
def test_decide_in_an_interactive_allocation(outcome, source, slurm_state, timeouts, want):
    assert decide(outcome, source, slurm_state, timeouts, LIMIT, interactive=True) == want


def test_without_scontrol_in_path_the_batch_script_is_asked_to_requeue(tmp_path, monkeypatch):
    """A job in a container without Slurm's commands: Slurm's commands hidden from PATH, the
    stop asks for a requeue from outside (run's exit status 75) instead of failing."""
    import shutil

    from clusterflow import rundir
    from clusterflow.distributed import DistEnv
    from clusterflow.errors import EXIT_REQUEUE_OUTSIDE
    from clusterflow.job.requeue import after_stop

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    marker = tmp_path / ".clusterflow-requeue-123"
    monkeypatch.setenv("CLUSTERFLOW_REQUEUE_MARKER", str(marker))  # as the batch templates set it
    assert shutil.which("scontrol") is None
    environ = {"SLURM_JOB_ID": "123", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    environ.update(SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_JOB_NODELIST="node1")
    environ.update(SLURM_JOB_NUM_NODES="1", SLURM_TASKS_PER_NODE="1")
    env = DistEnv.from_env(environ)
    assert env.source == "slurm"
    paths = rundir.RunPaths(str(tmp_path))
    assert after_stop(paths, "timeout", env, environ, LIMIT, None) == "requeue-outside"
    assert rundir.read_json(paths.status)["state"] == "requeued"
    assert marker.exists()  # the templates requeue on it whatever srun's exit status says
    marker.unlink()
    # Preempted (SIGTERM): saved, and the batch script is asked to requeue too; exiting 0 would
    # end the job as COMPLETED, never to come back.
    assert after_stop(paths, "preempted", env, environ, LIMIT, None) == "requeue-outside"
    assert rundir.read_json(paths.status)["state"] == "requeued" and marker.exists()
    assert EXIT_REQUEUE_OUTSIDE == 75  # what slurm_templates/train.sbatch tests for
