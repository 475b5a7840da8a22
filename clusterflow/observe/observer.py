"""The job's side of per-rank observability: heartbeats, the stall watchdog, the flight recorder.

``job/attempt.py`` calls :func:`before_init` before the process group starts (the flight
recorder reads its variables there) and watches the run (a task's trainer or a script of the
user's own) with ``Observer(...).watching(ctx.phases)``, the phases of the attempt's
``JobContext``. The pieces themselves live in heartbeat.py (per-rank files, no collective),
watchdog.py (stacks, first cause, exit 86) and phases.py (what the loop is doing); this module
only wires them to the config:

- ``dist.heartbeat_s`` (0: off): each rank's RUN_DIR/heartbeats/rank<R>.json; rank 0 also reads
  every rank's file on its heartbeat thread and logs per-rank step time and per-GPU memory and
  utilisation to TensorBoard at log steps (no collective, nothing read on the loop's thread).
- ``observe.straggler_ratio`` (0: off): rank 0's heartbeat thread names a rank that stays
  slower than the others (``stragglers.py``); needs heartbeats.
- ``dist.stall_s`` (0: off): the watchdog's limit. The mining search may take
  ``mining.timeout_s``; the ranks waiting for it wait longer (:func:`mining_wait_timeout_s`), so
  a search that hangs is named by rank 0's own watchdog, not by a waiting peer's timeout. The
  graph of ``mining.search=sharded`` (collectives across ranks, each rank waiting for the
  slowest one's share) may take ``mining.timeout_s`` too.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from clusterflow import rundir
from clusterflow.config.job_config import Config
from clusterflow.errors import RunFailed, UserError
from clusterflow.observe import events, nvml
from clusterflow.observe.heartbeat import (
    Heartbeat,
    Progress,
    quiet_after,
    quietest,
    read_ranks,
    tensorboard_scalars,
    watches_peers,
)
from clusterflow.observe.phases import MINING_GRAPH, MINING_SEARCH, MINING_WAIT, Phases
from clusterflow.observe.stragglers import StragglerWatch
from clusterflow.observe.watchdog import (
    PeerWatch,
    StallLimits,
    Watchdog,
    default_victim_grace_s,
    dump_flight_recorder,
    flight_recorder_env,
)

log = logging.getLogger("clusterflow.observe")


def before_init(paths: rundir.RunPaths, environ: Mapping[str, str]) -> None:
    """Export the flight recorder's variables (a value the user set is kept). The attempt is the
    one rank 0 records next: every rank reads attempts.jsonl before the rendezvous, rank 0 appends
    after it. Nothing is written into the run dir here: this job does not hold it yet."""
    try:
        attempt = rundir.attempt_count(paths)  # the attempt about to start
    except OSError:
        # A run dir that cannot be read is refused, with its reason, once the job takes it.
        attempt = 0
    os.environ.update(
        flight_recorder_env(paths, attempt, {**os.environ, **environ}, make_folder=False)
    )


def nvml_gpu(device: torch.device) -> int | str | None:
    """This rank's GPU as NVML names it: its UUID when torch knows it (the same GPU to CUDA and NVML
    whatever CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER say), else the index NVML uses."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "")
    if uuid:
        return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    return nvml.nvml_id_for_torch_device(device.index or 0, os.environ.get("CUDA_VISIBLE_DEVICES"))


def mining_wait_timeout_s(mining_timeout_s: int, stall_limit_s: float | None) -> int:
    """The timeout of the group in which ranks wait for the mining search: rank 0's watchdog
    ends a search that outlasts ``mining.timeout_s`` (later by its victim grace when its thread
    looks as if it waited in a collective: gloo's flight recorder may still list the last
    one), and records itself as the cause, a whole ``stall_s`` before a waiting rank's
    collective times out and blames the wait. Without a watchdog it is ``mining.timeout_s``
    itself."""
    if not stall_limit_s:
        return int(mining_timeout_s)
    return math.ceil(mining_timeout_s + default_victim_grace_s(stall_limit_s) + stall_limit_s)


def phase_allowances(mining_timeout_s: int, stall_limit_s: float) -> dict[str, float]:
    """Each long phase's watchdog limit. The search (rank 0's gather, index and search; every
    rank's with ``mining.search=all`` or ``sharded``) and the graph across ranks (``sharded``) get
    ``mining.timeout_s``; the wait outlasts the wait's own collective, whose timeout error names
    the wait if the search's rank is gone silently."""
    return {
        MINING_SEARCH: float(mining_timeout_s),
        MINING_GRAPH: float(mining_timeout_s),
        MINING_WAIT: mining_wait_timeout_s(mining_timeout_s, stall_limit_s) + stall_limit_s,
    }


