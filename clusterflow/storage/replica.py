"""Replicas of a rank's snapshots on another node, over a plain TCP connection.

Each rank that takes snapshots runs a :class:`Receiver` (a listening socket and a thread) and,
after committing a snapshot into its own node's memory, :func:`send`\\ s it to its peer, a rank
on another node, which commits it as a ``replica-`` folder of its node
(``snapshots.py``). A connection carries one snapshot:

    8 bytes   the header's length (big-endian)
    header    JSON: the run's token, whose snapshot (attempt, rank, world size), its step, its
              manifest's fields, and each file's size and digest
    files     each file's bytes, in the header's order
    <- reply  one line from the receiver: ``ok`` or ``error: WHY``

The receiver stages the files as the store stages any save, hashes them while they arrive, and
commits the replica (manifest last, then the rename) only when every file has all its bytes and
its digest; a sender that dies while sending, a flipped bit, a header that lies or a stranger
without the run's token leave no replica, and one log line says why. Why TCP and not the process
group: a peer that dies mid-send ends one connection (the receiver sees it at once), never a
collective that the training's own group depends on; and a receiver needs no agreement on when
to receive. No torch here.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Mapping
from typing import Any

from clusterflow.storage import durable
from clusterflow.storage import manifest as schema
from clusterflow.storage.names import MANIFEST
from clusterflow.storage.snapshots import REPLICA, Key, NodeSnapshots

log = logging.getLogger("clusterflow.snapshots")

_HEADER_MAX = 1 << 20  # a header is a manifest's worth of JSON
_CHUNK = 4 << 20
# Fields of a committed manifest that the receiver's store writes itself.
_OWN_FIELDS = ("files", "versions", "committed_at", "step")


class ReplicaError(Exception):
    """A replica was not sent or not kept; the message says why."""


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        part = conn.recv(min(_CHUNK, n - len(data)))
        if not part:
            raise ReplicaError(f"connection closed after {len(data)} of {n} bytes")
        data += part
    return bytes(data)


def send(
    address: tuple[str, int],
    token: str,
    key: Key,
    step: int,
    folder: str,
    timeout_s: float = 60.0,
) -> None:
    """Send the committed snapshot in ``folder`` (rank ``key.rank``'s, of ``step``) to the
    receiver at ``address``; returns once the peer has committed it. ReplicaError (or OSError)
    when it was not."""
    with open(os.path.join(folder, MANIFEST), "rb") as f:
        manifest = json.loads(f.read())
    files = manifest["files"]
    header = json.dumps(
        {
            "token": token,
            "attempt": key.attempt,
            "rank": key.rank,
            "world": key.world,
            "step": step,
            "meta": {k: v for k, v in manifest.items() if k not in _OWN_FIELDS},
            "files": files,
        }
    ).encode()
    with socket.create_connection(address, timeout=timeout_s) as conn:
        conn.sendall(struct.pack(">Q", len(header)) + header)
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                conn.sendfile(f)
        reply = conn.makefile("rb").readline(4096).decode(errors="replace").strip()
    if reply != "ok":
        raise ReplicaError(reply or "the receiver closed the connection without a reply")


class Receiver:
    """Accepts replicas for this node's memory folder (``snapshots``), from senders that know
    ``token``; one thread per connection. ``address``: (host, port) for the peers."""

    def __init__(self, snapshots: NodeSnapshots, token: str, host: str, timeout_s: float = 60.0):
        self.snapshots, self.token, self.timeout_s = snapshots, token, timeout_s
        self._server = socket.create_server(("", 0), backlog=16)
        self.address = (host, self._server.getsockname()[1])
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="snapshot-replicas", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        try:
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._server.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(conn, peer[0]), name="snapshot-replica", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        with conn:
            conn.settimeout(self.timeout_s)
            try:
                self.receive(conn, peer)
                reply = "ok"
            except (ReplicaError, ValueError, OSError) as exc:
                reply = f"error: {exc}"
            try:
                conn.sendall(reply.encode() + b"\n")
            except OSError:
                pass

    def receive(self, conn: socket.socket, peer: str) -> None:
        """One replica from ``conn``: committed, or ReplicaError/ValueError naming why not (and a
        log line saying it, when the connection came from the run)."""
        (length,) = struct.unpack(">Q", _recv_exactly(conn, 8))
        if length > _HEADER_MAX:
            raise ReplicaError(f"a header of {length} bytes is not a snapshot's")
        head = json.loads(_recv_exactly(conn, length))
        if not isinstance(head, dict) or head.get("token") != self.token:
            raise ReplicaError("not a sender of this run")
        key, step, meta, files = _parse(head)
        store = self.snapshots.store(key)
        folder = store.begin(step, meta)
        if folder is None:  # this step is here already
            return
        try:
            listed = {name: _receive_file(conn, folder, name, info) for name, info in files.items()}
            store.commit(folder, step, {}, listed, meta)
        except BaseException as exc:
            store.abandon(folder)
            log.warning(
                "replica of rank %d's snapshot of step %d from %s not kept: %s",
                key.rank,
                step,
                peer,
                exc,
            )
            raise


def _parse(head: Mapping[str, Any]) -> tuple[Key, int, dict[str, Any], dict[str, Any]]:
    """The header's parts, each checked: ValueError naming the first that does not fit."""
    ints = [head.get(k) for k in ("attempt", "rank", "world", "step")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
        raise ValueError(f"the header's attempt, rank, world and step are not counts: {ints}")
    attempt, rank, world, step = ints
    if rank >= world:
        raise ValueError(f"rank {rank} of {world} ranks")
    meta = head.get("meta")
    if not isinstance(meta, dict) or any(k in meta for k in _OWN_FIELDS):
        raise ValueError("the header's manifest fields are not a mapping of its own fields")
    files = head.get("files")
    schema.check({**meta, "files": files, "step": step}, step)
    return Key(REPLICA, attempt, rank, world), step, meta, dict(files)


def _receive_file(
    conn: socket.socket, folder: str, name: str, info: Mapping[str, Any]
) -> dict[str, Any]:
    """Stream ``info["size"]`` bytes of ``conn`` into ``folder/name``, hashed as they come;
    ReplicaError unless they match the digest the sender recorded."""
    algorithm, expected = durable.recorded_digest(info)
    _, h = durable.new_hash(algorithm)
    size, left = int(info["size"]), int(info["size"])
    with open(os.path.join(folder, name), "wb") as f:
        while left:
            part = conn.recv(min(_CHUNK, left))
            if not part:
                raise ReplicaError(
                    f"connection closed after {size - left} of {size} bytes of {name} "
                    "(the sender died while sending?)"
                )
            h.update(part)
            f.write(part)
            left -= len(part)
    if h.hexdigest() != expected:
        raise ReplicaError(f"{name} arrived with another {algorithm} digest than it was sent with")
    return {"size": size, algorithm: expected}
