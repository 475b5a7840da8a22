"""Golden files pin the generated sbatch script and the template.

When a change to them is intended, regenerate and review the diff:
    CLUSTERFLOW_REGEN_GOLDEN=1 python -m pytest tests/test_golden.py
"""

import os

import pytest

from clusterflow import config
from clusterflow.launch.submit import sbatch_script

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "golden")
REGEN = os.environ.get("CLUSTERFLOW_REGEN_GOLDEN") == "1"


def check(name, text):
    path = os.path.join(GOLDEN, name)
    if REGEN:
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        assert f.read() == text, (
            f"{name} changed; if intended: CLUSTERFLOW_REGEN_GOLDEN=1 python -m pytest "
            "tests/test_golden.py"
        )


@pytest.mark.parametrize(
    "name,overrides",
    [
        (
            "submitit_2nodes_gpu.sbatch",
            [
                "run.dir=/shared/runs/exp 1",
                "run.name=my job; rm -rf /",
                "cluster.nodes=2",
                "cluster.gpus_per_node=4",
                "cluster.tasks_per_node=4",
                "train.batch_size=256",
                "cluster.partition=gpu",
                "cluster.account=lab",
                "cluster.setup=[module load cuda, source ~/env/bin/activate]",
                "cluster.mem_gb=64",
                "cluster.exclusive=true",
                "cluster.time_min=240",
            ],
        ),
        ("submitit_cpu.sbatch", ["run.dir=/shared/runs/cpu"]),
    ],
)
def test_generated_script(name, overrides):
    cfg = config.load(os.path.join(HERE, "..", "configs", "demo.yaml"), overrides)
    check(name, sbatch_script(cfg, python="python3"))


def test_template():
    with open(os.path.join(HERE, "..", "slurm_templates", "train.sbatch")) as f:
        check("train.sbatch", f.read())


def test_torchrun_template():
    with open(os.path.join(HERE, "..", "slurm_templates", "torchrun.sbatch")) as f:
        check("torchrun.sbatch", f.read())
