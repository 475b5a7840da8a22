"""python -m clusterflow.tasks.shards SRC_FOLDER OUT --shard-size N [--seed S]

Packs an image folder (the layout ``ImageFolderTask`` reads: one sub-folder per class, or flat)
into WebDataset-style tar shards of N images each, with an index, for ``ImageShardsTask``.

The images are shuffled once (``--seed``) so that each shard holds every class; each image file
goes in as it is (no re-encoding), as ``<key>.<ext>`` beside ``<key>.cls`` (its class index) when
the folder has classes. OUT may be a local path or any fsspec URL (s3://... with the [s3] extra);
index.json is written last, so a folder without it is an unfinished write. Layout and reading:
``shard_format.py``; docs/data.md.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
from typing import Any

import fsspec
import numpy as np

from clusterflow.errors import EXIT_OK, UserError, cli
from clusterflow.tasks import shard_format
from clusterflow.tasks.images import scan


def _member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """A member whose header holds nothing of this machine (owner, time): the same folder gives
    the same shards."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def _write_shard(
    fs: fsspec.AbstractFileSystem,
    url: str,
    src: str,
    files: list[str],
    labels: np.ndarray | None,
    first: int,
) -> tuple[list[int], list[int], int]:
    """One shard of ``files`` (samples ``first``...): (each image's data offset, its size, the
    shard's bytes), the offsets as tarfile reads them back."""
    names = []
    with (
        fs.open(url, "wb") as f,
        tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as t,
    ):
        for i, rel in enumerate(files):
            key = shard_format.key_of(first + i)
            ext = os.path.splitext(rel)[1].lower().lstrip(".")
            with open(os.path.join(src, rel), "rb") as image:
                _member(t, f"{key}.{ext}", image.read())
            names.append(f"{key}.{ext}")
            if labels is not None:
                _member(t, f"{key}.cls", str(int(labels[i])).encode())
    where = {}
    with fs.open(url, "rb") as f, tarfile.open(fileobj=f, mode="r:") as t:
        for m in t:
            where[m.name] = (m.offset_data, m.size)
    size = fs.size(url)
    return [where[n][0] for n in names], [where[n][1] for n in names], size


def _narrowest(largest: int) -> type:
    return next(t for t in (np.uint16, np.uint32, np.int64) if largest < np.iinfo(t).max)


def write_shards(src: str, out: str, shard_size: int, seed: int = 0) -> dict[str, Any]:
    """Pack the image folder ``src`` into shards under ``out``; returns index.json's content."""
    files, labels, classes = scan(src, 0.0)
    order = np.random.default_rng(seed).permutation(len(files))
    files = [files[i] for i in order]
    labels = labels[order] if labels is not None else None
    fs, root = fsspec.core.url_to_fs(out)
    if fs.exists(shard_format.join(root, shard_format.INDEX_JSON)):
        raise UserError(
            f"{out} already holds shards ({shard_format.INDEX_JSON}); remove it or pick another OUT"
        )
    fs.makedirs(root, exist_ok=True)
    shards, offsets, sizes = [], [], []
    for k, first in enumerate(range(0, len(files), shard_size)):
        name = shard_format.SHARD_NAME.format(k)
        part = files[first : first + shard_size]
        off, size, nbytes = _write_shard(
            fs,
            shard_format.join(root, name),
            src,
            part,
            labels[first : first + shard_size] if labels is not None else None,
            first,
        )
        shards.append({"name": name, "samples": len(part), "bytes": nbytes})
        offsets += off
        sizes += size
    arrays = io.BytesIO()
    # The narrowest types that hold the values, compressed: every start reads the whole index.
    label = labels if labels is not None else np.full(len(files), -1)
    np.savez_compressed(
        arrays,
        offset=np.asarray(offsets, _narrowest(max(offsets, default=0))),
        size=np.asarray(sizes, _narrowest(max(sizes, default=0))),
        label=label.astype(np.int16 if len(classes) < 2**15 else np.int32),
    )
    fs.pipe_file(shard_format.join(root, shard_format.INDEX_ARRAYS), arrays.getvalue())
    head = {
        "format": shard_format.FORMAT,
        "version": shard_format.VERSION,
        "samples": len(files),
        "classes": classes,
        "shards": shards,
        "arrays": shard_format.INDEX_ARRAYS,
        "seed": seed,
    }
    fs.pipe_file(shard_format.join(root, shard_format.INDEX_JSON), json.dumps(head).encode())
    return head


@cli
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m clusterflow.tasks.shards",
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", metavar="SRC_FOLDER", help="an image folder (class folders or flat)")
    p.add_argument("out", metavar="OUT", help="the shard folder to write (a path or a URL)")
    p.add_argument("--shard-size", type=int, default=1000, help="images per shard (1000)")
    p.add_argument("--seed", type=int, default=0, help="the shuffle of images into shards (0)")
    args = p.parse_args(argv)
    if args.shard_size < 1:
        raise UserError(
            f"--shard-size {args.shard_size}: give the number of images per shard, >= 1"
        )
    head = write_shards(args.src, args.out, args.shard_size, args.seed)
    total = sum(s["bytes"] for s in head["shards"])
    print(
        f"wrote {head['samples']} images in {len(head['shards'])} shards "
        f"({total / 2**20:.1f} MiB, {len(head['classes'])} classes) to {args.out}"
    )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
