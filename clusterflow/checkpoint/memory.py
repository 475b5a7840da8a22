"""Snapshots in the nodes' memory (``checkpoint.memory_every_steps``), and the restore from them.

Every ``memory_every_steps`` optimizer steps each rank commits its share of the run's state into
its node's memory (``checkpoint.memory_dir``, ``storage/snapshots.py``) and sends it to its peer,
a rank on the next node, which keeps it as a replica (``storage/replica.py``). A rank's share is
what a disk checkpoint holds of it: rank 0 the model, every registered state (optimizers,
scheduler, counters, the epoch plan's position, the user's states) and its random streams; every
other rank its random streams. Together, one step's snapshots of every rank (a *set*) are what a
disk checkpoint of that step holds, and a restore from them is bitwise that state.

Off the training path: at the step boundary the loop captures the random streams and copies what
may change before the next optimizer step (``staging.py``: buffers and small states; with
``checkpoint.async: false`` everything); a thread of this rank copies the parameters and the
optimizer state (the next ``optimizer.step`` waits for that copy only), serialises and hashes the
snapshot into the node's memory, commits it and sends it to the peer. A snapshot due while the
previous one is still being written or sent is skipped (said once in the log), never waited for.

Taking them is :class:`MemorySnapshots`; restoring from them, :class:`MemoryRestore`, built by
the checkpointer's restore over the node's snapshots that the taker found, with the bounds of
:func:`history_bounds` (which the caller computes from the attempts' timelines).

Restoring (:meth:`MemoryRestore.assemble`, collective, before the shared filesystem is read):
every rank lists the snapshots on its node; rank 0 finds the newest complete set that is at
least as new as the newest shared checkpoint and that no later attempt abandoned (an attempt
that resumed from an older step makes the newer snapshots of the attempts before it a future that
never was). The rank on the node that holds each rank's copy reads and verifies it, its own
node's copy first ("memory of node1"), else the replica ("replica on node3"); a copy that does
not verify is named in one line and the next copy, then the next set, then the shared filesystem
is tried. Rank 0 receives the set and hands it to the restorer as the first candidate, checked
like any checkpoint (config, data, fit). A set is never mixed from two attempts or two steps.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from clusterflow import rundir
from clusterflow.checkpoint import identity
from clusterflow.checkpoint.background import Writer
from clusterflow.checkpoint.staging import Staging
from clusterflow.checkpoint.train_state import TrainState
from clusterflow.config.job_config import Config
from clusterflow.distributed import comm as dist
from clusterflow.distributed.env import DistEnv, address_toward
from clusterflow.rundir import timeline
from clusterflow.rundir.saved_config import portable
from clusterflow.storage import replica, snapshots
from clusterflow.storage.names import MODEL, TRAIN_STATE
from clusterflow.storage.snapshots import OWN, REPLICA, Key, NodeSnapshots
from clusterflow.storage.store import Checkpoint, CheckpointStore
from clusterflow.storage.tensors import PACKED

log = logging.getLogger("clusterflow.checkpointer")

# The tiers a restore reads from, as status and the attempt's timeline name them.
MEMORY, REPLICA_TIER, SHARED = "memory", REPLICA, "shared"


@dataclass(frozen=True)
class Copy:
    """One copy of a rank's snapshot: which folder, on which node, read by which rank."""

    key: Key
    step: int
    node: str
    reader: int

    def where(self) -> str:
        return f"memory of {self.node}" if self.key.kind == OWN else f"replica on {self.node}"


@dataclass(frozen=True)
class Restored:
    """What a restore from memory read: the set's step, its tier and where."""

    step: int
    tier: str
    where: str


def peer_of(rank: int, hosts: list[str]) -> int | None:
    """The rank that keeps ``rank``'s replica: the rank of the same local index on the next node
    (``hosts``: each rank's node, by rank); None on a single node."""
    nodes = list(dict.fromkeys(hosts))
    if len(nodes) < 2:
        return None
    here = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    there = [
        r for r, h in enumerate(hosts) if h == nodes[(nodes.index(hosts[rank]) + 1) % len(nodes)]
    ]
    return there[here.index(rank) % len(there)]