class Observer:
    """``after_stall``: called on the stalled rank, after its error is recorded and before it
    exits, with the watchdog's record (``won``: it is the attempt's first cause)."""

    def __init__(
        self,
        cfg: Config,
        paths: rundir.RunPaths,
        rank: int,
        attempt: int,
        device: torch.device,
        *,
        after_stall: Callable[[dict[str, Any]], None] | None = None,
        world: tuple[int, int] = (1, 1),
    ) -> None:
        """``world``: (ranks, ranks on this node): rank 0 and the first rank of the second node
        read their peers' heartbeats while they wait for them (``heartbeat.watches_peers``)."""
        self.rank, self.attempt = rank, attempt
        self.after_stall = after_stall
        self.host = socket.gethostname()
        self.paths = paths
        self.events = events.OnEvent(cfg.observe.on_event, paths, f"rank {rank} on {self.host}")
        d = cfg.dist
        self.heartbeat = (
            Heartbeat(paths, rank, self.host, d.heartbeat_s, gpu=nvml_gpu(device), gather=rank == 0)
            if d.heartbeat_s > 0
            else None
        )
        o = cfg.observe
        if self.heartbeat is not None and rank == 0 and o.straggler_ratio:
            # On the heartbeat thread, after its read of every rank's file: no collective.
            self.heartbeat.watch = StragglerWatch(
                paths, attempt, o.straggler_ratio, o.straggler_window_s
            ).update
        self.progress = self.heartbeat.progress if self.heartbeat is not None else Progress()
        limit = d.stall_limit_s
        self.started_at = time.time()
        self.world_size = world[0]
        self._quiet_s = quiet_after(d.heartbeat_s, limit)
        peers = (
            PeerWatch(self._silent_peer, every_s=max(0.2, min(5.0, d.heartbeat_s / 2)))
            if self.heartbeat is not None and watches_peers(rank, *world)
            else None
        )
        self.watchdog = (
            Watchdog(
                self.progress,
                paths,
                rank,
                StallLimits(limit, allowances=phase_allowances(cfg.mining.timeout_s, limit)),
                attempt=attempt,
                log_file=paths.log_file(rank, attempt),
                on_stall=self._record,
                peers=peers,
            )
            if limit
            else None
        )

    def _silent_peer(self) -> tuple[int, str, float] | None:
        """The peer whose heartbeat has been quiet longest, if it stopped (``quiet_after``)."""
        assert self.heartbeat is not None
        beats = read_ranks(
            self.paths, self.heartbeat.every_s, since=self.started_at, world_size=self.world_size
        )
        return quietest(beats, time.time(), self._quiet_s, self.rank, self.started_at)

    def _record(self, rec: dict[str, Any]) -> None:
        """The stalled rank's own error record: `status` lists it, `submit --local` names it;
        observe.on_event when the stall is the attempt's first cause."""
        rundir.write_error(
            self.paths, self.rank, self.host, rec["error"], rec.get("traceback") or ""
        )
        if rec.get("won"):
            self.events.fire(events.STALLED, self.attempt, rec["error"])
        if self.after_stall is not None:
            self.after_stall(rec)
        self.events.settle()  # the watchdog ends this process next

    def scalars(self) -> dict[str, Any]:
        return tensorboard_scalars(self.heartbeat.ranks()) if self.heartbeat is not None else {}

    @contextlib.contextmanager
    def watching(self, phases: Phases) -> Iterator[None]:
        """Heartbeats and the watchdog around the training loop whose stretches of work
        ``phases`` marks."""
        if self.heartbeat is None and self.watchdog is None:
            yield
            return
        # Where NCCL's own dump on timeout goes.
        os.makedirs(self.paths.stalls(self.attempt), exist_ok=True)
        phases.beat, phases.scalars = self.progress.bump, self.scalars
        try:
            with self.watchdog if self.watchdog is not None else contextlib.nullcontext():
                yield
        except Exception as exc:
            if self.watchdog is not None and not isinstance(exc, (UserError, RunFailed)):
                self._dump_recorder()
            raise
        finally:
            phases.unwatch()
            if self.heartbeat is not None:
                self.heartbeat.close()

    def _dump_recorder(self) -> None:
        """A rank that fails (a peer's collective error, most often) leaves its flight recorder
        beside the stalled rank's: comparing them names the rank that never joined a
        collective."""
        try:
            for line in dump_flight_recorder(
                self.paths.stalls(self.attempt), self.rank, stacks_budget_s=0.5
            ):
                log.info("flight recorder: %s", line)
        except Exception:  # noqa: BLE001 - the error being raised matters more
            pass
