"""Tar shards: the writer's folder is WebDataset's format, the shard task's items are the folder
task's pixels, a batch reads exactly its samples' bytes, the epoch order is every sample once as
a function of (seed, epoch), and a damaged or missing shard folder is one line naming the fix."""

import os

import numpy as np
import pytest
import torch
from conftest import run_cli
from test_images import classes_folder

from clusterflow.errors import UserError
from clusterflow.tasks import load_task, shard_format
from clusterflow.tasks.images import ImageFolderTask, ImageShardsTask


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """18 images in 3 classes (PNG and JPEG), packed by the CLI into shards of 4."""
    base = tmp_path_factory.mktemp("shards")
    src = classes_folder(base / "images")
    out = str(base / "shards")
    res = run_cli("clusterflow.tasks.shards", src, out, "--shard-size", "4")
    assert res.returncode == 0 and "wrote 18 images in 5 shards" in res.stdout, res.stderr
    again = run_cli("clusterflow.tasks.shards", src, out, "--shard-size", "4")
    assert again.returncode == 2 and "already holds shards" in again.stderr
    assert "Traceback" not in again.stderr
    return src, out


def test_webdataset_reads_the_shards_and_the_index_points_at_each_image(packed):
    import webdataset as wds

    src, out = packed
    index = shard_format.ShardIndex.load(out)
    urls = [index.url(s) for s in range(len(index.shards))]
    samples = list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))
    assert [s["__key__"] for s in samples] == [shard_format.key_of(i) for i in range(18)]
    reader = shard_format.ShardReader(index)
    order = np.random.default_rng(0).permutation(18)  # the writer's shuffle, seed 0
    folder = ImageFolderTask(root=src)
    for i, s in enumerate(samples):
        image = s.get("png", s.get("jpg"))
        assert reader.read([i]) == [image]
        assert int(s["cls"]) == index.label[i] == folder.ground_truth()[order[i]]
        with open(os.path.join(src, folder.files[order[i]]), "rb") as f:
            assert f.read() == image  # each file as it was
    assert index.classes == ["cat", "dog", "eel"] and len(index) == 18


def test_shard_items_are_the_folder_items_and_a_batch_reads_only_its_samples(packed):
    src, out = packed
    shards = ImageShardsTask(seed=4, root=out, image_size=12, mix_shards=2)
    folder = ImageFolderTask(seed=4, root=src, image_size=12)
    order = np.random.default_rng(0).permutation(18)
    ds = shards.embed_dataset()
    for i in (0, 7, 17):
        assert torch.equal(ds[i]["x"], folder.embed_dataset()[int(order[i])]["x"])
    train = shards.train_dataset()
    batch = train.__getitems__([9, 2, 14])
    assert [b["index"] for b in batch] == [9, 2, 14]
    assert all(torch.equal(b["x1"], train[b["index"]]["x1"]) for b in batch)
    read, plain = [], shard_format.ShardReader.read

    def counted(reader, indices):
        out = plain(reader, indices)
        read.extend(len(d) for d in out)
        return out

    shard_format.ShardReader.read = counted
    try:
        train.__getitems__([3, 11])
    finally:
        shard_format.ShardReader.read = plain
    assert sum(read) == shards.index.payload_bytes([3, 11])


def test_the_epoch_order_is_every_sample_once_a_function_of_seed_and_epoch(packed):
    _, out = packed
    ds = ImageShardsTask(root=out, mix_shards=2).train_dataset()
    a, b, c = ds.epoch_order(1, 0), ds.epoch_order(1, 0), ds.epoch_order(1, 1)
    assert sorted(a.tolist()) == list(range(18)) and np.array_equal(a, b)
    assert not np.array_equal(a, c) and not np.array_equal(a, ds.epoch_order(2, 0))
    # The order mixes two shards at a time: where shards' samples overlap, at most two do.
    shards = ds.index.shard_of(a)
    spans = sorted(
        (int(np.flatnonzero(shards == s).min()), int(np.flatnonzero(shards == s).max()), s)
        for s in set(shards.tolist())
    )
    groups = []
    for lo, hi, s in spans:
        if groups and lo <= groups[-1][1]:
            groups[-1][1], groups[-1][2] = max(hi, groups[-1][1]), groups[-1][2] | {s}
        else:
            groups.append([lo, hi, {s}])
    assert [len(g[2]) for g in groups] == [2, 2, 1]


def test_a_missing_or_damaged_shard_folder_is_one_line(packed, tmp_path):
    _, out = packed
    with pytest.raises(UserError, match="has no index.json, so it is not a folder of shards"):
        ImageShardsTask(root=str(tmp_path))
    (tmp_path / "index.json").write_text('{"format": "other"}')
    with pytest.raises(UserError, match="not a clusterflow shard index"):
        ImageShardsTask(root=str(tmp_path))
    cut = tmp_path / "cut"
    os.makedirs(cut)
    for name in os.listdir(out):
        data = open(os.path.join(out, name), "rb").read()
        (cut / name).write_bytes(data[:1024] if name == "shard-000001.tar" else data)
    task = ImageShardsTask(root=str(cut))
    with pytest.raises(UserError, match="the shard changed or was cut after its index"):
        task.train_dataset()[5]
    with pytest.raises(UserError, match="mix_shards = 0 is out of range for ImageShardsTask"):
        load_task("clusterflow.tasks.images:ImageShardsTask", 0, {"root": out, "mix_shards": 0})
