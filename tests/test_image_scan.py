"""An image folder that loops or lies: a symlinked directory is followed once (by device and
inode), what was skipped is named, the scan has a time bound, and a stop signal during the scan
ends the job cleanly before its first step."""

import json
import os
import shutil

import pytest
from conftest import REPO, run_cli

from clusterflow.errors import UserError
from clusterflow.tasks import images
from clusterflow.tasks.digits import write_digits

# 20 images in two class folders, 1 process, 2 steps: seconds.
SMALL = [
    "cluster.tasks_per_node=1",
    "train.epochs=1",
    "train.batch_size=10",
    "train.warmup_steps=0",
    "train.log_every_steps=1",
    "checkpoint.every_steps=1",
]


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("digits") / "all")
    write_digits(d)
    return d


def twenty_pngs(digits, root):
    """A folder of 20 real PNGs: ``a/`` holds ten scans of 0, ``b/`` ten of 1."""
    for name, digit in (("a", "0"), ("b", "1")):
        os.makedirs(os.path.join(root, name))
        for f in sorted(os.listdir(os.path.join(digits, digit)))[:10]:
            shutil.copy(os.path.join(digits, digit, f), os.path.join(root, name, f))
    return str(root)


def rank0_log(run_dir):
    logs = os.path.join(run_dir, "logs")
    return "".join(open(os.path.join(logs, f)).read() for f in sorted(os.listdir(logs)))


def train(run_dir, root, *extra, timeout=600):
    return run_cli(
        "clusterflow.run",
        "configs/images_digits.yaml",
        f"run.dir={run_dir}",
        f"task.params.root={root}",
        *SMALL,
        *extra,
        timeout=timeout,
    )


def test_a_symlink_loop_in_an_image_folder_is_followed_once_and_named(digits, tmp_path):
    """The issue's case: 20 PNGs with ``a/loop -> ..`` trained on 820 images, b's labelled a."""
    root = twenty_pngs(digits, tmp_path / "data")
    os.symlink("..", os.path.join(root, "a", "loop"))
    files, labels, classes = images.scan(root)
    assert len(files) == 20 and classes == ["a", "b"]
    assert [f.split(os.sep)[0] for f in files] == ["a"] * 10 + ["b"] * 10
    assert list(labels) == [0] * 10 + [1] * 10

    run_dir = tmp_path / "run"
    res = train(run_dir, root)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    log = rank0_log(run_dir)
    assert "ImageFolderTask: 20 images" in log, log
    # The skipped link is named, with what it leads to.
    assert "a/loop" in log and "already scanned" in log, log
    assert json.load(open(run_dir / "status.json"))["state"] == "completed"


def test_two_symlink_loops_end_the_scan(digits, tmp_path):
    """Two loops made the scan exponential: it never ended. Each folder is entered once now."""
    root = twenty_pngs(digits, tmp_path / "data")
    os.symlink("..", os.path.join(root, "a", "loop"))
    os.symlink("..", os.path.join(root, "b", "up"))
    os.makedirs(os.path.join(root, "b", "deep"))
    os.symlink("../../a", os.path.join(root, "b", "deep", "sideways"))
    run_dir = tmp_path / "run"
    # The timeout only keeps a regression from hanging the suite.
    res = train(run_dir, root, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    log = rank0_log(run_dir)
    assert "ImageFolderTask: 20 images" in log, log
    for link in ("a/loop", "b/up", "b/deep/sideways"):
        assert link in log, (link, log)


def test_a_link_to_another_class_folder_keeps_its_images_in_their_class(digits, tmp_path):
    root = twenty_pngs(digits, tmp_path / "data")
    os.symlink("../b", os.path.join(root, "a", "b-too"))
    files, labels, _ = images.scan(root)
    assert len(files) == 20 and list(labels) == [0] * 10 + [1] * 10


def test_a_scan_past_its_time_limit_names_how_far_it_got(digits, tmp_path):
    root = twenty_pngs(digits, tmp_path / "data")
    clock = iter(range(0, 10_000, 100))  # every reading of the clock: 100 s later
    with pytest.raises(UserError) as e:
        images.scan(root, limit_s=150, clock=lambda: next(clock))
    msg = str(e.value)
    assert "task.params.scan_limit_s=150" in msg and root in msg and "folders" in msg, msg


def test_sigterm_during_the_dataset_scan_stops_the_job_before_its_first_step(
    digits, tmp_path, monkeypatch
):
    """SIGTERM while the task scans its folder: the job ends at once and cleanly, as a stop before
    the first step does (exit 0, state stopped for `run` outside Slurm, stops.jsonl), nothing
    trained."""
    root = twenty_pngs(digits, tmp_path / "data")
    monkeypatch.setenv("PYTHONPATH", os.path.join(REPO, "tests"))
    run_dir = tmp_path / "run"
    res = train(run_dir, root, "task.target=testtasks:TermDuringScan")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    status = json.load(open(run_dir / "status.json"))
    assert status["state"] == "stopped" and not status.get("error"), status
    assert os.path.exists(run_dir / "stops.jsonl")
    assert not os.path.exists(run_dir / "checkpoints") or not [
        n for n in os.listdir(run_dir / "checkpoints") if n.startswith("step-")
    ]
    assert "while building the task" in rank0_log(run_dir)
    # Submitted again, it trains from the start.
    res = train(run_dir, root)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert json.load(open(run_dir / "status.json"))["state"] == "completed"


@pytest.mark.parametrize("processes", [1, 2])
def test_a_corrupt_jpeg_exits_2_whatever_the_world_size(digits, tmp_path, processes):
    """The first cause's exit status wins: rank 1's later gloo error (exit 1) once replaced the
    corrupt image's 2 with two processes."""
    root = twenty_pngs(digits, tmp_path / "data")
    with open(os.path.join(root, "b", "broken.jpg"), "wb") as f:
        f.write(b"\xff\xd8\xff\xe0 not a jpeg at all" * 4)
    run_dir = tmp_path / "run"
    res = run_cli(
        "clusterflow.submit",
        "configs/images_digits.yaml",
        f"run.dir={run_dir}",
        f"task.params.root={root}",
        *SMALL[1:],
        "train.batch_size=6",
        f"cluster.tasks_per_node={processes}",
        "--local",
    )
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    assert "cannot decode image" in res.stderr and "broken.jpg" in res.stderr, res.stderr
    assert json.load(open(run_dir / "status.json"))["exit_code"] == 2
