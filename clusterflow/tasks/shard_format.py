"""WebDataset-style tar shards with an index: the layout, reading samples by index, and the epoch
order that keeps shards together.

A shard folder (a local path, a shared filesystem or any fsspec URL, e.g. ``s3://bucket/x`` with
the ``[s3]`` extra) holds::

    shard-000000.tar ...   POSIX tar files; sample ``i`` is the members ``<key>.<ext>`` (the image
                           file as it was, e.g. ``.png``) and, with class folders,
                           ``<key>.cls`` (its class index in ASCII), ``key = f"{i:09d}"``:
                           what ``webdataset.WebDataset`` reads as ``__key__``, ``png``, ``cls``
    index.npz              by sample: ``offset`` (where the image's bytes start in its shard),
                           ``size`` and ``label`` (-1 without classes), integers of the
                           narrowest type that holds them, compressed (about 2 bytes a sample)
    index.json             written last: ``format``, ``version``, ``samples``, ``classes``,
                           ``shards`` ([{name, samples, bytes}], in sample order), ``arrays``

Samples are numbered across shards in shard order, so a contiguous range of indices (a rank's
block of the mining embed) is a contiguous run of shards. Reading goes by the index, never by
walking a tar: a sample is one read of ``size`` bytes at ``offset`` (``os.pread`` on a local or
shared filesystem, ``cat_ranges`` elsewhere), so a resume in mid-epoch reads nothing of the
samples it skips, and every sample is read once per epoch by the rank that trains it.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import torch

from clusterflow.errors import UserError

FORMAT, VERSION = "clusterflow.shards", 1
INDEX_JSON, INDEX_ARRAYS = "index.json", "index.npz"
SHARD_NAME = "shard-{:06d}.tar"
KEY_DIGITS = 9


def key_of(index: int) -> str:
    return f"{index:0{KEY_DIGITS}d}"


def join(root: str, name: str) -> str:
    """``root/name`` without mangling a URL (a Path would turn s3:// into s3:/)."""
    return f"{root.rstrip('/')}/{name}"


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


@dataclass
class ShardIndex:
    """What index.json and index.npz say about a shard folder."""

    root: str
    shards: list[dict[str, Any]]  # {name, samples, bytes}, in sample order
    classes: list[str]
    offset: np.ndarray
    size: np.ndarray
    label: np.ndarray | None
    starts: np.ndarray  # each shard's first sample, and the number of samples

    def __len__(self) -> int:
        return int(self.starts[-1])

    @classmethod
    def load(cls, root: str) -> ShardIndex:
        """The index of the shard folder ``root``; UserError when it is missing or damaged."""
        try:
            fs, path = fsspec.core.url_to_fs(root)
            with fs.open(join(path, INDEX_JSON), "rb") as f:
                head = json.loads(f.read().decode("utf-8"))
        except FileNotFoundError:
            raise UserError(
                f"task.params.root={root!r} has no {INDEX_JSON}, so it is not a folder of "
                "shards; write one from an image folder with `python -m clusterflow.tasks.shards "
                f"SRC_FOLDER {root} --shard-size 1000` (or use ImageFolderTask for the folder)"
            ) from None
        except (OSError, ValueError) as exc:
            raise UserError(
                f"task.params.root={root!r}: {INDEX_JSON} cannot be read "
                f"({type(exc).__name__}: {exc}); write the shards again"
            ) from None
        if not isinstance(head, dict) or head.get("format") != FORMAT:
            raise UserError(
                f"task.params.root={root!r}: {INDEX_JSON} is not a clusterflow shard index "
                f"(format {head.get('format') if isinstance(head, dict) else head!r}); write "
                "the shards with `python -m clusterflow.tasks.shards SRC_FOLDER OUT`"
            )
        if head.get("version") != VERSION:
            raise UserError(
                f"task.params.root={root!r}: shard index version {head.get('version')!r}, this "
                f"clusterflow reads version {VERSION}; write the shards again with it"
            )
        try:
            with fs.open(join(path, head.get("arrays", INDEX_ARRAYS)), "rb") as f:
                arrays = np.load(io.BytesIO(f.read()))
                offset, size, label = arrays["offset"], arrays["size"], arrays["label"]
            shards = list(head["shards"])
            counts = np.array([int(s["samples"]) for s in shards], dtype=np.int64)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(
                f"task.params.root={root!r}: the shard index arrays cannot be read "
                f"({type(exc).__name__}: {exc}); write the shards again"
            ) from None
        n = int(counts.sum())
        if not (len(offset) == len(size) == len(label) == n == head.get("samples")):
            raise UserError(
                f"task.params.root={root!r}: the shard index is inconsistent ({n} samples in its "
                f"shards, {len(offset)} offsets, samples = {head.get('samples')!r}); write the "
                "shards again"
            )
        classes = list(head.get("classes") or [])
        return cls(
            root=root.rstrip("/"),
            shards=shards,
            classes=classes,
            offset=offset.astype(np.int64),
            size=size.astype(np.int64),
            label=label.astype(np.int64) if classes else None,
            starts=np.concatenate([[0], np.cumsum(counts)]),
        )

    def shard_of(self, indices: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, indices, side="right") - 1

    def url(self, shard: int) -> str:
        return join(self.root, self.shards[shard]["name"])

    def payload_bytes(self, indices: np.ndarray | Sequence[int]) -> int:
        """How many bytes the images of ``indices`` hold (what reading them costs)."""
        return int(self.size[np.asarray(indices, dtype=np.int64)].sum())


def epoch_order(index: ShardIndex, seed: int, epoch: int, mix: int) -> np.ndarray:
    """Every sample once, a deterministic function of (seed, epoch): the shards in a random order,
    taken ``mix`` at a time, the samples of each group of ``mix`` shards in a random order. A
    global batch then lies in one group (or two), so a rank's slice of it is read from a few
    shards; samples of different shards still meet in batches."""
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + epoch)
    shards = torch.randperm(len(index.shards), generator=g).numpy()
    parts = []
    for first in range(0, len(shards), mix):
        block = np.concatenate(
            [np.arange(index.starts[s], index.starts[s + 1]) for s in shards[first : first + mix]]
        )
        parts.append(block[torch.randperm(len(block), generator=g).numpy()])
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class ShardReader:
    """Reads samples' bytes by index, in one process (a DataLoader worker opens its own files:
    the reader is not pickled). Reads of a batch are sorted by shard and offset."""

    def __init__(self, index: ShardIndex) -> None:
        self.index = index
        self._fs: fsspec.AbstractFileSystem | None = None
        self._local = False
        self._fds: dict[int, int] = {}
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {"index": self.index}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["index"])

    def _open(self) -> None:
        if self._pid == os.getpid():
            return
        self._fds = {}  # a forked copy's descriptors belong to its parent
        self._fs, _ = fsspec.core.url_to_fs(self.index.root)
        self._local = _is_local(self._fs)
        self._pid = os.getpid()

    def _fd(self, shard: int) -> int:
        fd = self._fds.get(shard)
        if fd is None:
            path = fsspec.core.url_to_fs(self.index.url(shard))[1]
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise UserError(
                    f"shard {self.index.url(shard)} cannot be opened ({exc.strerror}); the shard "
                    f"folder {self.index.root} is incomplete: copy or write it again"
                ) from None
            self._fds[shard] = fd
        return fd

    def read(self, indices: list[int]) -> list[bytes]:
        """The image bytes of each of ``indices``, in that order."""
        self._open()
        idx = np.asarray(indices, dtype=np.int64)
        shard = self.index.shard_of(idx)
        offset, size = self.index.offset[idx], self.index.size[idx]
        order = np.lexsort((offset, shard))
        out: list[bytes] = [b""] * len(idx)
        if self._local:
            for i in order:
                data = os.pread(self._fd(int(shard[i])), int(size[i]), int(offset[i]))
                self._check(data, int(idx[i]), int(shard[i]), int(size[i]))
                out[i] = data
            return out
        urls = [self.index.url(int(shard[i])) for i in order]
        starts = [int(offset[i]) for i in order]
        ends = [int(offset[i] + size[i]) for i in order]
        for i, data in zip(order, self._fs.cat_ranges(urls, starts, ends)):
            if isinstance(data, BaseException):
                raise UserError(
                    f"sample {idx[i]} of {self.index.url(int(shard[i]))} cannot be read "
                    f"({type(data).__name__}: {data})"
                )
            self._check(data, int(idx[i]), int(shard[i]), int(size[i]))
            out[i] = data
        return out

    def _check(self, data: bytes, index: int, shard: int, size: int) -> None:
        if len(data) != size:
            raise UserError(
                f"sample {index} of {self.index.url(shard)}: {len(data)} bytes where the index "
                f"says {size}; the shard changed or was cut after its index was written: write "
                "the shards again"
            )

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
