"""A mining round's work on disk, so a round cut short resumes where it stopped
(``mining.resume``).

    RUN_DIR/mining/epoch-<E>/rank<R>/shard/step-0/
        this rank's embeddings: indices (int64), rows (float32)
    RUN_DIR/mining/epoch-<E>/rank<R>/search/step-<S>/
        k-NN query blocks this rank finished (a batch of them per step)

Every folder is committed by the checkpoint store (``storage/store.py``: staged, every file's
digest (BLAKE3) in a manifest written last, atomic rename; a reader trusts only a folder that
verifies), so a kill at any moment leaves a usable folder or debris that is ignored. The manifests
carry the round's key (``round_key``: a sha256 of the model's weights, world size, dataset size,
the mining settings that change a result, the engine and the software): files of another key are
deleted and the round starts afresh.

Rows are kept in float32, the precision the round clusters: a resumed round then gives the labels
of an uninterrupted one bit for bit. float16 would halve the files, but only if every round
clustered float16-rounded embeddings, a change of every run's labels. The files live until the
end-of-epoch checkpoint that holds the round's labels is committed (``forget_rounds``).

Search blocks are committed in batches: every ``COMMIT_EVERY_S`` seconds, when the search stops on
a signal (the grace period before SIGKILL is for this) and when it ends (a crash while clustering
or saving then repeats no search). A block's result does not depend on the other blocks, so a
search that computes only the missing ones returns the same lists.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import threading
import time

import numpy as np
import torch

from clusterflow.distributed import sharding
from clusterflow.storage.store import CheckpointStore
from clusterflow.storage.tensors import TORCH

log = logging.getLogger("clusterflow.mining")

COMMIT_EVERY_S = 60.0  # at most this much finished search is lost to a SIGKILL
_KEEP_ALL = 1 << 30  # the store's retention: never prune a round's batches
_ROUND = re.compile(r"^epoch-(\d+)$")


def round_key(
    model: torch.nn.Module, epoch: int, world: int, n: int, settings: dict[str, object]
) -> str:
    """What a round's files must match to be used: the model's weights (every tensor's bytes;
    this rank's shards of a sharded model), the round and its shape, ``settings`` (mining keys,
    precision, engine) and the software."""
    h = hashlib.sha256()
    # An FSDP2 module's state_dict() reshards it: inside the embed's gathered window that would
    # free the gathered parameters and make the next forward gather them again (a collective).
    fsdp = sharding.is_fsdp(model)
    tensors = (
        itertools.chain(model.named_parameters(), model.named_buffers())
        if fsdp
        else model.state_dict().items()
    )
    for name, t in tensors:
        if hasattr(t, "to_local"):  # a DTensor (train.parallel=fsdp): this rank's shard
            t = t.to_local()
        t = t.detach().cpu().contiguous().reshape(-1)
        if fsdp:  # a numpy view would pin the gathered storage FSDP frees when it reshards
            t = t.clone()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    versions = {"torch": torch.__version__}
    try:
        import faiss

        versions["faiss"] = faiss.__version__
    except ImportError:
        pass
    meta = {"epoch": epoch, "world": world, "n": n, "settings": settings, "versions": versions}
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    return h.hexdigest()


class RoundFiles:
    """One rank's files of one round."""

    def __init__(self, root: str, epoch: int, rank: int, key: str, fsync: bool = True) -> None:
        self.dir = os.path.join(root, f"epoch-{epoch}", f"rank{rank}")
        self.key, self.fsync = key, fsync

    def _store(self, name: str) -> CheckpointStore:
        store = CheckpointStore(os.path.join(self.dir, name), _KEEP_ALL, self.fsync, codec=TORCH)
        store.clean_debris()  # what a killed writer left
        return store

    def load_shard(self) -> tuple[np.ndarray, np.ndarray, float] | None:
        """(indices, rows, seconds the embedding took) when this round's shard is on disk."""
        store = self._store("shard")
        if 0 not in store.steps():
            return None
        try:
            saved = store.verify(0)
        except ValueError as exc:
            log.warning(
                "the embeddings kept in %s are damaged (%s); embedding again", self.dir, exc
            )
            return None
        if saved.manifest.get("key") != self.key:
            return None
        shard = saved.load("shard.pt")
        return shard["indices"].numpy(), shard["rows"].numpy(), float(saved.manifest["embed_s"])

    def save_shard(self, indices: np.ndarray, rows: np.ndarray, seconds: float) -> None:
        shard = {
            "indices": torch.from_numpy(np.ascontiguousarray(indices)),
            "rows": torch.from_numpy(np.ascontiguousarray(rows)),
        }
        self._store("shard").save(0, {"shard.pt": shard}, {"key": self.key, "embed_s": seconds})

    def search_blocks(self, every_s: float = COMMIT_EVERY_S) -> SearchBlocks:
        return SearchBlocks(self._store("search"), self.key, every_s)

    def discard(self) -> None:
        """Start this rank's part of the round afresh."""
        shutil.rmtree(self.dir, ignore_errors=True)


