"""python -m clusterflow.tasks.shards SRC_FOLDER OUT --shard-size N [--seed S]

Packs an image folder (the layout ``ImageFolderTask`` reads: one sub-folder per class, or flat)
into WebDataset-style tar shards of N images each, with an index, for ``ImageShardsTask``.

The images are shuffled once (``--seed``) so that each shard holds every class; each image file
goes in as it is (no re-encoding), as ``<key>.<ext>`` beside ``<key>.cls`` (its class index) when
the folder has classes. OUT may be a local path or any fsspec URL (s3://... with the [s3] extra);
index.json is written last, so a folder without it is an unfinished write. Layout and reading:
``shard_format.py``; docs/data.md.

SRC and OUT are checked before anything is written: SRC a folder of images every one of which
can be read (a broken symbolic link is named), OUT a folder that can be made and written in (not
a file, not under a file, not on a read-only filesystem) or a URL of a protocol fsspec has; each
refusal is one ``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import tarfile
from typing import Any

import fsspec
import numpy as np

from clusterflow.config.paths import check_backend, check_local_dir
from clusterflow.config.sections import is_url
from clusterflow.errors import EXIT_OK, UserError, cli
from clusterflow.tasks import shard_format
from clusterflow.tasks.images import scan


def _member(tar: tarfile.TarFile, name: str, data: bytes, packing: str) -> None:
    """A member whose header holds nothing of this machine (owner, time): the same folder gives
    the same shards. Its owner name is the packing, which the reader checks."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uname = len(data), 0, 0o644, packing
    tar.addfile(info, io.BytesIO(data))


def check_out(out: str) -> None:
    """UserError unless shards can be written at ``out``, before anything is written: a local
    folder that exists or can be made, and can be written in; or a URL whose protocol fsspec has."""
    if is_url(out) and not out.startswith("file://"):
        check_backend("OUT", out)
    else:
        check_local_dir("OUT", out.removeprefix("file://"))


def _readable(src: str, files: list[str]) -> list[int]:
    """Each file's size; UserError naming the files of ``src`` that cannot be read (a broken
    symbolic link, a file this user may not read), before anything is written."""
    sizes, bad = [], []
    for rel in files:
        path = os.path.join(src, rel)
        try:
            sizes.append(os.stat(path).st_size)
            if not os.access(path, os.R_OK):
                bad.append(f"{rel} (permission denied)")
        except OSError as exc:
            why = (
                f"a broken symbolic link to {os.readlink(path)}"
                if os.path.islink(path)
                else exc.strerror
            )
            bad.append(f"{rel} ({why})")
    if bad:
        raise UserError(
            f"SRC={src!r} holds {len(bad)} image file(s) that cannot be read: "
            f"{', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}; fix or remove them, then "
            "pack again (nothing was written)"
        )
    return sizes


def _packing(files: list[str], sizes: list[int], labels: np.ndarray | None, shard: int) -> str:
    """What tells this packing from another of the same images: the files in their packed order
    with their sizes and classes, and the shard size (the seed is in the order)."""
    h = hashlib.sha256(f"{shard_format.FORMAT}:{shard_format.VERSION}:{shard}".encode())
    for i, (rel, size) in enumerate(zip(files, sizes)):
        label = int(labels[i]) if labels is not None else -1
        h.update(f"\0{rel}\0{size}\0{label}".encode())
    return h.hexdigest()[: shard_format.PACKING_DIGITS]


def _write_shard(
    fs: fsspec.AbstractFileSystem,
    url: str,
    src: str,
    files: list[str],
    *,
    labels: np.ndarray | None,
    first: int,
    packing: str,
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
                _member(t, f"{key}.{ext}", image.read(), packing)
            names.append(f"{key}.{ext}")
            if labels is not None:
                _member(t, f"{key}.cls", str(int(labels[i])).encode(), packing)
    where = {}
    with fs.open(url, "rb") as f, tarfile.open(fileobj=f, mode="r:") as t:
        for m in t:
            where[m.name] = (m.offset_data, m.size)
    size = fs.size(url)
    return [where[n][0] for n in names], [where[n][1] for n in names], size


def _narrowest(largest: int) -> type:
    return next(t for t in (np.uint16, np.uint32, np.int64) if largest < np.iinfo(t).max)


def write_shards(src: str, out: str, shard_size: int, seed: int = 0) -> dict[str, Any]:
    """Pack the image folder ``src`` into shards under ``out``; returns index.json's content.
    Everything is checked before anything is written (UserError)."""
    check_out(out)
    files, labels, classes = scan(src, 0.0, key="SRC")
    sizes = _readable(src, files)
    order = np.random.default_rng(seed).permutation(len(files))
    files, sizes = [files[i] for i in order], [sizes[i] for i in order]
    labels = labels[order] if labels is not None else None
    packing = _packing(files, sizes, labels, shard_size)
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
            labels=labels[first : first + shard_size] if labels is not None else None,
            first=first,
            packing=packing,
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
        "packing": packing,
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
