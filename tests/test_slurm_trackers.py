"""MLflow through a Slurm requeue, on the real two-node cluster: a job that logs to a real
`mlflow server` (SQL store) is SIGKILLed mid-epoch, after MLflow holds steps the newest checkpoint
does not, and comes back through `scontrol requeue` (the same job id, its next attempt). MLflow
then holds one run: the config as parameters, each step of `train/loss` once, in order, with the
values of metrics.jsonl, and the status FINISHED."""

import pytest
from mlflow.tracking import MlflowClient
from slurmjobs import rank0_logs, scmd, status, submit, wait_gone, wait_until
from test_trackers import (
    committed_steps,
    held_steps,
    one_finished_run_with_each_step_once,
    start_server,
    stop_server,
)

from clusterflow.distributed import free_port

pytestmark = pytest.mark.slurm
CONTROLLER = "10.77.0.1"  # the bridge address of tests/slurm/cluster.sh: both nodes reach it


@pytest.fixture
def mlflow_on_the_bridge(cluster, tmp_path):
    port = free_port()
    server = start_server(tmp_path, port, host=CONTROLLER)
    try:
        yield f"http://{CONTROLLER}:{port}"
    finally:
        stop_server(server)


def test_a_job_killed_and_requeued_by_slurm_is_one_mlflow_run_with_each_step_once(
    mlflow_on_the_bridge, tmp_path
):
    uri, d, kill = mlflow_on_the_bridge, str(tmp_path / "run"), str(tmp_path / "kill-now")
    client = MlflowClient(uri)
    job, out = submit(
        d,
        "task.target=testtasks:KillWhenFileAppears",
        f"task.params.run_dir={d}",
        f"task.params.kill_file={kill}",
        "task.params.at=10",  # every rank SIGKILLs itself in step 10 of the first attempt
        "checkpoint.async=false",  # step 8 is committed before step 9 starts
        "cluster.restarts_in_job=0",  # the crash fails the job: Slurm's requeue brings it back
        f"trackers.mlflow.uri={uri}",
        "trackers.mlflow.experiment=requeued",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    wait_until(
        "MLflow holding steps 1-9",
        lambda: max(held_steps(client, "requeued"), default=0) >= 9,
        job_id=job,
    )
    open(kill, "w").close()
    wait_gone(job)
    assert status(d)["state"] == "failed"
    assert max(committed_steps(d)) == 8 < max(held_steps(client, "requeued")) == 9
    scmd("scontrol", "requeue", job)  # a finished batch job comes back with the same id
    wait_until("the requeued attempt", lambda: status(d)["attempts"] == 2, job_id=job)
    wait_gone(job)
    s = status(d)
    assert s["state"] == "completed" and s["attempts"] == 2 and s["job_id"] == job, s
    assert f"resumed from {d}/checkpoints/step-8:" in rank0_logs(d)

    one_finished_run_with_each_step_once(client, "requeued", d)
