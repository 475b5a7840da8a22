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
import threading
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
    objects: dict[str, Any]  # each file, deserialized with weights_only=True while its hash was checked

    def load(self, name: str) -> Any:
        return self.objects[name]


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


class _TailHasher:
    """sha256 of a file that another object is appending to, computed on a thread that reads the
    file back (from the page cache) up to the length written so far."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.sha = hashlib.sha256()
        self.written, self.closed, self.error = 0, False, None
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def advance(self, n: int) -> None:
        with self.cond:
            self.written += n
            self.cond.notify()

    def digest(self) -> str:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.sha.hexdigest()

    def _run(self) -> None:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        offset = 0
        try:
            while True:
                with self.cond:
                    while offset >= self.written and not self.closed:
                        self.cond.wait()
                    target, closed = self.written, self.closed
                if offset >= target and closed:
                    return
                while offset < target:
                    n = os.preadv(self.fd, [view[: min(_CHUNK, target - offset)]], offset)
                    if n <= 0:
                        raise OSError(f"short read at byte {offset} while hashing a checkpoint file")
                    self.sha.update(view[:n])  # releases the GIL
                    offset += n
        except BaseException as exc:  # noqa: BLE001 - re-raised by digest()
            self.error = exc

    def __enter__(self) -> "_TailHasher":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.thread.is_alive():  # an error in the writer: stop the reader before closing its fd
            with self.cond:
                self.closed = True
                self.written = -1
                self.cond.notify()
            self.thread.join()
        os.close(self.fd)


class _AppendOnly:
    """An unbuffered file seen by torch.save: every byte reaches the kernel before write returns
    (so the tail hasher may read it), partial writes are retried, and the length is counted."""

    def __init__(self, f: Any, tail: _TailHasher) -> None:
        self.f, self.tail, self.size = f, tail, 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += self.f.write(view[done:])
        self.size += done
        self.tail.advance(done)
        return done

    def flush(self) -> None:
        pass


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
        self._pruning: threading.Thread | None = None

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
        """Write bytes, or ``torch.save(payload)``, durably; returns the size and sha256 written."""
        import torch

        raw = isinstance(payload, (bytes, bytearray, memoryview))
        if not self.local:
            # Object stores: hash while streaming (reading back would download it again).
            with self.fs.open(path, "wb") as f, ThreadPoolExecutor(1) as pool:
                w = _HashingWriter(f, pool)
                w.write(payload) if raw else torch.save(payload, w)
            return {"size": w.size, "sha256": w.sha.hexdigest()}
        # The file is hashed from a second descriptor as it grows (a thread reading back what the
        # kernel already holds), so the sha256 runs beside torch.save and then beside the fsync
        # instead of after them. torch.save only ever appends through ``write``.
        with open(path, "wb", buffering=0) as f, _TailHasher(path) as tail, ThreadPoolExecutor(1) as pool:
            w = _AppendOnly(f, tail)
            w.write(payload) if raw else torch.save(payload, w)
            syncing = pool.submit(os.fsync, f.fileno()) if self.fsync else None
            digest = tail.digest()
            if syncing is not None:
                syncing.result()
        return {"size": w.size, "sha256": digest}

    @staticmethod
    def _hash_local(path: str) -> str:
        sha = hashlib.sha256()
        fd = os.open(path, os.O_RDONLY)
        try:
            buf = bytearray(_CHUNK)
            view = memoryview(buf)
            while n := os.readv(fd, [buf]):
                sha.update(view[:n])  # releases the GIL: runs beside the unpickling
        finally:
            os.close(fd)
        return sha.hexdigest()

    def _load_checked(self, name: str, path: str, info: Mapping[str, Any]) -> Any:
        """Deserialize one file while a second thread checks its sha256; raises ValueError if damaged."""
        import torch

        with ThreadPoolExecutor(1) as pool:
            if self.local:  # both read the file from the page cache: no copy of it in memory
                hashing = pool.submit(self._hash_local, path)
                source: Any = path
            else:  # download once; hash and unpickle the same bytes
                with self.fs.open(path, "rb") as f:
                    data = f.read()
                hashing = pool.submit(lambda: hashlib.sha256(data).hexdigest())
                source = io.BytesIO(data)
            loaded, failure = None, None
            try:
                loaded = torch.load(source, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - judged below, once the hash says whether the bytes are intact
                failure = exc
            digest = hashing.result()
        if digest != info["sha256"]:
            raise ValueError(f"{name} does not match its sha256 (bit rot or a partial write)")
        if failure is not None:
            raise ValueError(f"{name} is intact but cannot be loaded ({type(failure).__name__}: {failure})")
        return loaded

    def _fsync_dir(self, path: str) -> None:
        if self.fsync and self.local:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def save(self, step: int, files: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> str | None:
        """Commit ``files`` (name -> bytes, or an object to stream through ``torch.save``) as step
        ``step``. Returns the step path, or None when that step is already committed (a committed
        step is never overwritten)."""
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

    def damaged(self) -> list[str]:
        """Folders of steps that failed verification and were set aside (``damaged-step-<N>-*``)."""
        return sorted(self._p(name) for name in self._entries() if name.startswith("damaged-step-"))

    def prune(self) -> None:
        """Keep the newest ``keep_last`` committed steps.

        Locally an old step is renamed to ``.tmp-step-N-pruned-*`` (atomic: it stops being a
        checkpoint at once) and deleted on a background thread, off the training loop's path;
        a deletion cut short by the process ending is finished by the next ``clean_debris``.
        """
        self.wait_for_pruning()
        doomed = []
        for step in self.steps()[: -self.keep_last]:
            if not self.local:
                self.fs.rm(self.step_path(step), recursive=True)
                continue
            aside = self._p(f".tmp-step-{step}-pruned-{uuid.uuid4().hex[:8]}")
            os.rename(self.step_path(step), aside)
            doomed.append(aside)
        if doomed:
            import shutil

            self._pruning = threading.Thread(target=lambda: [shutil.rmtree(d, ignore_errors=True) for d in doomed], daemon=True)
            self._pruning.start()

    def wait_for_pruning(self) -> None:
        if self._pruning is not None:
            self._pruning.join()
            self._pruning = None

    def clean_debris(self) -> list[str]:
        """Remove temporary folders left by a writer that was killed (call before writing anew)."""
        self.wait_for_pruning()
        removed = []
        for name in self._entries():
            if name.startswith(".tmp-step-"):
                try:
                    self.fs.rm(self._p(name), recursive=True)
                except FileNotFoundError:
                    continue
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
        objects = {}
        for name, info in manifest.get("files", {}).items():
            file = f"{path}/{name}"
            try:
                size = self.fs.size(file)
            except FileNotFoundError:
                raise ValueError(f"{name} is missing") from None
            if size != info["size"]:
                raise ValueError(f"{name} has {size} bytes, the manifest says {info['size']}")
            objects[name] = self._load_checked(name, file, info)
        return Checkpoint(step=step, path=self.url_of(step), manifest=manifest, objects=objects)

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint whose manifest verifies; damaged ones are skipped with a warning."""
        for step in reversed(self.steps()):
            try:
                return self.verify(step)
            except ValueError as exc:
                log.warning("skipping damaged checkpoint %s: %s; falling back to the previous one", self.url_of(step), exc)
        return None
