"""Replicas of a rank's snapshots on another node, over a plain TCP connection.

Each rank that takes snapshots runs a :class:`Receiver` (a listening socket and a thread) and,
after committing a snapshot into its own node's memory, :func:`send`\\ s it to its peer, a rank
on another node, which commits it as a ``replica-`` folder of its node
(``snapshots.py``). A connection carries one snapshot:

    token     the run's token (its length is the receiver's token's)
    8 bytes   the header's length (big-endian)
    header    JSON: whose snapshot (attempt, rank, world size), its step, its manifest's
              fields, and each file's size and digest
    files     each file's bytes, in the header's order
    <- reply  one line from the receiver: ``ok`` or ``error: WHY``

The receiver stages the files as the store stages any save, hashes them while they arrive, and
commits the replica (manifest last, then the rename) only when every file has all its bytes and
its digest; a sender that dies while sending, a flipped bit, a header that lies or a stranger
without the run's token leave no replica, and one log line says why. Why TCP and not the process
group: a peer that dies mid-send ends one connection (the receiver sees it at once), never a
collective that the training's own group depends on; and a receiver needs no agreement on when
to receive. No torch here.

A rank's port is open to the cluster's network, and a node to other users, so the receiver
gives a stranger nothing: it listens on the one address its peers reach it at (not every
interface); a connection from any address but its senders' (each sender connects from the
address it gave the run), or beyond a few at once (``SPARE`` more than its senders), is closed
as it is accepted, with no thread; the token is read first, within ``TOKEN_TIMEOUT_S``, into a
buffer of its length, and only a connection that sent it gets the rest: the header read, the
interpreter's switch interval lowered for the write (``gil.py``), a folder of the store.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from clusterflow.storage import durable, gil
from clusterflow.storage import manifest as schema
from clusterflow.storage.names import MANIFEST
from clusterflow.storage.snapshots import REPLICA, Key, NodeSnapshots

log = logging.getLogger("clusterflow.snapshots")

_HEADER_MAX = 1 << 20  # a header is a manifest's worth of JSON
_CHUNK = 4 << 20
# Seconds a connection has to send the token: a sender writes it as soon as it is connected.
TOKEN_TIMEOUT_S = 5.0
# Connections served at once beyond one per sender (a sender's retry after a broken connection).
SPARE = 2
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
    *,
    timeout_s: float = 60.0,
    source: str | None = None,
) -> None:
    """Send the committed snapshot in ``folder`` (rank ``key.rank``'s, of ``step``) to the
    receiver at ``address``, from the address ``source`` (the one this rank gave the run: the
    receiver admits no other); returns once the peer has committed it. ReplicaError (or OSError)
    when it was not."""
    with open(os.path.join(folder, MANIFEST), "rb") as f:
        manifest = json.loads(f.read())
    files = manifest["files"]
    header = json.dumps(
        {
            "attempt": key.attempt,
            "rank": key.rank,
            "world": key.world,
            "step": step,
            "meta": {k: v for k, v in manifest.items() if k not in _OWN_FIELDS},
            "files": files,
        }
    ).encode()
    bind = (source, 0) if source else None
    with socket.create_connection(address, timeout=timeout_s, source_address=bind) as conn:
        conn.sendall(token.encode() + struct.pack(">Q", len(header)) + header)
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                conn.sendfile(f)
        reply = conn.makefile("rb").readline(4096).decode(errors="replace").strip()
    if reply != "ok":
        raise ReplicaError(reply or "the receiver closed the connection without a reply")


class Receiver:
    """Accepts replicas for this node's memory folder (``snapshots``) from ``senders`` (the
    addresses of the ranks whose peer this rank is, one per rank; :meth:`admit`), that know
    ``token``: one thread per connection, at most ``SPARE`` more than there are senders.
    ``address``: (host, port), where the peers reach it; it listens on ``host`` only."""

    def __init__(
        self,
        snapshots: NodeSnapshots,
        token: str,
        host: str,
        timeout_s: float = 60.0,
        senders: Sequence[str] = (),
    ):
        self.snapshots, self.token, self.timeout_s = snapshots, token.encode(), timeout_s
        self._server = socket.create_server((host, 0), backlog=16)
        self.address = (host, self._server.getsockname()[1])
        self._closed = False
        self._lock = threading.Lock()  # the count of connections served, nothing else
        self._serving = 0
        self.admit(senders)
        self._thread = threading.Thread(target=self._accept, name="snapshot-replicas", daemon=True)
        self._thread.start()

    def admit(self, senders: Sequence[str]) -> None:
        """Accept connections from ``senders`` (an address per sending rank) only."""
        self._senders = frozenset(senders)
        self._most = len(senders) + SPARE

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
            if peer[0] not in self._senders or not self._take_slot():
                conn.close()
                continue
            try:
                threading.Thread(
                    target=self._serve, args=(conn, peer[0]), name="snapshot-replica", daemon=True
                ).start()
            except RuntimeError:  # no thread to be had: this connection is not served
                conn.close()
                self._give_slot()

    def _take_slot(self) -> bool:
        with self._lock:
            if self._serving >= self._most:
                return False
            self._serving += 1
            return True

    def _give_slot(self) -> None:
        with self._lock:
            self._serving -= 1

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            with conn:
                conn.settimeout(TOKEN_TIMEOUT_S)
                try:
                    token = _recv_exactly(conn, len(self.token))
                except (ReplicaError, OSError):
                    return  # no token in time: closed, unanswered
                if not hmac.compare_digest(token, self.token):
                    reply = "error: not a sender of this run"
                else:
                    conn.settimeout(self.timeout_s)
                    try:
                        with gil.writing():
                            self.receive(conn, peer)
                        reply = "ok"
                    except (ReplicaError, ValueError, OSError) as exc:
                        reply = f"error: {exc}"
                try:
                    conn.sendall(reply.encode() + b"\n")
                except OSError:
                    pass
        finally:
            self._give_slot()

    def receive(self, conn: socket.socket, peer: str) -> None:
        """One replica from ``conn``, whose token was read: committed, or ReplicaError/ValueError
        naming why not (and a log line saying it)."""
        (length,) = struct.unpack(">Q", _recv_exactly(conn, 8))
        if length > _HEADER_MAX:
            raise ReplicaError(f"a header of {length} bytes is not a snapshot's")
        head = json.loads(_recv_exactly(conn, length))
        if not isinstance(head, dict):
            raise ReplicaError("the header is no JSON object")
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
    with durable.open_new(os.path.join(folder, name), private=True) as f:
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
