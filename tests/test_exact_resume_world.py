"""Resume is bitwise at every world size that does not change: DDP on 3 and 4 ranks and FSDP on
3 (2 ranks sum any two gradients the same way whatever the order, so they hide what 3 show). Each
run is SIGKILLed mid-epoch (all ranks, after its last checkpoint), relaunched, stopped by a SIGTERM
inside a sharded mining round, and relaunched to the end: its model.pt must equal the
uninterrupted run's, bit for bit."""

import os

import launch
import pytest
import torch
from conftest import REPO

pytestmark = pytest.mark.slow

# 192 samples, 48 per step: 4 steps an epoch; checkpoints at steps 4 and 8; the kill lands at
# step 6 (two steps trained again), the TERM in the round after epoch 2.
BASE = [
    "train.batch_size=48",
    "mining.search=sharded",
    "mining.engine=torch",
    "mining.query_batch=16",
]


def _over(run_dir, world, parallel):
    return [
        f"run.dir={run_dir}",
        f"cluster.tasks_per_node={world}",
        f"train.parallel={parallel}",
        *BASE,
        "task.target=testtasks:KillAtEnvThenSignalInMining",
        f"task.params.run_dir={run_dir}",
        "task.params.at=1:*:block:1:TERM",
    ]


def _weights(run_dir):
    return torch.load(os.path.join(run_dir, "model.pt"), weights_only=True)


@pytest.mark.parametrize("parallel, world", [("ddp", 3), ("ddp", 4), ("fsdp", 3)])
def test_killed_and_stopped_in_mining_resumes_bitwise(tmp_path, monkeypatch, parallel, world):
    monkeypatch.setenv("PYTHONPATH", os.path.join(REPO, "tests"))
    plain = str(tmp_path / "plain")
    assert (
        launch.run(world, "configs/tiny.yaml", _over(plain, world, parallel), plain) == [0] * world
    )
    d = str(tmp_path / "resumed")
    over = _over(d, world, parallel)
    monkeypatch.setenv("CLUSTERFLOW_TEST_KILL_AT", "6")
    assert launch.run(world, "configs/tiny.yaml", over, d) == [-9] * world
    monkeypatch.delenv("CLUSTERFLOW_TEST_KILL_AT")
    assert launch.run(world, "configs/tiny.yaml", over, d) == [0] * world  # stopped in mining
    assert launch.run(world, "configs/tiny.yaml", over, d) == [0] * world
    stops = [line for line in open(os.path.join(d, "stops.jsonl"))]
    assert len(stops) == 1, stops
    got, want = _weights(d), _weights(plain)
    assert got.keys() == want.keys()
    differ = [k for k in got if not torch.equal(got[k], want[k])]
    assert not differ, f"{len(differ)} of {len(got)} tensors differ, e.g. {differ[:3]}"
