"""A node's snapshots in memory: the folders under ``checkpoint.memory_dir`` where each rank keeps
its own snapshots and a peer's replicas (docs/restarts.md, "Snapshots in memory").

Layout, one folder per run on each node (``{node}`` in ``memory_dir`` becomes the host name)::

    MEMORY_DIR/clusterflow-<run name>-<hash>/
        own-a<A>-r<R>-w<W>/step-<N>/        rank R's snapshot of step N, written by attempt A of
                                            W ranks on this node: manifest.json and its files
        replica-a<A>-r<R>-w<W>/step-<N>/    the same, received from rank R on another node

``<hash>``: of the run dir's path (two runs stay apart, a copied run dir too) and of the run's key,
random hex digits the run draws once and records in its run dir (``RUN_DIR/memory.key``, mode
0600, :func:`folder_key`): every attempt of the run, requeued on any node, finds its folders, and
nobody who cannot read the run dir can name them before the run makes them.

A node is shared (``/dev/shm`` is every user's): every folder here is private (``private.py``):
made by the run with exclusive creation and mode 0700, or, found, used only when it is a folder of
this user's that others cannot enter, below folders nobody else can change; every file is 0600.
A run folder that is not (:func:`open_folder` raises ``private.Unsafe``) is never read or written:
the memory tier of that node is off for the attempt (``checkpoint/memory.py`` says so once).

Each ``own-``/``replica-`` folder is a :class:`~clusterflow.storage.store.CheckpointStore` of its
own (``keep_last=2``: two generations, so a crash while one is written leaves the previous one
whole), with the store's commit protocol: files staged in ``.tmp-step-N-*``, the manifest (sizes,
digests, the snapshot's id) written last, the folder renamed. A reader verifies every file as it
does a disk checkpoint's. Nothing here is fsynced: the memory of a node does not survive its
reboot, and a tmpfs has nothing to sync.

A snapshot *set* is every rank's snapshot of one step of one attempt (W folders of the same
attempt, step and world size); which copy of each rank to read, and whether a set may be used at
all, is the job side's decision (``checkpoint/memory.py``). No torch here.

``python -m clusterflow.storage.snapshots MEMORY_DIR RUN_DIR KEY_FILE`` removes the run's folder
on the node it runs on: the batch step's driver runs it on the nodes a completed job left out
(``job/restarts.py``), whose snapshots no attempt clears otherwise.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import shutil
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clusterflow.storage import confined, durable, private
from clusterflow.storage.store import Checkpoint, CheckpointStore, position

log = logging.getLogger("clusterflow.snapshots")

OWN, REPLICA = "own", "replica"
GENERATIONS = 2
_KEY = re.compile(r"^(own|replica)-a(\d+)-r(\d+)-w(\d+)$")
_FOLDER_KEY = re.compile(r"^[0-9a-f]{16}$")


def node_name() -> str:
    """This node's name, as ``{node}`` in ``checkpoint.memory_dir`` and every message say it."""
    return socket.gethostname().split(".")[0]


def folder_key(record: str, create: bool = False) -> str | None:
    """The random part of the run's folder names, from its record ``record`` (``RunPaths.
    memory_key``); ``create``: drawn and recorded first unless recorded already (the first
    writer wins, every attempt after reads it). None when there is none; ValueError when the
    record holds something else."""
    if create:
        durable.publish_once(record, secrets.token_hex(8) + "\n", private=True)
    try:
        text = confined.read_bytes(record, limit=64).decode("ascii", "replace").strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"{record} cannot be read: {exc}") from None
    if not _FOLDER_KEY.match(text):
        raise ValueError(f"{record} holds {text[:24]!r}, not the 16 hex digits the run drew")
    return text


def run_folder(memory_dir: str, run_dir: str, node: str, key: str) -> str:
    """This run's folder under ``memory_dir`` on ``node``: the run dir's name (for a human who
    lists /dev/shm) and a hash of its absolute path and the run's ``key`` (:func:`folder_key`)."""
    root = os.path.abspath(run_dir)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(root.rstrip("/")) or "run")[:40]
    digest = hashlib.sha256(f"{root}\n{key}".encode()).hexdigest()[:16]
    return os.path.join(memory_dir.replace("{node}", node), f"clusterflow-{name}-{digest}")


