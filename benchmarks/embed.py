"""Embedding benchmark: images per second of the mining stage's embed (``mining.embed_shard``)
against a bare ``torch.no_grad()`` loop over the same DataLoader and model.

    python benchmarks/embed.py   # 2,000 generated 256x256 JPEGs -> 32 px
    python benchmarks/embed.py --root data/digits --image-size 16 --channels 1
    python benchmarks/embed.py --workers 0 8 --backbone resnet18 --image-size 128   # a GPU node

The images are decoded with Pillow by the image task (``ImageFolderTask``: decode, centre crop,
resize) in the DataLoader, in the main process (``--workers 0``) or in worker processes. Both
sides use the same dataset, model, batch size, worker count and pinned memory (on a GPU); the
bare loop copies each batch's embeddings to the host with ``.cpu()``, the way a hand-written
loop does. Runs alternate between the sides, after one untimed pass that warms the page cache;
the best run of each side is the claim, the median is printed beside it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def generate(root: str, n: int, size: int) -> None:
    """``n`` JPEGs of ``size`` x ``size``: smooth random colour fields (they compress and decode
    like photographs, unlike white noise), in 10 class folders."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(n):
        small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        img = Image.fromarray(small).resize((size, size), Image.BICUBIC)
        folder = os.path.join(root, f"class{i % 10}")
        os.makedirs(folder, exist_ok=True)
        img.save(os.path.join(folder, f"{i:06d}.jpg"), quality=90)


def bare(task, model, dataset, batch: int, workers: int, device) -> np.ndarray:
    import torch

    loader = torch.utils.data.DataLoader(
        torch.utils.data.Subset(dataset, list(range(len(dataset)))),
        batch_size=batch,
        num_workers=workers,
        pin_memory=device.type == "cuda",
    )
    out = []
    with torch.no_grad():
        for b in loader:
            out.append(task.embed(model, {"x": b["x"].to(device, non_blocking=True)}).float().cpu())
    return torch.cat(out).numpy()


def ours(task, model, dataset, batch: int, workers: int, device) -> np.ndarray:
    from clusterflow.config.sections.data import DataConfig
    from clusterflow.mining.stage import embed_shard

    data = DataConfig(num_workers=workers, pin_memory=True)
    return embed_shard(task, model, dataset, batch, device, None, data=data)[1]


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--root",
        help="an image folder; default: generate --n JPEGs of --size px in a temporary folder",
    )
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--channels", type=int, default=3)
    p.add_argument("--backbone", default="small")
    p.add_argument("--batch", type=int, default=256, help="mining.embed_batch")
    p.add_argument(
        "--workers", type=int, nargs="+", default=[0, 2], help="data.num_workers values to measure"
    )
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    import torch

    from clusterflow.tasks.images import ImageFolderTask

    tmp = None
    if a.root is None:
        tmp = a.root = tempfile.mkdtemp(prefix="bench-embed-")
        generate(a.root, a.n, a.size)
    try:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        task = ImageFolderTask(
            root=a.root, image_size=a.image_size, channels=a.channels, backbone=a.backbone
        )
        model = task.build_model().to(device).eval()
        ds = task.embed_dataset()
        where = (
            torch.cuda.get_device_name(0)
            if device.type == "cuda"
            else f"CPU, {os.cpu_count()} cores, {torch.get_num_threads()} threads"
        )
        print(
            f"{len(ds)} images from {a.root} -> {a.image_size} px, {a.backbone} backbone, batch "
            f"{a.batch}, {where}"
        )
        for w in a.workers:
            np.testing.assert_array_equal(
                ours(task, model, ds, a.batch, w, device), bare(task, model, ds, a.batch, w, device)
            )
            times = {"embed_shard": [], "bare loop": []}
            for r in range(a.repeats):
                for name, fn in (
                    (("embed_shard", ours), ("bare loop", bare))
                    if r % 2 == 0
                    else (("bare loop", bare), ("embed_shard", ours))
                ):
                    times[name].append(timed(fn, task, model, ds, a.batch, w, device))
            rate = {k: len(ds) / min(v) for k, v in times.items()}
            med = {k: len(ds) / statistics.median(v) for k, v in times.items()}
            print(
                f"workers {w}: embed_shard {rate['embed_shard']:.0f} img/s (median "
                f"{med['embed_shard']:.0f}), bare loop {rate['bare loop']:.0f} img/s (median "
                f"{med['bare loop']:.0f}); ratio best "
                f"{rate['embed_shard'] / rate['bare loop']:.3f}x, median "
                f"{med['embed_shard'] / med['bare loop']:.3f}x (load average "
                f"{os.getloadavg()[0]:.2f})",
                flush=True,
            )
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
