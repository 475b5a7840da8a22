"""Durable writes, one way for the whole package: streamed, hashed, fsynced, placed atomically.

- :func:`write_file`: bytes, text, or an object streamed through a :class:`Codec` (torch's,
  from ``tensors.py``), written and fsynced, with its digest computed beside the write (the
  checkpoint store's files).
- :func:`write_atomic`: a local file that readers see whole or not at all (``status.json``,
  ``config.yaml``, the final ``model.pt``): written as a hidden sibling with :func:`write_file`,
  then renamed over the target.
- :func:`publish_once`: a local file created once, complete, by whoever comes first (the
  attempt's first cause, a lease generation): the loser learns that it lost.
- :func:`load_checked`: a codec's load of a file while its digest is checked beside it.
- ``private=True`` (:func:`open_new`): a local file created by the call, never through a link,
  mode 0600 whatever the umask (snapshots in a node's shared memory, ``private.py``).

Digests: new files get BLAKE3 (the ``blake3`` package: SIMD on one core, about 2-3x sha256 here,
and multi-threaded where a load waits for it); a record names its algorithm by its key
(``{"size": N, "blake3": HEX}``), so records of older versions (``"sha256"``) still verify.
Without the package, new files fall back to sha256.

No torch here: the login side writes its records through this module. Objects (state dicts)
reach a file only through the codec the job side passes (``storage.tensors.TORCH``).
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Protocol

from clusterflow.storage import diskfull
from clusterflow.storage.private import FILE_MODE

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

_CHUNK = 16 << 20  # bytes per write/read: large enough to amortise, small enough to overlap
# The algorithms a record may name; new files get the first one available.
HASHES = ("blake3", "sha256")

# What a write appends: raw payloads are bytes; torch.save hands memoryviews of its buffers.
Chunk = bytes | bytearray | memoryview


class Hasher(Protocol):
    """hashlib's sha256 and blake3's hasher alike."""

    def update(self, data: Chunk, /) -> object: ...

    def hexdigest(self) -> str: ...


class Sink(Protocol):
    """What a codec's ``dump`` writes into: it only appends, through ``write``."""

    def write(self, data: Chunk, /) -> int: ...

    def flush(self) -> None: ...


def new_hash(algorithm: str | None = None, threads: bool = False) -> tuple[str, Hasher]:
    """(name, hasher) for new files (``algorithm=None``) or for checking a record. ``threads``:
    BLAKE3 on every core, for a reader that waits for the digest (while writing, one core hashes
    beside the writer and leaves the others to the training loop)."""
    if algorithm in (None, "blake3"):
        try:
            import blake3
        except ImportError:
            if algorithm:
                raise ValueError(
                    "this checkpoint is hashed with blake3 and the blake3 package is missing; "
                    "pip install blake3"
                ) from None
            return "sha256", hashlib.sha256()
        return "blake3", blake3.blake3(max_threads=blake3.blake3.AUTO if threads else 1)
    if algorithm == "sha256":
        return "sha256", hashlib.sha256()
    raise ValueError(
        f"unknown hash algorithm {algorithm!r}; this version knows {', '.join(HASHES)}"
    )


def recorded_digest(info: Mapping[str, Any]) -> tuple[str, str]:
    """(algorithm, hex digest) a file record names."""
    for algorithm in HASHES:
        if algorithm in info:
            return algorithm, info[algorithm]
    raise ValueError(
        f"the record names no hash this version knows ({', '.join(HASHES)}): {sorted(info)}"
    )


@dataclass(frozen=True)
class Codec:
    """How an object becomes a file's bytes and back: ``dump(obj, binary_file)`` only appends
    through ``write``; ``load(path_or_binary_file)``. ``versions``: the software that wrote the
    file, for the checkpoint's manifest."""

    dump: Callable[[object, Sink], None]
    # Returns what the file holds (a nested state of tensors), inspected by its reader.
    load: Callable[[str | IO[bytes]], Any]
    versions: Mapping[str, str] = field(default_factory=dict)


def _dumper(payload: object, codec: Codec | None) -> Callable[[object, Sink], None]:
    if codec is None:
        raise TypeError(
            f"a {type(payload).__name__} is written through a codec (storage.tensors.TORCH); "
            "without one only bytes and text"
        )
    return codec.dump