class SearchBlocks:
    """``knn.Blocks`` over a store: the blocks earlier attempts committed, and new ones committed
    in batches (and then let go: the search holds them). ``put`` may be called from several
    threads (one per GPU). ``seconds``: the time spent committing."""

    def __init__(self, store: CheckpointStore, key: str, every_s: float) -> None:
        self.store, self.key, self.every_s = store, key, every_s
        self.lock = threading.Lock()
        self.done: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.pending: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        steps = store.steps()
        for step in steps:
            try:
                saved = store.verify(step)
            except ValueError as exc:  # its blocks are computed again
                log.warning("skipping damaged search blocks in %s: %s", store.step_path(step), exc)
                continue
            if saved.manifest.get("key") == key:
                self.done.update(_unpack(saved.load("blocks.pt")))
        self.next_step = max(steps, default=0) + 1
        self.reused, self.seconds = 0, 0.0
        self.last = time.monotonic()

    def get(self, start: int, rows: int) -> tuple[np.ndarray, np.ndarray] | None:
        found = self.done.get(start)
        if found is None or len(found[0]) != rows:
            return None
        with self.lock:
            self.reused += 1
        return found

    def put(self, start: int, sims: np.ndarray, ids: np.ndarray) -> None:
        """Keep a block (arrays the caller no longer changes); commit the batch when it is due."""
        with self.lock:
            self.pending[start] = (sims, ids)
            if time.monotonic() - self.last >= self.every_s:
                self._commit()

    def flush(self) -> None:
        """Commit every block not committed yet."""
        with self.lock:
            self._commit()

    def _commit(self) -> None:
        t0 = time.monotonic()
        if self.pending:
            self.store.save(self.next_step, {"blocks.pt": _pack(self.pending)}, {"key": self.key})
            self.pending, self.next_step = {}, self.next_step + 1
        self.last = time.monotonic()
        self.seconds += self.last - t0


def _pack(blocks: dict[int, tuple[np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
    starts = sorted(blocks)
    return {
        "starts": torch.tensor(starts, dtype=torch.int64),
        "rows": torch.tensor([len(blocks[s][0]) for s in starts], dtype=torch.int64),
        "sims": torch.from_numpy(np.concatenate([blocks[s][0] for s in starts])),
        "ids": torch.from_numpy(np.concatenate([blocks[s][1] for s in starts])),
    }


def _unpack(packed: dict[str, torch.Tensor]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    ends = np.cumsum(packed["rows"].numpy())
    sims, ids = (
        np.split(packed["sims"].numpy(), ends[:-1]),
        np.split(packed["ids"].numpy(), ends[:-1]),
    )
    return dict(zip(packed["starts"].tolist(), zip(sims, ids)))


def forget_rounds(root: str, through_epoch: int) -> list[str]:
    """Delete the files of every round up to ``through_epoch`` (their labels are committed)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    gone = []
    for name in sorted(names):
        m = _ROUND.match(name)
        if m and int(m.group(1)) <= through_epoch:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            gone.append(name)
    try:
        os.rmdir(root)  # only when no round is left
    except OSError:
        pass
    return gone
