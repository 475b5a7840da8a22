"""Exactly once: runs killed (SIGKILL) in mid-epoch and resumed on other world sizes train every
sample of every epoch once in their committed history, as the sample ledger says and as the
batches the task saw show; a resume on the same world size is bitwise the uninterrupted run.

Each test is one chain of real multi-process launches (tests/launch.py) of a task that records
every batch it trains on (testtasks._Seen): the data in memory (PseudoIDTask) and the data in tar
shards (ImageShardsTask). What a killed attempt trained after its last checkpoint is lost with it
and must be trained again by the next attempt: it is in the recorded batches, not in the ledger.
"""

import json
import os

import launch
import numpy as np
import pytest
import torch
from conftest import REPO
from PIL import Image

from clusterflow.distributed.sampler import EpochPlan, epoch_permutation
from clusterflow.manage.status import collect
from clusterflow.rundir.paths import RunPaths
from clusterflow.tasks import shard_format
from clusterflow.tasks.shards import write_shards

pytestmark = pytest.mark.slow


def _config(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def _launch(world, config, run_dir, kill=""):
    """``kill``: the task's kill plan, the same at every launch of one run (a result key)."""
    over = [
        f"run.dir={run_dir}",
        f"cluster.tasks_per_node={world}",
        f"task.params.run_dir={run_dir}",
        f"task.params.kill={kill}",
    ]
    return launch.run(world, config, over, run_dir)


def _seen(run_dir):
    """(attempt, epoch) -> the global batches that attempt trained in that epoch, in order (each
    the sorted union of the ranks' slices, which must not overlap)."""
    calls = {}
    folder = os.path.join(run_dir, "seen")
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            for line in f:
                r = json.loads(line)
                calls.setdefault((r["attempt"], r["epoch"], r["call"]), []).append(r["index"])
    out = {}
    for (attempt, epoch, _), parts in sorted(calls.items()):
        union = sorted(i for p in parts for i in p)
        assert len(union) == len(set(union)), ("ranks' slices overlap", attempt, epoch, parts)
        out.setdefault((attempt, epoch), []).append(union)
    return out


def _check_exactly_once(run_dir, n, batch_size, epochs, order_of, expected):
    """The ledger's ranges tile each epoch's order once, with the attempts and world sizes
    ``expected`` ({epoch: [(start, end, attempt, world)]}); each attempt's recorded batches are
    the global batches of the plan at those positions of the epoch's order; what an attempt
    trained past its ledger range (lost to the kill) is what the next range starts with; every
    index of every epoch is in exactly one committed batch."""
    with open(os.path.join(run_dir, "sample_ledger.json")) as f:
        ledger = json.load(f)
    assert [e["epoch"] for e in ledger["epochs"]] == list(range(epochs))
    seen = _seen(run_dir)
    bounds = EpochPlan.of(n, batch_size).boundaries()
    for e in ledger["epochs"]:
        epoch, order = e["epoch"], list(order_of(e["epoch"]))
        assert e["samples"] == n
        ranges = [(r["start"], r["end"], r["attempt"], r["world_size"]) for r in e["ranges"]]
        assert ranges == expected[epoch], (epoch, ranges)
        committed = []
        for start, end, attempt, _ in ranges:
            pos = start
            for batch in seen[(attempt, epoch)]:
                size = bounds[bounds.index(pos) + 1] - pos
                assert batch == sorted(order[pos : pos + size]), (epoch, attempt, pos)
                if pos < end:
                    committed += batch
                pos += size
            assert pos >= end  # the attempt trained its range, and perhaps lost steps after it
        assert sorted(committed) == list(range(n)), epoch
    return ledger


def test_a_run_killed_on_2_ranks_resumed_on_3_then_1_trains_every_sample_once(
    tmp_path, monkeypatch
):
    """206 samples in batches of 48: four steps of 48, 48, 48 and 62 (split unevenly over 3 ranks).
    Killed at step 3 on 2 ranks (committed step 2), resumed on 3 ranks and killed at step 7
    (committed step 6, after mining on 3 ranks), finished on 1 rank."""
    monkeypatch.setenv("PYTHONPATH", os.path.join(REPO, "tests"))
    config = _config(
        tmp_path,
        "run: {seed: 3}\n"
        "train: {epochs: 2, batch_size: 48, lr: 0.003, log_every_steps: 1, progress_bar: false}\n"
        "checkpoint: {every_steps: 2, keep_last: 20, async: false}\n"
        "mining: {k: 5, threshold: 0.5}\n"
        "task:\n"
        "  target: testtasks:SeenPseudoID\n"
        "  params: {identities: 103, samples_per_identity: 2, input_dim: 8, hidden: 16, "
        "embed_dim: 4}\n",
    )
    d = str(tmp_path / "run")
    kill = "0@3,1@5"  # the same config every launch: the attempt picks its kill
    assert _launch(2, config, d, kill) == [-9, -9]
    assert _launch(3, config, d, kill) == [-9, -9, -9]
    assert _launch(1, config, d, kill) == [0]
    ledger = _check_exactly_once(
        d,
        206,
        48,
        2,
        lambda epoch: epoch_permutation(206, 3, epoch).tolist(),
        {0: [(0, 96, 0, 2), (96, 206, 1, 3)], 1: [(0, 96, 1, 3), (96, 206, 2, 1)]},
    )
    status = collect(RunPaths(d))
    assert status["state"] == "completed" and status["samples"] == ledger
    assert status["mining"] and status["mining"][0]["epoch"] == 1


def _image_folder(root, per_class=23):
    rng = np.random.default_rng(0)
    for c in ("a", "b", "c"):
        os.makedirs(os.path.join(root, c))
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
                os.path.join(root, c, f"{i}.png")
            )
    return str(root)


