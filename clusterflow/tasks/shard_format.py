"""WebDataset-style tar shards with an index: the layout, reading samples by index, and the epoch
order that keeps shards together.

A shard folder (a local path, a shared filesystem or any fsspec URL, e.g. ``s3://bucket/x`` with
the ``[s3]`` extra) holds::

    shard-000000.tar ...   POSIX tar files; sample ``i`` is the members ``<key>.<ext>`` (the image
                           file as it was, e.g. ``.png``) and, with class folders,
                           ``<key>.cls`` (its class index in ASCII), ``key = f"{i:09d}"``:
                           what ``webdataset.WebDataset`` reads as ``__key__``, ``png``, ``cls``;
                           each member's owner name (the header's ``uname``) is the packing
    index.npz              by sample: ``offset`` (where the image's bytes start in its shard),
                           ``size`` and ``label`` (-1 without classes), integers of the
                           narrowest type that holds them, compressed (about 2 bytes a sample)
    index.json             written last: ``format``, ``version``, ``samples``, ``classes``,
                           ``shards`` ([{name, samples, bytes}], in sample order), ``arrays``,
                           ``seed`` and ``packing`` (what tells this packing from another of
                           the same images: a hash of the files packed, their order and the
                           shard size)

Samples are numbered across shards in shard order, so a contiguous range of indices (a rank's
block of the mining embed) is a contiguous run of shards. Reading goes by the index, never by
walking a tar: a sample is one read at ``offset`` of its ``size`` bytes and the 512-byte tar
header before them (``os.pread`` on a local or shared filesystem, ``cat_ranges`` elsewhere), so a
resume in mid-epoch reads nothing of the samples it skips, and every sample is read once per
epoch by the rank that trains it. The header is checked at no extra cost: its name must be the
sample's key and its owner the index's packing, so a shard swapped for another of the same layout
(another position, another packing) or an index of another packing is refused, not read as other
images. A shard's size is checked against the index when it is opened.

A process keeps at most :func:`open_limit` shards open (the least recently read is closed first):
ImageNet in shards of 1000 is 1,282 shards, more than a default ``ulimit -n`` of 1024.

The index's :attr:`ShardIndex.digest` (of ``index.json`` and ``index.npz``) is the data's
identity that a run's checkpoints record: a folder packed again is other data.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import resource
import stat
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import torch

from clusterflow.errors import UserError
from clusterflow.tasks import DatasetError

FORMAT, VERSION = "clusterflow.shards", 1
INDEX_JSON, INDEX_ARRAYS = "index.json", "index.npz"
SHARD_NAME = "shard-{:06d}.tar"
KEY_DIGITS = 9
HEADER = 512  # a tar member's header, right before its data
# Where a ustar header keeps the member's name, owner name and name prefix.
_NAME, _UNAME, _PREFIX = slice(0, 100), slice(265, 297), slice(345, 500)
PACKING_DIGITS = 24  # fits the header's 32-byte owner name
MAX_OPEN = 64  # shards one process keeps open at most


def open_limit() -> int:
    """How many shards one process keeps open: :data:`MAX_OPEN`, or a 16th of the process's
    limit on open files when that is lower (a DataLoader worker is a process of its own)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_OPEN
    return max(2, min(MAX_OPEN, soft // 16))


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
    digest: str = ""  # sha256 of index.json and index.npz: this packing's identity
    packing: str | None = None  # each member's owner name; None: written before it was recorded

    def __len__(self) -> int:
        return int(self.starts[-1])

    @classmethod
    def load(cls, root: str) -> ShardIndex:
        """The index of the shard folder ``root``; UserError when it is missing or damaged."""
        try:
            fs, path = fsspec.core.url_to_fs(root)
            with fs.open(join(path, INDEX_JSON), "rb") as f:
                raw = f.read()
            head = json.loads(raw.decode("utf-8"))
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
                raw_arrays = f.read()
            arrays = np.load(io.BytesIO(raw_arrays))
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
        packing = head.get("packing")
        return cls(
            root=root.rstrip("/"),
            shards=shards,
            classes=classes,
            offset=offset.astype(np.int64),
            size=size.astype(np.int64),
            label=label.astype(np.int64) if classes else None,
            starts=np.concatenate([[0], np.cumsum(counts)]),
            digest=hashlib.sha256(raw + b"\0" + raw_arrays).hexdigest(),
            packing=packing if isinstance(packing, str) and packing else None,
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
    the reader is not pickled). Reads of a batch are sorted by shard and offset, and at most
    ``max_open`` shards (:func:`open_limit` by default) stay open: the least recently read is
    closed before another is opened."""

    def __init__(self, index: ShardIndex, max_open: int | None = None) -> None:
        self.index, self.max_open = index, max_open
        self._fs: fsspec.AbstractFileSystem | None = None
        self._local = False
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {"index": self.index, "max_open": self.max_open}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["index"], state.get("max_open"))

    def _open(self) -> None:
        if self._pid == os.getpid():
            return
        # A forked copy (a DataLoader worker) holds copies of its parent's descriptors: closed
        # here (the parent's stay open), so the worker's own set is the only one it holds.
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = OrderedDict()
        self._fs, _ = fsspec.core.url_to_fs(self.index.root)
        self._local = _is_local(self._fs)
        self._pid = os.getpid()
        if self.max_open is None:
            self.max_open = open_limit()

    def _fd(self, shard: int) -> int:
        fd = self._fds.get(shard)
        if fd is not None:
            self._fds.move_to_end(shard)
            return fd
        while self._fds and len(self._fds) >= (self.max_open or 1):
            os.close(self._fds.popitem(last=False)[1])
        url = self.index.url(shard)
        path = fsspec.core.url_to_fs(url)[1]
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise  # the process is out of descriptors: job/failure.py names it
            raise DatasetError(
                f"shard {url} cannot be opened ({exc.strerror}); the shard folder "
                f"{self.index.root} is incomplete: copy or write it again"
            ) from None
        try:
            self._check_file(os.fstat(fd), shard)
        except DatasetError:
            os.close(fd)
            raise
        self._fds[shard] = fd
        return fd

    def _check_file(self, st: os.stat_result, shard: int) -> None:
        """DatasetError unless shard ``shard`` is a file of the size its index recorded."""
        url = self.index.url(shard)
        if not stat.S_ISREG(st.st_mode):
            what = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise DatasetError(
                f"shard {url} is {what}, not a shard file; the shard folder {self.index.root} "
                "is not as it was written: copy or write it again"
            )
        want = self.index.shards[shard].get("bytes")
        if isinstance(want, int) and st.st_size != want:
            raise DatasetError(
                f"shard {url} is {st.st_size} bytes where its index says {want}; the shard "
                "changed or was cut after its index was written: write the shards again"
            )

    def read(self, indices: list[int]) -> list[bytes]:
        """The image bytes of each of ``indices``, in that order; each read takes the tar header
        before the bytes with it, which must name the sample (``_check``)."""
        self._open()
        idx = np.asarray(indices, dtype=np.int64)
        shard = self.index.shard_of(idx)
        offset, size = self.index.offset[idx], self.index.size[idx]
        order = np.lexsort((offset, shard))
        out: list[bytes] = [b""] * len(idx)
        if self._local:
            for i in order:
                fd = self._fd(int(shard[i]))
                data = os.pread(fd, int(size[i]) + HEADER, int(offset[i]) - HEADER)
                out[i] = self._check(data, int(idx[i]), int(shard[i]), int(size[i]))
            return out
        urls = [self.index.url(int(shard[i])) for i in order]
        starts = [int(offset[i]) - HEADER for i in order]
        ends = [int(offset[i] + size[i]) for i in order]
        for i, data in zip(order, self._fs.cat_ranges(urls, starts, ends)):
            if isinstance(data, BaseException):
                raise DatasetError(
                    f"sample {idx[i]} of {self.index.url(int(shard[i]))} cannot be read "
                    f"({type(data).__name__}: {data})"
                )
            out[i] = self._check(data, int(idx[i]), int(shard[i]), int(size[i]))
        return out

    def _check(self, data: bytes, index: int, shard: int, size: int) -> bytes:
        """The image bytes of sample ``index`` from ``data`` (its tar header, then its bytes),
        once the header names it: DatasetError for a shard cut short, swapped for another, or of
        another packing than the index."""
        url = self.index.url(shard)
        if len(data) != size + HEADER:
            raise DatasetError(
                f"sample {index} of {url}: {max(len(data) - HEADER, 0)} bytes where the index "
                f"says {size}; the shard changed or was cut after its index was written: write "
                "the shards again"
            )
        header = data[:HEADER]
        name = _field(header[_NAME])
        prefix = _field(header[_PREFIX])
        name = f"{prefix}/{name}" if prefix else name
        key = key_of(index)
        if name.rpartition(".")[0] != key:
            raise DatasetError(
                f"sample {index} of {url}: the tar header before its bytes names "
                f"{name[:40]!r}, not {key}.*, so the shard is not the one its index describes "
                "(a shard swapped or copied in from elsewhere, or an index of another "
                "packing); write the shards again, or copy the whole folder"
            )
        owner = _field(header[_UNAME])
        if self.index.packing is not None and owner != self.index.packing:
            raise DatasetError(
                f"sample {index} of {url} belongs to another packing ({owner or 'none'}) than "
                f"its index ({self.index.packing}): the shard was copied in from another "
                "packing of the images; write the shards again, or copy the whole folder"
            )
        return data[HEADER:]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = OrderedDict()


def _field(raw: bytes) -> str:
    """A NUL-terminated tar header field as text."""
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")
