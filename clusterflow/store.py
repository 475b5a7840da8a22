"""Checkpoint store over fsspec: a checkpoint exists only once it is committed.

Layout under the store root (``RUN_DIR/checkpoints`` by default, or any fsspec URL)::

    step-<N>/model.pt         plain state_dict (torch.load(..., weights_only=True) works without clusterflow)
    step-<N>/train_state.pt   optimizer, scheduler, scaler, counters, RNG states, pseudo-labels, ...
    step-<N>/manifest.json    written last: files, sizes, sha256, step, epoch, config hash, versions

Commit protocol: every file is written into ``.tmp-step-<N>-<random>/``, flushed and fsynced, the
manifest is written last, and the folder is renamed to ``step-<N>`` (atomic on a POSIX
filesystem; on object stores the manifest check below covers a partial copy). A reader trusts
only a step whose manifest lists files that exist with the recorded size and sha256; anything
else is skipped with a warning naming it, and the previous step is used.

The seam for sharded state (torch.distributed.checkpoint) is the ``files`` mapping: a sharded
writer would add one entry per rank's shard and the manifest would list them all; the commit
protocol stays the same.

A damaged committed step is never deleted: when the run reaches that step again it is renamed to
``damaged-step-<N>-<random>/`` (kept for inspection) and the step is written anew.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping

import fsspec

log = logging.getLogger("clusterflow.store")

MANIFEST = "manifest.json"
_STEP = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: str
    manifest: dict[str, Any]
    blobs: dict[str, bytes]

    def load(self, name: str) -> Any:
        """Deserialize one file with ``weights_only=True`` (no arbitrary code from disk)."""
        import torch

        return torch.load(io.BytesIO(self.blobs[name]), map_location="cpu", weights_only=True)


def serialize(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


_CHUNK = 16 << 20  # bytes per write/read: large enough to amortise, small enough to overlap


class _HashingWriter:
    """A file wrapper that hashes what it writes: each large buffer is hashed on a second thread
    while it is being written (hashlib and file writes both release the GIL).

    Every write waits for its own hash before returning, because torch.save reuses its buffers
    (hashing them later, after the write returned, gives a wrong digest).
    """

    def __init__(self, f: Any, pool: ThreadPoolExecutor) -> None:
        self.f, self.pool, self.sha, self.size = f, pool, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _CHUNK):
            part = view[start:start + _CHUNK]
            if len(part) < (1 << 20):
                self.sha.update(part)
                self.f.write(part)
                continue
            hashing = self.pool.submit(self.sha.update, part)
            self.f.write(part)
            hashing.result()
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self.f.flush()


def _read_into(f: Any, view: memoryview) -> int:
    data = f.read(len(view))
    view[: len(data)] = data
    return len(data)


def _versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        pass
    from clusterflow import __version__

    out["clusterflow"] = __version__
    return out


class CheckpointStore:
    def __init__(self, root: str, keep_last: int = 3, fsync: bool = True) -> None:
        if keep_last < 2:
            raise ValueError("keep_last must be >= 2")
        self.url = root
        self.fs, self.root = fsspec.core.url_to_fs(root)
        self.keep_last = keep_last
        self.fsync = fsync
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    # -- paths --------------------------------------------------------------------------------
    def _p(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def step_path(self, step: int) -> str:
        return self._p(f"step-{step}")

    def url_of(self, step: int) -> str:
        """The user-facing location (with protocol for non-local stores)."""
        path = self.step_path(step)
        return path if self.local else f"{self.fs.unstrip_protocol(path)}"

    # -- listing ------------------------------------------------------------------------------
    def _entries(self) -> list[str]:
        try:
            return [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []

    def steps(self) -> list[int]:
        """Steps whose folder carries a manifest, ascending (not yet verified)."""
        out = []
        for name in self._entries():
            m = _STEP.match(name)
            if m and self.fs.exists(self._p(name, MANIFEST)):
                out.append(int(m.group(1)))
        return sorted(out)

    # -- writing ------------------------------------------------------------------------------
    def _write(self, path: str, payload: Any) -> dict[str, Any]:
        """Write bytes, or stream ``torch.save(payload)``, hashing on the way; returns size and sha256."""
        with self.fs.open(path, "wb") as f, ThreadPoolExecutor(1) as pool:
            w = _HashingWriter(f, pool)
            if isinstance(payload, (bytes, bytearray, memoryview)):
                w.write(payload)
            else:
                import torch

                torch.save(payload, w)
            f.flush()
            if self.fsync and self.local:
                os.fsync(f.fileno())
        return {"size": w.size, "sha256": w.sha.hexdigest()}

    def _read(self, path: str, size: int) -> tuple[bytes, str]:
        """Read a whole file of known size; each chunk is hashed on a second thread while the next
        one is read (the buffer is never reused, so the hash may lag behind the reads)."""
        buf = bytearray(size)
        view = memoryview(buf)
        sha = hashlib.sha256()
        got = 0
        with self.fs.open(path, "rb") as f, ThreadPoolExecutor(1) as pool:
            pending = []
            while got < size:
                n = f.readinto(view[got:got + _CHUNK]) if hasattr(f, "readinto") else _read_into(f, view[got:got + _CHUNK])
                if not n:
                    break
                pending.append(pool.submit(sha.update, view[got:got + n]))
                got += n
            extra = f.read(1)  # a file that grew after the size check
            for p in pending:
                p.result()
        if got != size or extra:
            raise ValueError(f"{path.rsplit('/', 1)[-1]} changed size while being read")
        del view
        return bytes(buf), sha.hexdigest()

    def _fsync_dir(self, path: str) -> None:
        if self.fsync and self.local:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def save(self, step: int, files: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> str | None:
        """Commit ``files`` (name -> bytes, or an object to stream through ``torch.save``) as step ``step``. Returns the step path, or None when
        that step is already committed (a committed step is never overwritten)."""
        final = self.step_path(step)
        if self.fs.exists(self._p(f"step-{step}", MANIFEST)):
            try:
                self.verify(step)
            except ValueError as exc:
                # A run that resumed from an older step because this one was damaged reaches it again:
                # keep the damaged folder for inspection, out of the way, and commit the step anew.
                aside = self._p(f"damaged-step-{step}-{uuid.uuid4().hex[:8]}")
                log.warning("checkpoint %s is damaged (%s); moving it to %s and committing step %d anew",
                            self.url_of(step), exc, aside, step)
                self.fs.mv(final, aside, recursive=True)
            else:
                log.info("checkpoint step %d is already committed at %s; not overwriting it", step, final)
                return None
        self.fs.makedirs(self.root, exist_ok=True)
        tmp = self._p(f".tmp-step-{step}-{uuid.uuid4().hex[:8]}")
        self.fs.makedirs(tmp, exist_ok=True)
        listing = {name: self._write(f"{tmp}/{name}", payload) for name, payload in files.items()}
        manifest = {"step": step, **dict(meta or {}), "files": listing, "versions": _versions(), "committed_at": time.time()}
        self._write(f"{tmp}/{MANIFEST}", json.dumps(manifest, indent=1, sort_keys=True).encode())
        if self.local:
            self._fsync_dir(tmp)
            if os.path.exists(final):
                # A folder without a valid manifest: debris of an earlier crash, never a committed step.
                self.fs.rm(final, recursive=True)
            os.rename(tmp, final)  # atomic publish
            self._fsync_dir(self.root)
        else:
            if self.fs.exists(final):
                self.fs.rm(final, recursive=True)
            self.fs.mv(tmp, final, recursive=True)
        self.prune()
        return final

    def prune(self) -> None:
        """Keep the newest ``keep_last`` committed steps."""
        for step in self.steps()[: -self.keep_last]:
            self.fs.rm(self.step_path(step), recursive=True)

    def clean_debris(self) -> list[str]:
        """Remove temporary folders left by a writer that was killed (call before writing anew)."""
        removed = []
        for name in self._entries():
            if name.startswith(".tmp-step-"):
                self.fs.rm(self._p(name), recursive=True)
                removed.append(name)
        return removed

    # -- reading ------------------------------------------------------------------------------
    def verify(self, step: int) -> Checkpoint:
        """Read and check one step; raises ValueError naming what is wrong."""
        path = self.step_path(step)
        try:
            with self.fs.open(f"{path}/{MANIFEST}", "rb") as f:
                manifest = json.loads(f.read())
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"unreadable manifest ({exc.__class__.__name__})") from None
        blobs = {}
        for name, info in manifest.get("files", {}).items():
            try:
                if self.fs.size(f"{path}/{name}") != info["size"]:  # cheap check before reading it all
                    raise ValueError(f"{name} has {self.fs.size(f'{path}/{name}')} bytes, the manifest says {info['size']}")
                data, digest = self._read(f"{path}/{name}", info["size"])
            except FileNotFoundError:
                raise ValueError(f"{name} is missing") from None
            if len(data) != info["size"]:
                raise ValueError(f"{name} has {len(data)} bytes, the manifest says {info['size']}")
            if digest != info["sha256"]:
                raise ValueError(f"{name} does not match its sha256 (bit rot or a partial write)")
            blobs[name] = data
        return Checkpoint(step=step, path=self.url_of(step), manifest=manifest, blobs=blobs)

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint whose manifest verifies; damaged ones are skipped with a warning."""
        for step in reversed(self.steps()):
            try:
                return self.verify(step)
            except ValueError as exc:
                log.warning("skipping damaged checkpoint %s: %s; falling back to the previous one", self.url_of(step), exc)
        return None