def _weights(folder):
    return torch.load(os.path.join(folder, "model.pt"), weights_only=True)


def test_a_shard_run_killed_inside_shards_resumes_exactly_once_and_bitwise(tmp_path, monkeypatch):
    """69 images in 7 shards of 10, batches of 12 (12, 12, 12, 12, 21): killed on 2 ranks in
    the first epoch inside a shard, resumed on 2 ranks (its checkpoints bitwise those of the
    uninterrupted 2-rank run) and killed in epoch 2, resumed on 3 ranks and killed in epoch 3,
    finished on 1 rank."""
    monkeypatch.setenv("PYTHONPATH", os.path.join(REPO, "tests"))
    shards = str(tmp_path / "shards")
    write_shards(_image_folder(tmp_path / "images"), shards, 10)
    config = _config(
        tmp_path,
        "run: {seed: 3}\n"
        "train: {epochs: 3, batch_size: 12, lr: 0.003, log_every_steps: 1, progress_bar: false}\n"
        "checkpoint: {every_steps: 2, keep_last: 50, async: false}\n"
        "mining: {k: 3, threshold: 0.5}\n"
        "task:\n"
        "  target: testtasks:SeenShards\n"
        f"  params: {{root: {shards}, image_size: 8, width: 4, embed_dim: 4, mix_shards: 2}}\n",
    )
    plain, d = str(tmp_path / "plain"), str(tmp_path / "run")
    assert _launch(2, config, plain) == [0, 0]
    kill = "0@3,1@6,2@7"
    assert _launch(2, config, d, kill) == [-9, -9]
    assert _launch(2, config, d, kill) == [-9, -9]
    assert _launch(3, config, d, kill) == [-9, -9, -9]
    assert _launch(1, config, d, kill) == [0]
    index = shard_format.ShardIndex.load(shards)
    _check_exactly_once(
        d,
        69,
        12,
        3,
        lambda epoch: shard_format.epoch_order(index, 3, epoch, 2),
        {
            0: [(0, 24, 0, 2), (24, 69, 1, 2)],
            1: [(0, 12, 1, 2), (12, 69, 2, 3)],
            2: [(0, 24, 2, 3), (24, 69, 3, 1)],
        },
    )
    # The first resume point, sample 24 of epoch 1's order, is inside shards: samples of the
    # same shards come before and after it.
    order = shard_format.epoch_order(index, 3, 0, 2)
    before, after = (set(index.shard_of(order[a:b]).tolist()) for a, b in ((16, 24), (24, 36)))
    assert before & after, (before, after)
    # Steps 2 (the first attempt), 4, 5 and 6 (the resumed one, on the same world size) are
    # bitwise the uninterrupted run's.
    for step in (2, 4, 5, 6):
        a = _weights(os.path.join(plain, "checkpoints", f"step-{step}"))
        b = _weights(os.path.join(d, "checkpoints", f"step-{step}"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), step
    rounds = collect(RunPaths(d))["mining"]
    assert [r["epoch"] for r in rounds] == [1, 2] and all("nmi" in r for r in rounds)
