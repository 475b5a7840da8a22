"""benchmarks/gpu_proof.py runs as a user runs it, here without a GPU: every figure is in the
report, each GPU figure is marked not taken with its reason, and the CPU equivalents hold what
they claim (a bf16 run SIGKILLed and resumed is bitwise the uninterrupted one, gloo's all_reduce is
exact, the k-NN engine finds the bare search's neighbours, the embed equals the bare loop's, FSDP
holds half of what DDP holds on each rank)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

PROOF = os.path.join(REPO, "benchmarks", "gpu_proof.py")
FIGURES = [
    "environment",
    "nccl_two_ranks",
    "bf16_resume_tiny",
    "knn_exact",
    "loop_throughput",
    "embed_throughput",
    "bf16_resume_demo",
    "nvml_heartbeats",
    "fsdp_over_share",
]


def proof(*args):
    return subprocess.run(
        [sys.executable, PROOF, *args],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU says")
def test_the_proof_on_a_cpu_reports_every_figure_and_its_cpu_equivalent(tmp_path):
    out = tmp_path / "proof"
    done = proof("--out", str(out), "--quick")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "proof.json").read_text())
    figures = report["figures"]
    assert list(figures) == FIGURES and report["gpu"] is False and report["quick"] is True
    for name, fig in figures.items():
        assert fig["gpu"].startswith("not taken: "), (name, fig["gpu"])
        assert not fig["summary"].startswith("FAILED"), (name, fig["summary"])
    assert "no CUDA device here" in figures["knn_exact"]["gpu"]
    assert figures["bf16_resume_demo"]["gpu"] == (
        "not taken: --quick leaves the demo out (the tiny one ran)"
    )
    tiny = figures["bf16_resume_tiny"]["values"]
    assert tiny["bitwise"] and tiny["attempts"] == 2 and tiny["max_abs_diff"] == 0.0
    assert figures["bf16_resume_tiny"]["met"] is True
    gloo = figures["nccl_two_ranks"]["values"]["gloo"]
    assert gloo["ok"] and gloo["backend"] == "gloo" and "nccl" not in figures["nccl_two_ranks"]
    assert figures["knn_exact"]["values"]["same_neighbour_sets"] >= 0.99
    assert figures["embed_throughput"]["values"]["same_embeddings"] is True
    fsdp = figures["fsdp_over_share"]["values"]
    fsdp_rank = max(r["state_bytes"] for r in fsdp["fsdp"]["ranks"])
    ddp_rank = max(r["state_bytes"] for r in fsdp["ddp"]["ranks"])
    assert ddp_rank == fsdp["replica_bytes"] and fsdp_rank * 2 == ddp_rank
    assert figures["fsdp_over_share"]["met"] is True
    for side in ("clusterflow", "bare"):
        assert figures["loop_throughput"]["values"]["best_epoch_s"][side] > 0
    table = (out / "proof.md").read_text()
    assert "No GPU here" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(FIGURES)


def test_only_and_merge_make_one_report_of_two_calls(tmp_path):
    a, b, both = tmp_path / "a", tmp_path / "b", tmp_path / "both"
    assert proof("--out", str(a), "--only", "environment").returncode == 0
    assert proof("--out", str(b), "--only", "nvml_heartbeats").returncode == 0
    done = proof("--merge", str(a / "proof.json"), str(b / "proof.json"), "--out", str(both))
    assert done.returncode == 0, done.stderr
    merged = json.loads((both / "proof.json").read_text())
    assert list(merged["figures"]) == ["environment", "nvml_heartbeats"]
    unknown = proof("--out", str(tmp_path / "c"), "--only", "environment,warp_drive")
    assert unknown.returncode == 2 and "warp_drive" in unknown.stdout


def test_a_figure_that_outlasts_the_budget_is_not_started(tmp_path):
    done = proof("--out", str(tmp_path), "--only", "environment,knn_exact", "--budget-s", "40")
    assert done.returncode == 0, done.stderr
    figures = json.loads((tmp_path / "proof.json").read_text())["figures"]
    assert figures["knn_exact"]["gpu"] == "not taken: the budget ran out (run it with --only)"
    assert figures["knn_exact"]["summary"].startswith("FAILED: not started")