class _HashingWriter:
    """A file wrapper that hashes what it writes: each large buffer is hashed on a second thread
    while it is being written (hashlib and file writes both release the GIL).

    Every write waits for its own hash before returning, because torch.save reuses its buffers
    (hashing them later, after the write returned, gives a wrong digest).
    """

    def __init__(self, f: IO[bytes], pool: ThreadPoolExecutor) -> None:
        self.f, self.pool, self.size = f, pool, 0
        self.algorithm, self.sha = new_hash()

    def write(self, data: Chunk) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _CHUNK):
            part = view[start : start + _CHUNK]
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
    """The digest of a file that another object is appending to, computed on a thread that reads
    the file back (from the page cache) up to the length written so far."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.algorithm, self.sha = new_hash()
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
                        raise OSError(
                            f"short read at byte {offset} while hashing a checkpoint file"
                        )
                    self.sha.update(view[:n])  # releases the GIL
                    offset += n
        except BaseException as exc:  # noqa: BLE001 - re-raised by digest()
            self.error = exc

    def __enter__(self) -> _TailHasher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
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

    def __init__(self, f: io.FileIO, tail: _TailHasher) -> None:
        self.f, self.tail, self.size = f, tail, 0

    def write(self, data: Chunk) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += self.f.write(view[done:])
        self.size += done
        self.tail.advance(done)
        return done

    def flush(self) -> None:
        pass


class _Spill:
    """What a codec's dump writes into: memory until the dump outgrows one chunk, then the file
    (:class:`_AppendOnly`, hashed as it grows). A small file (a snapshot's state, a small model)
    is then written and hashed in one call each, without the threads a streamed one needs, and
    a large one never sits in memory whole. ``stack`` closes what the spill opened."""

    def __init__(self, path: str, stack: ExitStack, private: bool) -> None:
        self.path, self.stack, self.private = path, stack, private
        self.held = bytearray()  # what was written while the file is not open yet
        self.file: _AppendOnly | None = None

    @property
    def size(self) -> int:
        return len(self.held) if self.file is None else self.file.size

    def write(self, data: Chunk) -> int:
        view = memoryview(data).cast("B")
        if self.file is None and len(self.held) + len(view) < _CHUNK:
            self.held += view  # a copy: torch.save reuses its buffers
            return len(view)
        if self.file is None:
            # Closed by the stack, after the hasher that reads it back.
            f = self.stack.enter_context(open_new(self.path, self.private, buffering=0))
            self.file = _AppendOnly(f, self.stack.enter_context(_TailHasher(self.path)))
            self.file.write(self.held)
            self.held = bytearray()
        return self.file.write(view)

    def flush(self) -> None:
        pass


def open_new(path: str, private: bool = False, buffering: int = -1) -> IO[bytes]:
    """The local file ``path``, opened for writing in binary. ``private``: created by this call
    (``O_EXCL``, never through a link) with mode 0600 set explicitly, whatever the umask: only
    this user reads it (a snapshot in a node's shared memory, ``private.py``)."""
    if not private:
        return open(path, "wb", buffering=buffering)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        return open(fd, "wb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def _write_whole(path: str, payload: Chunk, fsync: bool, private: bool) -> dict[str, Any]:
    """A payload smaller than a chunk: one write, one hash, no threads."""
    with open_new(path, private) as f:
        f.write(payload)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    algorithm, h = new_hash()
    h.update(payload)
    return {"size": len(payload), algorithm: h.hexdigest()}


def write_file(
    path: str,
    payload: object,
    fsync: bool = True,
    fs: AbstractFileSystem | None = None,
    codec: Codec | None = None,
    *,
    private: bool = False,
) -> dict[str, Any]:
    """Write ``payload`` (bytes, str, or any object ``codec`` dumps) to ``path``; returns the
    record ``{"size": N, ALGORITHM: HEX}``. ``fs``: the fsspec filesystem of a remote path, None
    for a local one. ``private``: a local file created here with mode 0600 (:func:`open_new`)."""
    if isinstance(payload, str):
        payload = payload.encode()
    raw = isinstance(payload, (bytes, bytearray, memoryview))
    dump = None if raw else _dumper(payload, codec)
    if fs is not None:
        # Object stores: hash while streaming (reading back would download it again).
        with fs.open(path, "wb") as f, ThreadPoolExecutor(1) as pool:
            w = _HashingWriter(f, pool)
            w.write(payload) if raw else dump(payload, w)
        return {"size": w.size, w.algorithm: w.sha.hexdigest()}
    if raw and len(payload) < _CHUNK:  # small records (status, manifests)
        return _write_whole(path, payload, fsync, private)
    # A large file is hashed from a second descriptor as it grows (a thread reading back what the
    # kernel already holds), so the hash runs beside the codec's dump and then beside the fsync
    # instead of after them. A dump only ever appends through ``write``.
    with ExitStack() as stack:
        sink = _Spill(path, stack, private)
        sink.write(payload) if raw else dump(payload, sink)
        if sink.file is None:
            return _write_whole(path, sink.held, fsync, private)
        pool = stack.enter_context(ThreadPoolExecutor(1))
        syncing = pool.submit(os.fsync, sink.file.f.fileno()) if fsync else None
        digest = sink.file.tail.digest()
        if syncing is not None:
            syncing.result()
    return {"size": sink.size, sink.file.tail.algorithm: digest}


def write_atomic(
    target: str,
    payload: object,
    fsync: bool = True,
    make_folder: bool = True,
    codec: Codec | None = None,
) -> dict[str, Any]:
    """Replace the local file ``target`` so that readers see the old or the new content, never
    half of it. The temporary sibling is hidden (``.tmp-<name>-<random>``) and removed on error.
    ``make_folder=False``: fail (FileNotFoundError) rather than recreate a folder that was moved or
    deleted under a periodic writer (heartbeats must not resurrect a run dir the user moved)."""
    folder = os.path.dirname(target) or "."
    if make_folder:
        os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".tmp-{os.path.basename(target)}-{uuid.uuid4().hex[:8]}")
    try:
        info = write_file(tmp, payload, fsync, codec=codec)
        os.replace(tmp, target)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        diskfull.raise_if_full(
            exc, os.path.basename(target), target, diskfull.payload_bytes(payload)
        )
        raise
    if fsync:
        fsync_dir(folder)
    return info


def publish_once(target: str, payload: str | bytes, private: bool = False) -> bool:
    """Create the local file ``target`` holding ``payload`` unless it exists; True when this call
    created it. The content is written complete and fsynced to a private sibling first, then
    published with ``os.link``, which fails with EEXIST when the name is taken: ``link`` is
    atomic on local filesystems and on NFS (v2 and later; ``O_EXCL`` creation is exclusive only
    from NFSv3), and a reader never sees a half-written file. A filesystem without hard links
    (some FUSE mounts) gets an exclusive create instead. ``private``: mode 0600."""
    data = payload.encode() if isinstance(payload, str) else payload
    tmp = os.path.join(
        os.path.dirname(target) or ".", f".tmp-{os.path.basename(target)}-{uuid.uuid4().hex[:8]}"
    )
    write_file(tmp, data, private=private)
    try:
        os.link(tmp, target)
        return True
    except FileExistsError:
        return False
    except OSError:
        return _create_exclusive(target, data, FILE_MODE if private else 0o644)
    finally:
        os.unlink(tmp)


def _create_exclusive(target: str, data: bytes, mode: int) -> bool:
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return True


def fsync_dir(path: str) -> None:
    """Make renames inside a local folder durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hash_file(path: str, algorithm: str, fs: AbstractFileSystem | None = None) -> str:
    _, sha = new_hash(algorithm, threads=True)
    if fs is not None:
        with fs.open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                sha.update(chunk)
        return sha.hexdigest()
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := os.readv(fd, [buf]):
            sha.update(view[:n])  # releases the GIL: runs beside the unpickling
    finally:
        os.close(fd)
    return sha.hexdigest()


def load_checked(
    name: str,
    path: str,
    info: Mapping[str, Any],
    codec: Codec,
    fs: AbstractFileSystem | None = None,
) -> Any:
    """``codec.load`` one file (what it holds) while a second thread checks its digest; raises
    ValueError if damaged."""
    algorithm, expected = recorded_digest(info)
    with ThreadPoolExecutor(1) as pool:
        if fs is None:  # both read the file from the page cache: no copy of it in memory
            hashing = pool.submit(hash_file, path, algorithm)
            source: str | IO[bytes] = path
        else:  # download once; hash and unpickle the same bytes
            with fs.open(path, "rb") as f:
                data = f.read()
            hashing = pool.submit(_digest, data, algorithm)
            source = io.BytesIO(data)
        loaded, failure = None, None
        try:
            loaded = codec.load(source)
        except Exception as exc:  # noqa: BLE001
            failure = exc  # judged below, once the hash says whether the bytes are intact
        digest = hashing.result()
    if digest != expected:
        raise ValueError(
            f"{name} does not match its {algorithm} digest (bit rot or a partial write)"
        )
    if failure is not None:
        raise ValueError(
            f"{name} is intact but cannot be loaded ({type(failure).__name__}: {failure})"
        )
    return loaded


def _digest(data: bytes, algorithm: str) -> str:
    _, h = new_hash(algorithm, threads=True)
    h.update(data)
    return h.hexdigest()
