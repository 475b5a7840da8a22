"""Launch paths users already have, on the real two-node Slurm cluster: `salloc` + `srun python
-m clusterflow.run` (a stop saves and ends cleanly, with no requeue attempted), and a job whose
environment has no Slurm commands (a container): the stop saves and the batch script outside
requeues it. Both end bitwise equal to an uninterrupted run."""

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO
from slurmjobs import (
    env,
    live_status,
    rank0_logs,
    sbatch_wait,
    scmd,
    sha256,
    status,
    wait_until,
)

pytestmark = pytest.mark.slurm

# USR2 (the time-limit signal) to every rank in step 5 of the first attempt: the ranks agree
# to stop at the next step boundary (5 or 6) and save there
STOP = ("task.target=testtasks:Signals", "task.params.signals=0:5:USR2")
# Slurm's client commands (Debian's slurm-client), hidden from the job's PATH
SLURM = {
    "sacct",
    "sacctmgr",
    "salloc",
    "sattach",
    "sbatch",
    "sbcast",
    "scancel",
    "scontrol",
    "sdiag",
    "sinfo",
    "sprio",
    "squeue",
    "sreport",
    "srun",
    "sshare",
    "sstat",
    "strigger",
}


def salloc_run(run_dir):
    cmd = ["salloc", "-N", "2", "--ntasks-per-node=1", "srun", sys.executable, "-u", "-m"]
    cmd += ["clusterflow.run", "configs/tiny.yaml", f"run.dir={run_dir}", *STOP]
    cmd += [f"task.params.run_dir={run_dir}"]
    return subprocess.run(
        cmd,
        check=False,
        cwd=REPO,
        env={**os.environ, **env()},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_stop_inside_salloc_saves_and_ends_cleanly_without_a_requeue(
    cluster, reference_run, tmp_path
):
    d = str(tmp_path / "run")
    first = salloc_run(d)
    assert first.returncode == 0, first.stdout + first.stderr
    s = status(d)
    assert s["state"] == "stopped" and not s.get("error"), s
    logs = rank0_logs(d)
    assert "requeue" not in logs.replace("does not requeue", ""), logs[-3000:]
    lines = [ln for ln in logs.splitlines() if "run the same command again" in ln]
    assert len(lines) == 1 and "python -m clusterflow.run configs/tiny.yaml" in lines[0], lines
    second = salloc_run(d)  # the same command resumes
    assert second.returncode == 0, second.stdout + second.stderr
    assert status(d)["state"] == "completed"
    assert re.search("resumed from " + re.escape(d) + r"/checkpoints/step-[56]:", rank0_logs(d))
    ref_dir, _ = reference_run
    assert sha256(os.path.join(d, "model.pt")) == sha256(os.path.join(ref_dir, "model.pt"))


def without_slurm(tmp_path):
    """A python launcher whose PATH holds everything of /usr/bin and /bin but Slurm's commands."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for folder in ("/usr/local/bin", "/usr/bin", "/bin"):
        for name in os.listdir(folder):
            if name not in SLURM and not (bin_dir / name).exists():
                (bin_dir / name).symlink_to(os.path.join(folder, name))
    launcher = tmp_path / "python-without-slurm"
    launcher.write_text(f'#!/bin/bash\nexport PATH={bin_dir}\nexec {sys.executable} "$@"\n')
    launcher.chmod(0o755)
    return str(launcher)


def test_a_job_without_slurm_commands_is_requeued_by_the_batch_script(
    cluster, reference_run, tmp_path
):
    d = str(tmp_path / "run")
    out = sbatch_wait(
        ["-N", "2", "--ntasks-per-node=1", f"--output={tmp_path}/slurm-%j.out"]
        + [os.path.join(REPO, "slurm_templates", "train.sbatch"), "configs/tiny.yaml"]
        + [f"run.dir={d}", *STOP, f"task.params.run_dir={d}"],
        env={**os.environ, **env(), "CLUSTERFLOW_PYTHON": without_slurm(tmp_path)},
    )
    slurm_out = "".join(open(p).read() for p in map(str, tmp_path.glob("slurm-*.out")))
    assert out.returncode == 0, out.stdout + out.stderr + slurm_out
    s = status(d)
    assert s["state"] == "completed" and s["attempts"] == 2, s
    logs = rank0_logs(d)
    assert "scontrol is not in this job's PATH" in logs, logs[-3000:]
    assert re.search("resumed from " + re.escape(d) + r"/checkpoints/step-[56]:", logs)
    ref_dir, _ = reference_run
    assert sha256(os.path.join(d, "model.pt")) == sha256(os.path.join(ref_dir, "model.pt"))


def test_torchrun_template_stops_every_worker_and_resumes_exactly(cluster, reference_run, tmp_path):
    """torchrun.sbatch on two nodes: the time-limit signal, sent by Slurm to each node's task,
    reaches every worker (they save together); the requeued job resumes to the weights of the
    train.sbatch route."""
    d = str(tmp_path / "run")
    out = subprocess.run(
        ["sbatch", "--parsable", "-N", "2", "--ntasks-per-node=1"]
        + [f"--output={tmp_path}/slurm-%j.out"]
        + [os.path.join(REPO, "slurm_templates", "torchrun.sbatch"), "configs/tiny.yaml"]
        + [f"run.dir={d}", "task.target=testtasks:Slow", "task.params.step_sleep=0.5"]
        # slowed in attempt 0 only (the signal lands in mid-epoch); the requeued one at full speed
        + [f"task.params.run_dir={d}", "task.params.slow_attempts=1"],
        check=False,
        cwd=REPO,
        env={**os.environ, **env()},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip().split(";")[0]
    wait_until("step 3", lambda: live_status(d).get("global_step", 0) >= 3, job_id=job)
    scmd("scancel", "--signal=USR2", job)
    wait_until("the run to complete", lambda: live_status(d).get("state") == "completed", 600, job)
    s = status(d)
    assert s["attempts"] == 2 and s["world_size"] == 2, s
    logs = rank0_logs(d)
    assert "time-limit signal received" in logs and "requeued job" in logs, logs[-3000:]
    assert re.search("resumed from " + re.escape(d) + r"/checkpoints/step-\d+:", logs)
    ref_dir, _ = reference_run
    assert sha256(os.path.join(d, "model.pt")) == sha256(os.path.join(ref_dir, "model.pt"))
