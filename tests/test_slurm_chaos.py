"""A short chaos run on the real local Slurm cluster (benchmarks/chaos.py, its figures in
docs/benchmarks.md): configs/tiny.yaml on two nodes and a spare meets a rank SIGKILLed, a node lost
(its rank and standby killed, its memory emptied) and a rank frozen (SIGSTOP), in a seeded order,
with nobody typing a command; every fault is restarted in the job, the frozen rank named and its
node left out, and the run ends bitwise equal to the suite's uninterrupted run, each sample once
per epoch. The times to train again are printed, not asserted."""

import os
import sys

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import chaos

pytestmark = pytest.mark.slurm


@pytest.mark.slow
def test_a_short_chaos_run_survives_each_fault_bitwise_with_no_command_typed(
    cluster, reference_run, tmp_path
):
    ref_dir, _ = reference_run
    r = chaos.main(
        [
            "--seed", "2", "--kinds", "kill,node,hang", "--epochs", "3", "--identities", "24",
            "--mining-every", "1", "--every-steps", "4", "--step-sleep", "0.5",
            "--gap-s", "1", "2", "--standby-wait-s", "0", "--reference", ref_dir,
            "--root", str(tmp_path),
        ]
    )  # fmt: skip
    assert r.state == "completed", r
    assert sorted(f.kind for f in r.faults) == ["hang", "kill", "node"], r.faults
    assert r.bitwise_equal and r.each_sample_once, r
    assert r.commands_typed == [] and len(set(r.job_ids)) == 1, r
    for f in r.faults:
        # trained again, in the same job, by a restart that named the fault
        assert f.back_at is not None and f.back_at > f.at and f.steps_again is not None, f
        assert f.how.startswith("restart in the job"), f
    got = {f.kind: f for f in r.faults}
    kill, node, hang = got["kill"].recorded, got["node"].recorded, got["hang"].recorded
    assert kill["cause"] == "crash" and kill["warm"] is not None, kill
    assert node["cause"] == "crash" and node["host"] not in node["nodes"], node
    frozen_rank, frozen_host = got["hang"].detail.split("rank ")[1].split(" on ")
    assert (hang["cause"], hang["rank"], hang["host"]) == ("stall", int(frozen_rank), frozen_host)
    assert frozen_host in hang["left_out"] and frozen_host not in hang["nodes"], hang
    assert "no heartbeat for" in hang["error"], hang
