"""Against the real local two-node Slurm cluster (tests/slurm/cluster.sh): submit, template, crash."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import REPO, run_cli

pytestmark = pytest.mark.slurm
TESTS = os.path.join(REPO, "tests")


@pytest.fixture(scope="session")
def cluster():
    if os.geteuid() != 0 or shutil.which("sinfo") is None and shutil.which("apt-get") is None:
        pytest.skip("the local Slurm cluster needs root and Debian's slurm-wlm")
    out = subprocess.run(["bash", os.path.join(TESTS, "slurm", "cluster.sh"), "up"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr


def env():
    e = {"PYTHONPATH": TESTS, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    return e


def status(run_dir):
    out = run_cli("clusterflow.status", run_dir, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wait_gone(job_id, timeout=300):
    t0 = time.time()
    while time.time() - t0 < timeout:
        q = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True)
        if not q.stdout.strip():
            return time.time() - t0
        time.sleep(1)
    raise AssertionError(f"job {job_id} still queued after {timeout} s")


TOPOLOGIES = [pytest.param(2, 1, id="2nodes-x1task"), pytest.param(1, 2, id="1node-x2tasks")]


@pytest.mark.parametrize("nodes,tasks", TOPOLOGIES)
def test_submit_route(cluster, tmp_path, nodes, tasks):
    d = str(tmp_path / "run")
    out = run_cli("clusterflow.submit", "configs/tiny.yaml", f"run.dir={d}", f"cluster.nodes={nodes}",
                  f"cluster.tasks_per_node={tasks}", "cluster.time_min=10", "--wait", env=env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "submitted job" in out.stdout and "tensorboard --logdir" in out.stdout
    s = status(d)
    assert s["state"] == "completed" and s["world_size"] == 2 and s["attempts"] == 1
    assert s["hosts"] == (["node1", "node2"] if nodes == 2 else ["node1"])
    assert len(s["mining"]) == 2 and s["latest_checkpoint"]


@pytest.mark.parametrize("nodes,tasks", TOPOLOGIES)
def test_template_route(cluster, tmp_path, nodes, tasks):
    d = str(tmp_path / "run")
    out = subprocess.run(["sbatch", "--wait", "-N", str(nodes), f"--ntasks-per-node={tasks}", f"--output={tmp_path}/slurm-%j.out",
                          os.path.join(REPO, "slurm_templates", "train.sbatch"), "configs/tiny.yaml", f"run.dir={d}"],
                         cwd=REPO, env={**os.environ, **env()}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr + "".join(open(p).read() for p in map(str, tmp_path.glob("slurm-*.out")))
    s = status(d)
    assert s["state"] == "completed" and s["world_size"] == 2
    assert s["hosts"] == (["node1", "node2"] if nodes == 2 else ["node1"])


def test_crash_on_one_node_fails_fast_and_names_the_rank(cluster, tmp_path):
    d = str(tmp_path / "run")
    t0 = time.time()
    out = run_cli("clusterflow.submit", "configs/tiny.yaml", f"run.dir={d}", "cluster.nodes=2", "cluster.tasks_per_node=1",
                  "task.target=crashtask:CrashOnRank1", "dist.timeout_s=60", "--wait", env=env())
    elapsed = time.time() - t0
    assert out.returncode == 1, out.stdout + out.stderr
    assert elapsed < 60 + 30  # ends within the process-group timeout, not at the time limit
    s = status(d)
    assert s["state"] == "failed"
    assert any(e["rank"] == 1 and "deliberate failure" in e["error"] for e in s["errors"]), s


def test_dry_run_prints_the_script_and_submits_nothing(tmp_path):
    d = str(tmp_path / "run")
    out = run_cli("clusterflow.submit", "configs/demo.yaml", f"run.dir={d}", "cluster.nodes=2", "--dry-run")
    assert out.returncode == 0
    assert "#SBATCH --nodes=2" in out.stdout and "#SBATCH --requeue" in out.stdout and "--kill-on-bad-exit=1" in out.stdout
    assert not os.path.exists(d)