class MemorySnapshots:
    """Taking this rank's snapshots in memory for one attempt (``attempt``), and keeping its
    peers' replicas; ``model`` and ``states``: the checkpointer's (rank 0 snapshots them),
    ``state``: the run's counters. After :meth:`connect`, ``local`` is this node's snapshots,
    which a :class:`MemoryRestore` reads."""

    def __init__(
        self,
        cfg: Config,
        paths: rundir.RunPaths,
        model: torch.nn.Module,
        states: Mapping[str, Any],
        state: TrainState,
        attempt: int,
        *,
        on_commit: Callable[[int], None] | None = None,
    ) -> None:
        c = cfg.checkpoint
        self.every, self.paths, self.attempt = c.memory_every_steps, paths, attempt
        self.model, self.states, self.state = model, dict(states), state
        self.rank, self.world = dist.rank(), dist.world()
        self.node = snapshots.node_name()
        self.memory_dir = c.memory_dir
        self.key = Key(OWN, attempt, self.rank, self.world)
        # This node's snapshots and this rank's own store there, once connect() found the
        # node's folder sound; None: this node's memory tier is off for the attempt.
        self.local: NodeSnapshots | None = None
        self.store: CheckpointStore | None = None
        self.timeout_s = float(cfg.dist.timeout_s)
        self.staging: Staging | None = None
        if self.rank == 0:
            # checkpoint.async=false: something changes the state outside optimizer.step, so
            # everything is copied at the boundary.
            optimizers = [o for o in self.states.values() if isinstance(o, torch.optim.Optimizer)]
            self.staging = Staging(model, optimizers if c.async_ else [], one_storage=True)
        self.receiver: replica.Receiver | None = None
        self.peer: tuple[int, str, tuple[str, int]] | None = None  # (rank, node, address)
        self.here = ""  # the address this rank's peers reach it at, and it sends from
        self.token = ""
        self._writer = Writer(f"snapshots-rank{self.rank}")
        self._skipped_said = False
        self._failed_said: set[str] = set()
        self._older_left = True  # older attempts' snapshots may be on this node
        # Seconds the loop spent taking snapshots, and how many were taken, since last read.
        self.loop_s, self.taken = 0.0, 0
        # Told each step whose snapshot this rank committed (on the snapshot thread): the
        # run's in-flight record (rundir/inflight.py), which says whether a crash lost progress.
        self.on_commit: Callable[[int], None] = on_commit or (lambda step: None)
        # Rank 0's snapshots carry the config, which a restore checks as a checkpoint's.
        self._meta_base: dict[str, Any] = (
            {"config_hash": cfg.fingerprint(), "config": portable(cfg.to_dict())}
            if self.rank == 0
            else {}
        )

    # -- the peers --------------------------------------------------------------------------
    def connect(self) -> None:
        """Collective: find this node's folder (:meth:`_open`), start this rank's receiver and
        learn every rank's; pick the peer. A node whose folder must not be used keeps no
        snapshots and no replicas this attempt: rank 0 says so in one line per node."""
        token, key = dist.broadcast_object(self._draw() if self.rank == 0 else None)
        self.token = token
        refused = self._open(key)
        address: tuple[str, int] | None = None
        self.here = address_toward(DistEnv.from_env().master_addr)
        if self.local is not None:
            try:
                self.receiver = replica.Receiver(self.local, token, self.here, self.timeout_s)
                address = self.receiver.address
            except OSError as exc:
                log.warning(
                    "snapshots in memory: no receiver for replicas on %s: %s", self.node, exc
                )
        every = dist.gather_object((self.node, address, self.here, refused))
        every = dist.broadcast_object(every)
        hosts = [node for node, *_ in every]
        peers = [peer_of(r, hosts) for r in range(len(hosts))]
        if self.receiver is not None:
            self.receiver.admit([every[r][2] for r, p in enumerate(peers) if p == self.rank])
        peer = peers[self.rank]
        if peer is not None and every[peer][1] is not None:
            self.peer = (peer, hosts[peer], every[peer][1])
        if self.rank != 0:
            return
        for node, why in dict.fromkeys((n, why) for n, _, _, why in every if why):
            log.warning(
                "snapshots in memory off on %s for this attempt: %s; no snapshot or replica is "
                "kept there (a restart reads the other nodes' copies or the shared filesystem); "
                "remove it, or set checkpoint.memory_dir to a folder of your own",
                node,
                why,
            )
        nodes = list(dict.fromkeys(hosts))
        if self.local is not None:
            log.info(
                "snapshots in memory every %d steps under %s on each node%s",
                self.every,
                self.local.folder,
                f", each replicated on the next node ({' -> '.join([*nodes, nodes[0]])})"
                if len(nodes) > 1
                else " (one node: no replica)",
            )

    def _draw(self) -> tuple[str, str | None]:
        """Rank 0: the attempt's token for the replicas, and the run's folder key (drawn and
        recorded in the run dir by its first attempt; None when it cannot be: no node keeps
        snapshots then)."""
        try:
            key = snapshots.folder_key(self.paths.memory_key, create=True)
        except (ValueError, OSError) as exc:
            log.warning(
                "snapshots in memory off for this attempt: the run's folder key %s: %s "
                "(remove the file: the next attempt draws a new one)",
                self.paths.memory_key,
                exc,
            )
            key = None
        return uuid.uuid4().hex, key

    def _open(self, key: str | None) -> str:
        """This node's folder, made or checked (``snapshots.open_folder``): ``self.local`` and
        ``self.store`` when it may be used, else why not ("" when it may)."""
        if key is None:
            return ""
        try:
            folder = snapshots.open_folder(self.memory_dir, self.paths.root, self.node, key)
        except OSError as exc:  # private.Unsafe, or a folder that could not be made
            return str(exc)
        assert folder is not None  # created when missing
        self.local = NodeSnapshots(folder, PACKED, identity.check)
        self.store = self.local.store(self.key)  # this rank's own snapshots on this node
        return ""

    # -- taking -----------------------------------------------------------------------------
    def due(self, steps_per_epoch: int) -> bool:
        return self.state.save_due(self.every, steps_per_epoch) and self.store is not None

    def take(self, rng: dict[str, Any]) -> None:
        """On the loop's thread, at a step boundary where a snapshot is due: capture this rank's
        share (``rng``: its random streams now) and commit it on the snapshot thread."""
        t0 = time.perf_counter()
        step = self.state.global_step
        if self._writer.busy:
            if not self._skipped_said:
                self._skipped_said = True
                log.warning(
                    "snapshot of step %d skipped: the previous one is still being written or "
                    "sent (raise checkpoint.memory_every_steps; said once)",
                    step,
                )
            return
        ident = identity.new_id()
        files: dict[str, Any] = {
            TRAIN_STATE: {"rng": [rng], "world_size": self.world, "rank": self.rank}
        }
        if self.staging is not None:
            files[TRAIN_STATE].update({name: obj.state_dict() for name, obj in self.states.items()})
            files[MODEL] = self.model.state_dict()
        files = identity.stamp(files, ident, step)
        meta = {
            **self._meta_base,
            "checkpoint_id": ident,
            "kind": "memory",
            "rank": self.rank,
            "world_size": self.world,
            "attempt": self.attempt,
            "epoch": self.state.epoch,
            "step_in_epoch": self.state.step_in_epoch,
            "global_step": step,
            "position": list(self.state.position),
        }
        snap = self.staging.take(files) if self.staging is not None else None
        staging = self.staging

        def write() -> None:
            try:
                if staging is not None and snap is not None:
                    staging.copy_rest(snap)
                    state = staging.parts(snap)
                else:
                    state = files
                self._commit(step, state, meta)
            except Exception as exc:  # noqa: BLE001 - a snapshot is a cache: said, never fatal
                self._say_failed(step, exc)

        self._writer.start(write)
        self.loop_s += time.perf_counter() - t0
        self.taken += 1

    def _commit(self, step: int, state: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
        """On the snapshot thread: commit into this node's memory, then send to the peer."""
        assert self.store is not None  # due() is False without it
        path = self.store.save(step, state, meta)
        if path is None:
            return
        self.on_commit(step)
        if self._older_left:
            self._drop_older()
        if self.peer is None:
            return
        peer, node, address = self.peer
        try:
            replica.send(
                address,
                self.token,
                self.key,
                step,
                path,
                timeout_s=self.timeout_s,
                source=self.here,
            )
        except (replica.ReplicaError, OSError) as exc:
            self._say_failed(step, exc, f"replica on {node} (rank {peer})")

    def _drop_older(self) -> None:
        """Remove older attempts' snapshots on this node once this rank's two generations are
        newer than all of them; stop looking when none is left (no older attempt writes again)."""
        kept = self.store.steps()
        if len(kept) < snapshots.GENERATIONS:
            return
        oldest = kept[0]
        self.local.drop(lambda key, newest: key.attempt >= self.attempt or newest >= oldest)
        here = self.local.keys()
        self._older_left = any(key.attempt < self.attempt for key in here)

    def _say_failed(self, step: int, exc: BaseException, what: str = "") -> None:
        kind = f"{what}:{type(exc).__name__}"
        level = logging.INFO if kind in self._failed_said else logging.WARNING
        self._failed_said.add(kind)
        log.log(
            level,
            "snapshot of step %d %s: %s: %s",
            step,
            f"not kept as a {what}" if what else "not kept in memory",
            type(exc).__name__,
            exc,
        )

    def stop(self) -> None:
        """Wait for the snapshot in flight (its replica sent or failed)."""
        self._writer.wait()

    def close(self, clear: bool = False) -> None:
        """At the attempt's end: stop receiving; ``clear``: remove this run's snapshots on this
        node (the run's state is on the shared filesystem now)."""
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        if self.staging is not None:
            self.staging.close()
        if clear and self.local is not None:
            self.stop()
            self.local.clear()
        self._writer.close()

    def scalars(self) -> dict[str, float]:
        """For the metrics: the loop's seconds per snapshot since the last call."""
        if not self.taken:
            return {}
        out = {"checkpoint/snapshot_s": self.loop_s / self.taken}
        self.loop_s, self.taken = 0.0, 0
        return out


def history_bounds(records: timeline.Timelines, attempt: int) -> dict[int, float]:
    """For each attempt before ``attempt``, the newest of its steps still in the run's history
    (``records``: the attempts' timelines): a later attempt that resumed from an older step
    abandoned the steps after it; an unreadable timeline leaves none of the attempts before it."""
    bound: dict[int, float] = {}
    low = math.inf
    for earlier in range(attempt - 1, -1, -1):
        bound[earlier] = low
        if earlier in records.unreadable:
            low = -1
        restored = records.records.get(earlier, {}).get("restored_step")
        if isinstance(restored, int):
            low = min(low, restored)
    return bound


class MemoryRestore:
    """The restore from the snapshots in the nodes' memory, before the shared filesystem is read.
    ``local``: this node's snapshots (None: this node keeps none this attempt); ``attempt``: this
    attempt, whose own snapshots are never read; ``bounds``: for each earlier attempt, the newest
    of its steps still in the run's history (:func:`history_bounds`, needed on rank 0 only)."""

    def __init__(
        self, local: NodeSnapshots | None, attempt: int, bounds: Mapping[int, float]
    ) -> None:
        self.local, self.attempt, self.bounds = local, attempt, dict(bounds)
        self.rank = dist.rank()
        self.node = snapshots.node_name()

    def assemble(
        self, newest_shared: tuple[int, tuple[int, ...]] | None
    ) -> tuple[Checkpoint | None, Restored | None]:
        """Collective: the newest complete, verified snapshot set at least as new as
        ``newest_shared`` ((step, position) of the newest shared checkpoint, None when there is
        none), as one checkpoint on rank 0 (None elsewhere, and where there is none), and what it
        is (on every rank)."""
        removed = self.local.clean() if self.local is not None else []
        if removed:
            log.info("removed unfinished snapshots on %s: %s", self.node, ", ".join(removed))
        here = self.local.inventory() if self.local is not None else []
        listed = [(e.key, e.step, e.position) for e in here]
        gathered = dist.gather_object((self.node, listed))
        sets = self._sets(gathered, newest_shared) if self.rank == 0 else []
        bad: set[tuple[str, str, int]] = set()
        while True:
            plan = self._plan(sets, bad) if self.rank == 0 else None
            plan = dist.broadcast_object(plan)
            if plan is None:
                return None, None
            mine = {r: self._read(c) for r, c in plan.items() if c.reader == self.rank}
            said = dist.gather_object({r: (why, rng) for r, (why, _, rng) in mine.items()})
            failed = self._failures(plan, said, bad, sets) if self.rank == 0 else False
            if not dist.broadcast_object(failed):
                break
        holder = plan[0].reader
        state0 = mine[0][1] if holder == self.rank else None
        if holder != 0:
            state0 = dist.broadcast_state(state0, src=holder)
        restored = _restored(plan)
        if self.rank != 0:
            return None, restored
        assert state0 is not None and said is not None
        rngs = {r: rng for part in said for r, (_, rng) in part.items()}
        train = dict(state0[TRAIN_STATE])
        train.update(rng=[rngs[r][0] for r in range(len(plan))], world_size=len(plan))
        objects = {MODEL: state0[MODEL], TRAIN_STATE: train}
        where = f"the {restored.where} (step {restored.step})"
        return Checkpoint(restored.step, where, state0["manifest"], objects), restored

    def forget_after(self, step: int) -> None:
        """After a restore of ``step`` (from any tier): this node's snapshots of a later step
        belong to a future this run abandoned; remove them."""
        if self.local is None:
            return
        dropped = self.local.drop(lambda key, newest: newest <= step)
        if dropped:
            log.info(
                "removed snapshots newer than the restored step %d on %s: %s",
                step,
                self.node,
                ", ".join(dropped),
            )

    def _sets(
        self,
        gathered: list[tuple[str, list[tuple[Key, int, tuple[int, ...]]]]],
        newest_shared: tuple[int, tuple[int, ...]] | None,
    ) -> list[dict[int, list[Copy]]]:
        """Rank 0: every complete set a restore may use, newest first: each old rank's copies,
        its own node's first."""
        bound = self.bounds
        found: dict[tuple[int, int, int], dict[int, list[Copy]]] = {}
        for reader, (node, listed) in enumerate(gathered):
            for key, step, pos in listed:
                if step > bound.get(key.attempt, math.inf) or key.attempt >= self.attempt:
                    continue
                if newest_shared is not None and (step, pos) < newest_shared:
                    continue
                copies = found.setdefault((step, key.attempt, key.world), {}).setdefault(
                    key.rank, []
                )
                if not any(c.node == node and c.key == key for c in copies):
                    copies.append(Copy(key, step, node, reader))
        complete = []
        for (step, attempt, world), ranks in sorted(found.items(), reverse=True):
            missing = [r for r in range(world) if r not in ranks]
            if missing and not complete:  # a set newer than any complete one: say why not
                log.info(
                    "the snapshots of step %d (attempt %d, %d ranks) are not a complete set on "
                    "this step's nodes: no copy of rank %s",
                    step,
                    attempt,
                    world,
                    ", ".join(map(str, missing)),
                )
            if missing:
                continue
            for copies in ranks.values():
                copies.sort(key=lambda c: (c.key.kind != OWN, c.reader))
            complete.append(ranks)
        return complete

    def _plan(
        self, sets: list[dict[int, list[Copy]]], bad: set[tuple[str, str, int]]
    ) -> dict[int, Copy] | None:
        """Rank 0: which copy of each rank to read next (the first not found bad), or None."""
        while sets:
            ranks = sets[0]
            plan = {}
            for r, copies in ranks.items():
                good = [c for c in copies if (c.node, c.key.name, c.step) not in bad]
                if not good:
                    break
                plan[r] = good[0]
            if len(plan) == len(ranks):
                return plan
            sets.pop(0)
        return None

    def _read(self, c: Copy) -> tuple[str, dict[str, Any] | None, Any]:
        """This rank reads and verifies its assigned copy: (why not, rank 0's files and its
        manifest when it is rank 0's copy, that rank's random streams)."""
        assert self.local is not None  # a copy is read by the rank that listed it
        try:
            ckpt = self.local.verify(c.key, c.step)
            m, train = ckpt.manifest, ckpt.objects.get(TRAIN_STATE)
            said = (m.get("rank"), m.get("world_size"), m.get("attempt"))
            if said != (c.key.rank, c.key.world, c.key.attempt):
                raise ValueError(
                    f"its manifest says rank, world size, attempt = {said}, its folder {c.key.name}"
                )
            if not isinstance(train, dict) or not isinstance(train.get("rng"), list):
                raise ValueError("train_state.pt holds no random streams")
            if len(train["rng"]) != 1:
                raise ValueError("train_state.pt holds the random streams of several ranks")
            if c.key.rank == 0 and MODEL not in ckpt.objects:
                raise ValueError("rank 0's snapshot holds no model.pt")
        except ValueError as exc:
            return str(exc), None, None
        whole = {**ckpt.objects, "manifest": ckpt.manifest} if c.key.rank == 0 else None
        return "", whole, train["rng"]

    def _failures(
        self,
        plan: dict[int, Copy],
        said: list[dict[int, tuple[str, Any]]],
        bad: set[tuple[str, str, int]],
        sets: list[dict[int, list[Copy]]],
    ) -> bool:
        """Rank 0: name each copy that did not verify, in one line each, and mark it; True when
        any did."""
        why = {r: w for part in said for r, (w, _) in part.items() if w}
        for r in why:
            c = plan[r]
            bad.add((c.node, c.key.name, c.step))
        again = self._plan([dict(sets[0])], bad) if sets else None
        for r, text in sorted(why.items()):
            c = plan[r]
            if again is not None:
                then = f"trying the {again[r].where()}"
            elif len(sets) > 1:
                older = next(iter(sets[1].values()))[0].step
                then = f"falling back to the snapshot set of step {older}"
            else:
                then = "falling back to the shared filesystem"
            log.warning(
                "snapshot of rank %d at step %d in the %s is damaged (%s); %s",
                r,
                c.step,
                c.where(),
                text,
                then,
            )
        return bool(why)


def _restored(plan: Mapping[int, Copy]) -> Restored:
    """What a set read as ``plan`` is: its tier (memory when every copy was its own node's) and
    where ("memory of node1", "memory of node1, node2", "memory of node1 (rank 0) and replica on
    node1 (rank 1)")."""
    copies = [plan[r] for r in sorted(plan)]
    if all(c.key.kind == OWN for c in copies):
        nodes = ", ".join(dict.fromkeys(c.node for c in copies))
        return Restored(copies[0].step, MEMORY, f"memory of {nodes}")
    places: dict[str, list[int]] = {}
    for c in copies:
        places.setdefault(c.where(), []).append(c.key.rank)
    where = " and ".join(
        f"{place} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
        for place, ranks in places.items()
    )
    return Restored(copies[0].step, REPLICA_TIER, where)
