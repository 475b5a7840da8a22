"""What each rank is about to train: ``RUN_DIR/inflight/rank<R>.bin``, rewritten in place before
each batch, so that after a crash the step it died on and the samples of that step's batch are
known, even when nothing could be written at the crash (a segfault in a dataset's native code,
an abort, a SIGKILL).

The loop asks the epoch plan for a micro-batch; before the batch is fetched (a DataLoader
without workers fetches it in the rank, where a poisoned sample crashes it) the rank writes one
record with a single ``pwrite`` at offset 0 of a file it keeps open: a few microseconds, no
fsync, no new file. The page cache holds the bytes when the process dies, whatever killed it, so
the batch step's driver reads them after the step ended (``tries.py``). A node that dies whole
may take its last bytes with it: the record is then an older one, or absent, and the step is
said to be unknown.

A record (little-endian): ``MAGIC``, then the attempt, the step (1-based: the optimizer step the
batch belongs to), the epoch, the micro-batch within the step, the newest step this rank
committed into its node's memory (``checkpoint.memory_every_steps``; -1: none), the count of
indices, and the indices (int64 each): this rank's slice of the micro-batch, as the epoch plan
cut it (``distributed/sampler.py``). A stream (an ``IterableDataset``) has no indices: count 0.
"""

from __future__ import annotations

import array
import os
import struct
import threading
from collections.abc import Sequence
from typing import Any

from clusterflow.rundir.paths import RunPaths
from clusterflow.storage import confined

MAGIC = b"cfinfl1\0"
_HEAD = struct.Struct("<8sqqqqqq")
# The snapshot field, rewritten alone by the snapshot thread: after the magic and four fields.
_SNAPSHOT, _SNAPSHOT_AT = struct.Struct("<q"), 8 + 4 * 8
# A rank's slice of one micro-batch: a few thousand indices at most in practice.
_LIMIT = 64 * 2**20


class InFlight:
    """``InFlight(paths, rank, attempt).note(step, epoch, micro, indices)`` before each batch.

    ``snapshot`` is the newest step this rank committed into its node's memory, as the snapshot
    thread last said (:meth:`committed`, which writes it into the record at once: a crash right
    after a commit must not hide the progress). A write that fails (a full disk, a run dir gone)
    turns the record off for the attempt: it is a hint, never a reason to stop training."""

    def __init__(self, paths: RunPaths, rank: int, attempt: int) -> None:
        self.attempt, self.snapshot = attempt, -1
        self._lock = threading.Lock()  # the loop's note and the snapshot thread's field
        self._written = False  # a record is in the file: the field has its place
        self._fd: int | None = None
        try:
            os.makedirs(paths.inflight, exist_ok=True)
            self._fd = os.open(
                paths.inflight_file(rank),
                os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o644,
            )
        except OSError:
            self._fd = None

    def committed(self, step: int) -> None:
        """The snapshot thread: this rank's share of ``step`` is committed in its node's
        memory; the record says so now (one 8-byte ``pwrite``)."""
        with self._lock:
            self.snapshot = max(self.snapshot, step)
            if self._fd is None or not self._written:
                return
            try:
                os.pwrite(self._fd, _SNAPSHOT.pack(self.snapshot), _SNAPSHOT_AT)
            except OSError:
                self._close()

    def note(self, step: int, epoch: int, micro: int, indices: Sequence[int] | None) -> None:
        if self._fd is None:
            return
        body = array.array("q", indices).tobytes() if indices is not None else b""
        with self._lock:
            head = _HEAD.pack(
                MAGIC, self.attempt, step, epoch, micro, self.snapshot, len(body) // 8
            )
            try:
                os.pwrite(self._fd, head + body, 0)
                self._written = True
            except OSError:
                self._close()

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:
                pass


def parse(data: bytes) -> dict[str, Any] | None:
    """A record's fields (attempt, step, epoch, micro, snapshot, indices), or None for bytes that
    are no record (empty, cut short, another file). Pure."""
    if len(data) < _HEAD.size:
        return None
    magic, attempt, step, epoch, micro, snapshot, n = _HEAD.unpack_from(data)
    if magic != MAGIC or n < 0 or len(data) < _HEAD.size + 8 * n:
        return None
    indices = array.array("q")
    indices.frombytes(data[_HEAD.size : _HEAD.size + 8 * n])
    return {
        "attempt": attempt,
        "step": step,
        "epoch": epoch,
        "micro": micro,
        "snapshot": snapshot,
        "indices": indices.tolist(),
    }


def read(paths: RunPaths, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s latest record, whichever attempt wrote it; None when there is none (or it
    is unreadable: a link, a FIFO, garbage)."""
    try:
        data = confined.read_bytes(paths.inflight_file(rank), within=paths.root, limit=_LIMIT)
    except OSError:
        return None
    return parse(data)


def read_attempt(paths: RunPaths, attempt: int, world_size: int) -> dict[int, dict[str, Any]]:
    """The records attempt ``attempt`` left, by rank (ranks below ``world_size`` whose record is
    that attempt's)."""
    out = {}
    for rank in range(world_size):
        rec = read(paths, rank)
        if rec is not None and rec["attempt"] == attempt:
            out[rank] = rec
    return out
