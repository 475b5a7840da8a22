"""Every worked example in configs/ runs at toy size on 2 real gloo ranks, as `clusterflow.run`
would run it inside an allocation; the eval metrics are checked to be the whole eval set's."""

import json
import os
import re

import launch
import pytest
import torch
from conftest import REPO, run_cli
from multirank import run_ranks

SMALL_ID = [
    "task.params.identities=24",
    "task.params.samples_per_identity=8",
    "task.params.input_dim=32",
    "task.params.hidden=64",
    "task.params.embed_dim=16",
]
SHORT = [
    "train.epochs=2",
    "train.batch_size=32",
    "train.warmup_steps=2",
    "train.log_every_steps=1",
    "train.progress_bar=false",
    "checkpoint.every_steps=4",
]


def run_example(config, run_dir, *overrides):
    codes = launch.run(2, config, [f"run.dir={run_dir}", *SHORT, *overrides], run_dir)
    log = open(os.path.join(run_dir, "logs", "rank0.attempt0.log")).read()
    assert codes == [0, 0], log[-3000:]
    status = json.load(open(os.path.join(run_dir, "status.json")))
    assert status["state"] == "completed" and os.path.exists(os.path.join(run_dir, "model.pt"))
    return status, log


def metrics(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def test_multinode_gpu_demo_config_at_toy_size(tmp_path):
    cfg = "configs/pseudo_id_1p2m_gpu.yaml"
    status, _ = run_example(
        cfg,
        str(tmp_path / "run"),
        *SMALL_ID,
        "task.params.id_dim=8",
        "task.params.nuisance_dim=16",
        "mining.embed_batch=64",
        "data.num_workers=0",
    )
    (round1,) = status["mining"]
    assert round1["num_clusters"] >= 1 and round1["engine"].split()[0] in ("faiss", "torch")
    # At its real size it asks Slurm for 4 nodes x 8 GPUs, one task per GPU.
    out = run_cli("clusterflow.submit", cfg, "--dry-run")
    assert out.returncode == 0, out.stderr
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8"):
        assert line in out.stdout


def test_two_stage_classifier_starts_from_stage_one(tmp_path):
    stage1 = str(tmp_path / "stage1")
    run_example("configs/two_stage_1_contrastive.yaml", stage1, *SMALL_ID)
    stage2 = str(tmp_path / "stage2")
    status, log = run_example(
        "configs/two_stage_2_classifier.yaml", stage2, *SMALL_ID, f"task.init_from={stage1}"
    )
    # Every encoder tensor came from stage 1; only the classifier head is new.
    assert (
        f"initialised 10 of 11 tensors from {stage1}/model.pt; fresh: head.weight; not used: none"
        in log
    )
    w1 = torch.load(os.path.join(stage1, "model.pt"), weights_only=True)
    assert set(w1) < set(torch.load(os.path.join(stage2, "model.pt"), weights_only=True))
    assert {"eval/accuracy", "eval/macro_f1", "eval/balanced_accuracy", "eval/loss"} <= set(
        status["eval"]
    )


def test_init_from_a_foreign_model_is_a_one_line_error(tmp_path):
    other = tmp_path / "other.pt"
    torch.save({"layer.weight": torch.zeros(3)}, other)
    out = run_cli(
        "clusterflow.run",
        "configs/two_stage_2_classifier.yaml",
        f"run.dir={tmp_path / 'run'}",
        f"task.init_from={other}",
        *SMALL_ID,
    )
    assert out.returncode == 2
    assert "none of its 1 tensors (layer.weight, ...) match the model's names" in out.stderr
    assert "Traceback" not in out.stderr


def test_class_weighted_classifier_reports_accuracy_and_macro_f1(tmp_path):
    status, _ = run_example(
        "configs/classifier_weighted.yaml",
        str(tmp_path / "run"),
        *SMALL_ID,
        "task.params.samples_per_identity=20",
        "task.params.imbalance=10",
    )
    ev = status["eval"]
    assert 0 <= ev["eval/macro_f1"] <= 1 and 0 <= ev["eval/accuracy"] <= 1
    # Balanced eval split: balanced accuracy is plain accuracy there.
    assert ev["eval/balanced_accuracy"] == pytest.approx(ev["eval/accuracy"])


def test_sparse_autoencoder_logs_per_step_metrics(tmp_path):
    d = str(tmp_path / "run")
    status, _ = run_example(
        "configs/sparse_autoencoder.yaml",
        d,
        "task.params.samples=512",
        "task.params.dim=16",
        "task.params.features=32",
        "task.params.latents=64",
        "task.params.eval_samples=128",
    )
    rows = [r for r in metrics(d) if "train/mse" in r]
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, 2 * 512 // 32 + 1))  # one row per optimizer step
    assert all({"train/l1", "train/l0", "train/explained_variance"} <= set(r) for r in rows)
    assert {"eval/mse", "eval/l0", "eval/explained_variance", "eval/dictionary_recovery"} <= set(
        status["eval"]
    )


def _classifier_eval(seed):
    """Evaluate one fixed, partly trained classifier on this rank's shard; reduced over all
    ranks."""
    from clusterflow.tasks.classifier import ClassifierTask
    from clusterflow.train.evaluate import evaluate

    task = ClassifierTask(
        seed=seed,
        identities=7,
        samples_per_identity=4,
        eval_samples_per_identity=5,
        input_dim=16,
        hidden=16,
        embed_dim=8,
    )
    torch.manual_seed(seed)
    model = task.build_model()
    return evaluate(task, model, task.eval_dataset(), torch.device("cpu"), None, batch_size=4)


def _sklearn_reference(seed):
    from sklearn.metrics import accuracy_score, balanced_accuracy_score, f1_score

    from clusterflow.tasks.classifier import ClassifierTask

    task = ClassifierTask(
        seed=seed,
        identities=7,
        samples_per_identity=4,
        eval_samples_per_identity=5,
        input_dim=16,
        hidden=16,
        embed_dim=8,
    )
    torch.manual_seed(seed)
    model = task.build_model().eval()
    ds = task.eval_dataset()
    with torch.no_grad():
        pred = model(torch.from_numpy(ds.base)).argmax(1).numpy()
    return {
        "eval/accuracy": accuracy_score(ds.labels, pred),
        "eval/macro_f1": f1_score(ds.labels, pred, average="macro"),
        "eval/balanced_accuracy": balanced_accuracy_score(ds.labels, pred),
    }


@pytest.mark.parametrize("world", [1, 3])
def test_eval_metrics_are_the_whole_eval_sets(world):
    """35 eval samples over 3 ranks (12/12/11): the reduced accuracy and macro F1 equal sklearn's on
    all 35."""
    got = run_ranks(world, _classifier_eval, 5)
    assert all(g == got[0] for g in got)  # every rank reports the same numbers
    want = _sklearn_reference(5)
    assert 0 < want["eval/macro_f1"] < 1  # an untrained model: a non-trivial confusion to get right
    for k, v in want.items():
        assert got[0][k] == pytest.approx(v, abs=1e-12), k


def test_flags_may_follow_the_overrides(tmp_path):
    out = run_cli(
        "clusterflow.submit",
        "configs/sparse_autoencoder.yaml",
        f"run.dir={tmp_path}/r",
        "cluster.nodes=2",
        "--dry-run",
    )
    assert out.returncode == 0 and "#SBATCH --nodes=2" in out.stdout, out.stderr


def test_every_example_config_is_listed_in_the_docs():
    docs = open(os.path.join(REPO, "docs", "examples.md")).read()
    for name in sorted(os.listdir(os.path.join(REPO, "configs"))):
        if name.endswith(".yaml") and name != "tiny.yaml":
            assert re.search(rf"configs/{re.escape(name)}\b", docs), (
                f"{name} has no section in docs/examples.md"
            )
