"""Shard benchmark: samples/s of ImageShardsTask against ImageFolderTask and against bare
webdataset and tarfile loops over the same shards, and the cost of a resume in mid-epoch.

    python benchmarks/shards.py          # 100k 32x32 JPEGs in /tmp/clusterflow-bench-shards
    python benchmarks/shards.py --dir /scratch/bench --images 20000 --measure 10000

The script writes its own images (random colour blocks, JPEG, in 10 class folders) and packs them
with ``python -m clusterflow.tasks.shards``; both stay in ``--dir`` for the next run. Every loader
does the same work per sample: decode (Pillow), centre-crop and resize, two augmented views, and
batches of ``--batch`` with ``--workers`` DataLoader workers, so the ratios show the reading and
ordering machinery only. The four loaders are timed in turn, ``--rounds`` times, and the best
round of each is printed; the bare loops read the shards in file order (webdataset's
``shardshuffle=False``; one tarfile pass per shard, shards split over workers).

Resume: the time and the bytes read (``rchar`` of /proc/self/io: every byte a read() returned, page
cache included) until the first batch of a resume at 50% of an epoch, read in this process
(no workers), against reading the first half of the epoch from the start as a streaming loader
must (webdataset, skipping samples without decoding them), and against the payload bytes skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
import tarfile
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

import numpy as np
import torch
from PIL import Image

from clusterflow.distributed.sampler import EpochPlan, GlobalBatchSampler, epoch_order
from clusterflow.tasks import shard_format
from clusterflow.tasks.images import (
    ImageFolderTask,
    ImageShardsTask,
    decode,
    fit_square,
)
from clusterflow.tasks.shards import write_shards

SEED = 7


def make_images(folder: str, n: int, size: int) -> None:
    """``n`` small JPEGs in 10 class folders (kept between runs)."""
    done = os.path.join(folder, ".complete")
    if os.path.exists(done):
        return
    rng = np.random.default_rng(0)
    for i in range(n):
        c = i % 10
        blocks = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
        img = np.kron(blocks, np.ones((size // 4, size // 4, 1), np.uint8))
        path = os.path.join(folder, f"c{c}", f"{i:06d}.jpg")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Image.fromarray(img).save(path, quality=90)
    open(done, "w").close()


class SameWork:
    """What every loader does with an image's bytes: the task's own decode and views."""

    def __init__(self, task: ImageShardsTask) -> None:
        self.items = task.train_dataset()

    def __call__(self, data: bytes, index: int) -> dict:
        img = fit_square(decode(f"sample {index}", self.items.channels, data), 32)
        return self.items.item(img, index)


def _timed(loader, measure: int) -> float:
    """Samples per second over the first ``measure`` samples (after one warm-up batch)."""
    it = iter(loader)
    first = next(it)
    count, t0 = 0, time.perf_counter()
    for batch in it:
        count += len(batch["index"])
        if count >= measure:
            break
    del first
    return count / (time.perf_counter() - t0)


def task_loader(task, batch: int, workers: int) -> torch.utils.data.DataLoader:
    ds = task.train_dataset()
    sampler = GlobalBatchSampler(
        len(ds), batch, 0, 1, SEED, order=lambda s, e: epoch_order(ds, s, e)
    )
    task.set_epoch(0)
    sampler.set_epoch(0)
    return torch.utils.data.DataLoader(
        ds, batch_sampler=sampler, num_workers=workers, persistent_workers=False
    )


class TarStream(torch.utils.data.IterableDataset):
    """Bare tarfile: each worker walks its share of the shards, member by member."""

    def __init__(self, urls: list[str], work: SameWork) -> None:
        self.urls, self.work = urls, work

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        mine = self.urls[info.id :: info.num_workers] if info else self.urls
        for url in mine:
            with tarfile.open(url, "r:") as t:
                for m in t:
                    if m.name.endswith(".jpg"):
                        key = int(m.name.split(".")[0])
                        yield self.work(t.extractfile(m).read(), key)


def wds_loader(urls: list[str], work: SameWork, batch: int, workers: int):
    import webdataset as wds

    ds = (
        wds.WebDataset(urls, shardshuffle=False, nodesplitter=None, empty_check=False)
        .map(lambda s: work(s["jpg"], int(s["__key__"])))
        .batched(batch, partial=False)
    )
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)


def rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def resume_cost(task: ImageShardsTask, batch: int) -> dict:
    """Resume at the batch boundary nearest 50% of epoch 0, in this process."""
    ds = task.train_dataset()
    bounds = EpochPlan.of(len(ds), batch).boundaries()
    half = min(bounds, key=lambda b: abs(b - len(ds) // 2))
    order = epoch_order(ds, SEED, 0)
    skipped = task.index.payload_bytes(order[:half])
    # Once untimed: the first pass reads Python modules too (rchar counts every read).
    next(iter(task_loader(ImageShardsTask(seed=SEED, root=task.root, image_size=32), batch, 0)))
    # Ours: a new task (reads the index), the sampler at `half`, the first batch.
    r0, t0 = rchar(), time.perf_counter()
    fresh = ImageShardsTask(seed=SEED, root=task.root, image_size=32)
    loader = task_loader(fresh, batch, 0)
    loader.batch_sampler.set_epoch(0, half)
    next(iter(loader))
    ours = {"seconds": time.perf_counter() - t0, "bytes": rchar() - r0}
    # The same from the start of the epoch: what a fresh start costs before its first batch.
    r0, t0 = rchar(), time.perf_counter()
    start = ImageShardsTask(seed=SEED, root=task.root, image_size=32)
    next(iter(task_loader(start, batch, 0)))
    first = {"seconds": time.perf_counter() - t0, "bytes": rchar() - r0}
    # A streaming loader has to read its way to the same point: webdataset over the shards in
    # file order, samples counted (not decoded) until `half`, then one batch decoded.
    import webdataset as wds

    urls = [task.index.url(s) for s in range(len(task.index.shards))]
    work = SameWork(task)
    r0, t0 = rchar(), time.perf_counter()
    out = []
    samples = wds.WebDataset(urls, shardshuffle=False, nodesplitter=None, empty_check=False)
    for seen, s in enumerate(samples, start=1):
        if seen > half:
            out.append(work(s["jpg"], int(s["__key__"])))
            if len(out) == batch:
                break
    stream = {"seconds": time.perf_counter() - t0, "bytes": rchar() - r0}
    return {"half": half, "skipped": skipped, "ours": ours, "first": first, "stream": stream}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/clusterflow-bench-shards")
    p.add_argument("--images", type=int, default=100_000)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--shard-size", type=int, default=1000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--measure", type=int, default=20_000, help="samples timed per loader")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    images, shards = (
        os.path.join(a.dir, f"images-{a.images}"),
        os.path.join(a.dir, f"shards-{a.images}-{a.shard_size}"),
    )
    t0 = time.perf_counter()
    make_images(images, a.images, a.size)
    if not os.path.exists(os.path.join(shards, shard_format.INDEX_JSON)):
        write_shards(images, shards, a.shard_size)
    print(f"data: {a.images} images ({time.perf_counter() - t0:.0f} s to make or find)")
    shard_task = ImageShardsTask(seed=SEED, root=shards, image_size=32)
    folder_task = ImageFolderTask(seed=SEED, root=images, image_size=32, scan_limit_s=0)
    urls = [shard_task.index.url(s) for s in range(len(shard_task.index.shards))]
    work = SameWork(shard_task)
    loaders = {
        "shard task": lambda: task_loader(shard_task, a.batch, a.workers),
        "folder task": lambda: task_loader(folder_task, a.batch, a.workers),
        "bare webdataset": lambda: wds_loader(urls, work, a.batch, a.workers),
        "bare tarfile": lambda: torch.utils.data.DataLoader(
            TarStream(urls, work), batch_size=a.batch, num_workers=a.workers
        ),
    }
    best = {name: 0.0 for name in loaders}
    for r in range(a.rounds):
        for name, make in loaders.items():
            rate = _timed(make(), a.measure)
            best[name] = max(best[name], rate)
            print(f"round {r + 1}: {name:16s} {rate:8.0f} samples/s")
    bare = max(best["bare webdataset"], best["bare tarfile"])
    print(f"\nsamples/s, best of {a.rounds} rounds, {a.workers} workers, batch {a.batch}:")
    for name, rate in best.items():
        print(f"  {name:16s} {rate:8.0f}  ({rate / bare:.2f}x the faster bare loop)")
    res = resume_cost(shard_task, a.batch)
    mib = 2**20
    print(
        f"\nresume at sample {res['half']} of {a.images} (epoch 0), until the first batch:\n"
        f"  shard task, resumed     {res['ours']['seconds']:6.2f} s, "
        f"{res['ours']['bytes'] / mib:7.1f} MiB read "
        f"({res['ours']['bytes'] / res['skipped']:.2%} of the {res['skipped'] / mib:.1f} MiB "
        "of images skipped; the index included)\n"
        f"  shard task, from start  {res['first']['seconds']:6.2f} s, "
        f"{res['first']['bytes'] / mib:7.1f} MiB read (a fresh start, for comparison)\n"
        f"  webdataset, read to it  {res['stream']['seconds']:6.2f} s, "
        f"{res['stream']['bytes'] / mib:7.1f} MiB read "
        f"({res['stream']['seconds'] / res['ours']['seconds']:.1f}x the resumed time)\n"
        f"the resume read {res['ours']['bytes'] / res['stream']['bytes']:.2%} of the bytes "
        "read to get there from the start; beyond a fresh start's first batch it read "
        f"{(res['ours']['bytes'] - res['first']['bytes']) / mib:+.2f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
