"""Against the real local two-node Slurm cluster (tests/slurm/cluster.sh): submit, template.
(A rank's crash: tests/test_slurm_faults.py.)"""

import os

import pytest
from conftest import REPO, run_cli
from slurmjobs import env, sbatch_wait, status

pytestmark = pytest.mark.slurm


@pytest.mark.parametrize(
    "reference,hosts",
    [
        pytest.param("reference_run", ["node1", "node2"], id="2nodes-x1task"),
        pytest.param("one_node_reference", ["node1"], id="1node-x2tasks"),
    ],
)
def test_submit_route(cluster, reference, hosts, request):
    # The suite's reference runs are exactly these cases.
    d, out = request.getfixturevalue(reference)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "submitted job" in out.stdout and "tensorboard --logdir" in out.stdout
    s = status(d)
    assert s["state"] == "completed" and s["world_size"] == 2 and s["attempts"] == 1
    assert s["hosts"] == hosts
    assert len(s["mining"]) == 2 and s["latest_checkpoint"]


def test_template_route_on_one_node(cluster, tmp_path):
    # On two nodes: test_slurm_faults.py's moved run dir resumes through the template.
    d = str(tmp_path / "run")
    out = sbatch_wait(
        [
            "-N",
            "1",
            "--ntasks-per-node=2",
            f"--output={tmp_path}/slurm-%j.out",
            os.path.join(REPO, "slurm_templates", "train.sbatch"),
            "configs/tiny.yaml",
            f"run.dir={d}",
        ],
        env={**os.environ, **env()},
    )
    assert out.returncode == 0, (
        out.stdout
        + out.stderr
        + "".join(open(p).read() for p in map(str, tmp_path.glob("slurm-*.out")))
    )
    s = status(d)
    assert s["state"] == "completed" and s["world_size"] == 2
    assert s["hosts"] == ["node1"]


def test_dry_run_prints_the_script_and_submits_nothing(tmp_path):
    d = str(tmp_path / "run")
    out = run_cli(
        "clusterflow.submit", "configs/demo.yaml", f"run.dir={d}", "cluster.nodes=2", "--dry-run"
    )
    assert out.returncode == 0
    assert (
        "#SBATCH --nodes=2" in out.stdout
        and "#SBATCH --requeue" in out.stdout
        and "--kill-on-bad-exit=1" in out.stdout
    )
    assert not os.path.exists(d)
