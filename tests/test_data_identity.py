"""The data a run trains on is part of what it resumes: a shard folder packed again, an image
folder that gained images, or a user's dataset of another length between a kill (SIGKILL) and
its resume is refused in one line naming both (count and digest), before anything trains; at an
epoch boundary, and only when the launch asks (``data.allow_change=true``), the resume goes on
with the new data and without the old pseudo-labels, and the ledger says which data each epoch
was.

Each test is one chain of real launches of ``python -m clusterflow.run`` (tests/launch.py) of a
task that records every batch it trains and SIGKILLs itself at a chosen loss call
(testtasks._Seen).
"""

import glob
import json
import os
import shutil

import launch
import numpy as np
import pytest
from conftest import REPO
from PIL import Image

from clusterflow.tasks import shard_format
from clusterflow.tasks.shards import write_shards

CONFIG = (
    "run: {{seed: 3}}\n"
    "train: {{epochs: {epochs}, batch_size: 12, lr: 0.003, log_every_steps: 1, "
    "progress_bar: false}}\n"
    "checkpoint: {{every_steps: 2, keep_last: 50, async: false}}\n"
    "mining: {{k: 3, threshold: 0.5}}\n"
    "task:\n"
    "  target: testtasks:{task}\n"
    "  params: {{{params}}}\n"
)
IMAGE = "image_size: 8, width: 4, embed_dim: 4"


def _images(root, classes=("a", "b", "c"), per_class=23, first=0):
    """``per_class`` random 8x8 PNGs in each class folder (numbered from ``first``)."""
    rng = np.random.default_rng(first)
    for c in classes:
        os.makedirs(os.path.join(root, c), exist_ok=True)
        for i in range(first, first + per_class):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
                os.path.join(root, c, f"{i}.png")
            )
    return str(root)


def _pack(src, out, seed=0):
    shutil.rmtree(out, ignore_errors=True)
    write_shards(src, out, 10, seed)


def _config(tmp_path, task, params, epochs=2):
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG.format(epochs=epochs, task=task, params=params))
    return str(path)


def _launch(config, run_dir, kill="", *more):
    over = [
        f"run.dir={run_dir}",
        "cluster.tasks_per_node=1",
        f"task.params.run_dir={run_dir}",
        f"task.params.kill={kill}",
        *more,
    ]
    return launch.run(1, config, over, run_dir)


def _error(run_dir):
    """The one ``error:`` line the last launch printed."""
    newest = max(glob.glob(os.path.join(run_dir, "launch-rank0-*.txt")), key=os.path.getmtime)
    with open(newest) as f:
        lines = [line.strip() for line in f if line.startswith("error: ")]
    assert len(lines) == 1, lines
    return lines[0]


def _ledger(run_dir):
    with open(os.path.join(run_dir, "sample_ledger.json")) as f:
        return json.load(f)


def _steps(run_dir):
    return sorted(os.listdir(os.path.join(run_dir, "checkpoints")))


@pytest.mark.slow
def test_a_shard_folder_packed_again_between_a_kill_and_its_resume_is_refused(
    tmp_path, monkeypatch
):
    """69 images in shards of 10, batches of 12: killed at step 3 of epoch 1 (committed step 2,
    sample 24 of the epoch's order). Packed again with 50 more images, with one class left out,
    and with the same images under another --seed: each resume is refused (exit 2, one line naming
    both the checkpoint's data and the folder's), data.allow_change=true too (mid-epoch); the run
    dir is left as it was. Packed as before, the run resumes and finishes exactly once."""
    monkeypatch.setenv("PYTHONPATH", os.path.join(REPO, "tests"))
    src, shards = _images(tmp_path / "images"), str(tmp_path / "shards")
    _pack(src, shards)
    first = shard_format.ShardIndex.load(shards)
    config = _config(tmp_path, "SeenShards", f"root: {shards}, {IMAGE}, mix_shards: 2")
    d = str(tmp_path / "run")
    assert _launch(config, d, "0@3") == [-9]
    ledger, steps = _ledger(d), _steps(d)

    more = _images(tmp_path / "more", per_class=23)
    _images(more, classes=("a", "b"), per_class=25, first=100)  # 69 + 50 images
    fewer = tmp_path / "fewer"
    shutil.copytree(src, fewer)
    shutil.rmtree(fewer / "c")
    for folder, seed, n in ((more, 0, 119), (str(fewer), 0, 46), (src, 7, 69)):
        _pack(folder, shards, seed)
        assert _launch(config, d, "0@3") == [2]
        digest, new = first.digest, shard_format.ShardIndex.load(shards).digest
        assert new != digest
        line = _error(d)
        assert "the data changed" in line, line
        assert f"69 samples (digest {digest[:12]})" in line, line
        assert f"{n} samples (digest {new[:12]})" in line, line
        assert _ledger(d) == ledger and _steps(d) == steps
    assert _launch(config, d, "0@3", "data.allow_change=true") == [2]
    assert "in mid-epoch" in _error(d)
    assert _ledger(d) == ledger and _steps(d) == steps

    _pack(src, shards)  # as it was: the run resumes and trains every sample once
    assert _launch(config, d, "0@3") == [0]
    ledger = _ledger(d)
    for e in ledger["epochs"]:
        assert e["samples"] == 69 and e["digest"] == digest
        assert [(r["start"], r["end"]) for r in e["ranges"]] == (
            [(0, 24), (24, 69)] if e["epoch"] == 0 else [(0, 69)]
        )


