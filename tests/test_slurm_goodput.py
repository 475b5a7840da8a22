"""The goodput ledger of a real Slurm job (the shared uninterrupted 2-node reference run): the
queue wait from submit's record, the allocation's start from Slurm (sacct where slurmdbd keeps
accounting; here it does not, so scontrol while Slurm remembers the job), every part >= 0 and
the parts adding up to the wall time."""

import json

import pytest
from conftest import run_cli

from clusterflow.slurm import commands

pytestmark = pytest.mark.slurm


def test_the_ledger_of_a_slurm_job_uses_slurms_times_and_sums_to_its_wall(reference_run):
    d, _ = reference_run
    out = run_cli("clusterflow.goodput", d, "--json")
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)["attempts"]
    assert all(v >= 0 for v in row["seconds"].values()), row["seconds"]
    assert sum(row["seconds"].values()) == pytest.approx(row["wall_s"], rel=0.01)
    assert row["sources"]["queued"] == "submissions.jsonl"
    assert row["outcome"] == "completed" and row["ranks"] == 2
    assert row["seconds"]["productive"] > 0 and 0 < row["ratio"] < 1
    runs, source = commands.job_runs(row["job_id"])
    if runs:  # Slurm still remembers the job (MinJobAge): its times are the ledger's
        assert row["sources"]["allocated"] == source == runs[0]["source"]
        assert runs[0]["start"] <= runs[0]["end"]
        assert row["ended_at"] >= runs[0]["end"]
    else:  # the first start of the job's processes: every rank's, or rank 0's
        starts = ("attempts.jsonl (process start)", "timeline (process start)")
        assert row["sources"]["allocated"] in starts, source