def open_folder(
    memory_dir: str, run_dir: str, node: str, key: str, create: bool = True
) -> str | None:
    """This run's folder on this node (:func:`run_folder`, ``memory_dir`` resolved), made
    private when missing (``create``; else None); ``private.Unsafe`` naming the folder when it,
    or a folder on the way to it, must not be used."""
    parent = private.reach(memory_dir.replace("{node}", node), create)
    if parent is None:
        return None
    folder = run_folder(parent, run_dir, node, key)
    if create:
        private.make(folder)
    elif not os.path.lexists(folder):
        return None
    else:
        private.check(folder)
    return folder


@dataclass(frozen=True, order=True)
class Key:
    """Whose snapshots a folder holds: rank ``rank`` of ``world`` ranks in attempt ``attempt``,
    written by that rank (``own``) or received from it (``replica``)."""

    kind: str
    attempt: int
    rank: int
    world: int

    @property
    def name(self) -> str:
        return f"{self.kind}-a{self.attempt}-r{self.rank}-w{self.world}"

    @classmethod
    def parse(cls, name: str) -> Key | None:
        m = _KEY.match(name)
        if m is None:
            return None
        kind, attempt, rank, world = m.groups()
        return cls(kind, int(attempt), int(rank), int(world))


@dataclass(frozen=True)
class Entry:
    """One snapshot a node holds, as its manifest says (not yet verified)."""

    key: Key
    step: int
    position: tuple[int, ...]
    manifest: dict[str, Any]


class NodeSnapshots:
    """This run's snapshots on this node (``folder``: :func:`open_folder`'s). ``codec``: how a
    snapshot's objects are written and read (``storage.tensors.TORCH``); ``check``: what a
    snapshot must satisfy beyond its manifest, sizes and digests (the ids inside its files)."""

    def __init__(
        self,
        folder: str,
        codec: durable.Codec | None = None,
        check: Callable[[Checkpoint], None] | None = None,
    ) -> None:
        self.folder, self.codec, self.check = folder, codec, check

    def store(self, key: Key) -> CheckpointStore:
        return CheckpointStore(
            os.path.join(self.folder, key.name),
            keep_last=GENERATIONS,
            fsync=False,
            readable=False,
            check=self.check,
            codec=self.codec,
            private=True,
        )

    def keys(self) -> list[Key]:
        """The folders of snapshots here; only private ones (see the module's docstring)."""
        try:
            names = os.listdir(self.folder)
        except OSError:
            return []
        keys = [k for k in map(Key.parse, names) if k is not None]
        return sorted(k for k in keys if private.is_private(os.path.join(self.folder, k.name)))

    def inventory(self) -> list[Entry]:
        """Every committed snapshot here, with its manifest (schema-checked, files not read)."""
        out = []
        for key in self.keys():
            store = self.store(key)
            for step in store.steps():
                manifest = store.manifest(step)
                if manifest is not None:
                    out.append(Entry(key, step, position(manifest), manifest))
        return out

    def verify(self, key: Key, step: int) -> Checkpoint:
        """Read and check one snapshot (every file's size and digest, the ids inside them);
        ValueError naming what is wrong."""
        return self.store(key).verify(step)

    def clean(self) -> list[str]:
        """Remove what a killed writer or receiver left (staged folders); returns their names."""
        removed = []
        for key in self.keys():
            removed += [f"{key.name}/{n}" for n in self.store(key).clean_debris()]
        return removed

    def drop(self, keep: Callable[[Key, int], bool]) -> list[str]:
        """Remove the snapshot folders of every (key, newest step) that ``keep`` refuses; returns
        their names."""
        dropped = []
        for key in self.keys():
            steps = self.store(key).steps()
            if steps and keep(key, steps[-1]):
                continue
            shutil.rmtree(os.path.join(self.folder, key.name), ignore_errors=True)
            dropped.append(key.name)
        return dropped

    def clear(self) -> None:
        """Remove this run's folder on this node (the run ended with its state on the shared
        filesystem)."""
        shutil.rmtree(self.folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    memory_dir, run_dir, record = (sys.argv[1:] if argv is None else argv)[:3]
    node = node_name()
    try:
        key = folder_key(record)
        folder = open_folder(memory_dir, run_dir, node, key, create=False) if key else None
    except (ValueError, OSError) as exc:
        print(f"error: the run's snapshots on {node} are left: {exc}", file=sys.stderr)
        return 1
    if folder is not None:
        NodeSnapshots(folder).clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