@pytest.mark.slow
def test_new_data_at_an_epoch_boundary_is_taken_when_asked_without_the_old_labels(
    tmp_path, monkeypatch
):
    """69 images, 5 steps an epoch, mining after epoch 1: killed at the first step of epoch 2,
    so the newest checkpoint is epoch 1's end (with the mined labels). Packed again with 50 more
    images: refused, naming data.allow_change; with it, the run trains epochs 2 and 3 on the 119
    images from their first sample, without the labels mined on the other data, and the ledger
    says which data each epoch was."""
    monkeypatch.setenv("PYTHONPATH", os.path.join(REPO, "tests"))
    src, shards = _images(tmp_path / "images"), str(tmp_path / "shards")
    _pack(src, shards)
    first = shard_format.ShardIndex.load(shards)
    config = _config(tmp_path, "SeenShards", f"root: {shards}, {IMAGE}, mix_shards: 2", epochs=3)
    d = str(tmp_path / "run")
    assert _launch(config, d, "0@6") == [-9]
    assert _steps(d)[-1] == "step-5"

    _images(src, classes=("a", "b"), per_class=25, first=100)
    _pack(src, shards)
    assert _launch(config, d, "0@6") == [2]
    old, new = first.digest, shard_format.ShardIndex.load(shards).digest
    line = _error(d)
    assert "data.allow_change=true" in line and "epoch boundary" in line, line
    assert _launch(config, d, "0@6", "data.allow_change=true") == [0]
    log = open(max(glob.glob(os.path.join(d, "launch-rank0-*.txt")), key=os.path.getmtime)).read()
    assert "pseudo-labels of 69 samples dropped" in log, log[-3000:]
    epochs = _ledger(d)["epochs"]
    assert [(e["epoch"], e["samples"], e["digest"]) for e in epochs] == [
        (0, 69, old),
        (1, 119, new),
        (2, 119, new),
    ]
    # The last attempt trained epoch 2 from its first sample on the new data: every index of
    # the 119 images once.
    seen = []
    for name in os.listdir(os.path.join(d, "seen")):
        with open(os.path.join(d, "seen", name)) as f:
            seen += [json.loads(line) for line in f]
    last = max(r["attempt"] for r in seen)
    trained = sorted(
        i for r in seen if r["attempt"] == last and r["epoch"] == 1 for i in r["index"]
    )
    assert trained == list(range(119))


def test_an_image_folder_that_gained_images_is_refused(tmp_path, monkeypatch):
    """ImageFolderTask, 69 images: killed in mid-epoch; 6 more images in a class folder: the
    resume is refused naming both counts and digests (of the file list)."""
    monkeypatch.setenv("PYTHONPATH", os.path.join(REPO, "tests"))
    src = _images(tmp_path / "images")
    config = _config(tmp_path, "SeenFolder", f"root: {src}, {IMAGE}")
    d = str(tmp_path / "run")
    assert _launch(config, d, "0@3") == [-9]
    _images(src, classes=("b",), per_class=6, first=100)
    assert _launch(config, d, "0@3") == [2]
    line = _error(d)
    assert "the data changed" in line and "69 samples (digest " in line, line
    assert "75 samples (digest " in line, line


@pytest.mark.slow
def test_a_users_dataset_whose_length_changed_is_refused(tmp_path, monkeypatch):
    """A user's task whose dataset offers no digest: 103 identities x 2 samples, killed in
    mid-epoch; the file it reads now says 110: refused naming both lengths. Back at 103, the
    run finishes, every sample once."""
    monkeypatch.setenv("PYTHONPATH", os.path.join(REPO, "tests"))
    data = tmp_path / "identities.txt"
    data.write_text("103")
    params = f"data_file: {data}, samples_per_identity: 2, input_dim: 8, hidden: 16, embed_dim: 4"
    config = _config(tmp_path, "SeenFromFile", params)
    d = str(tmp_path / "run")
    assert _launch(config, d, "0@3") == [-9]
    data.write_text("110")
    assert _launch(config, d, "0@3") == [2]
    line = _error(d)
    assert "the data changed" in line and "206 samples" in line and "220 samples" in line, line
    assert "digest" not in line, line
    data.write_text("103")
    assert _launch(config, d, "0@3") == [0]
    for e in _ledger(d)["epochs"]:
        assert e["samples"] == 206 and e["digest"] is None
        covered = sorted(i for r in e["ranges"] for i in range(r["start"], r["end"]))
        assert covered == list(range(206))
