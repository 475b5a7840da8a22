"""Name the ranks that stay slower than the others: rank 0's heartbeat thread, no collective.

Each rank's heartbeat carries ``busy_s``: the mean seconds per training step of the rank's own
part (data, forward, the backward of earlier micro-batches: everything before the last gradient
sync), measured with two host clock reads per step. The step's wall time says nothing here:
synchronous data-parallel ranks all wait for the slowest, so every rank's step takes as long.

Rank 0's heartbeat thread already reads every rank's file every ``dist.heartbeat_s``; after each
read, :meth:`StragglerWatch.update` scores each training rank against the median of the others
(``busy_s / median``). A rank above ``observe.straggler_ratio`` on every read that finds it
training, for ``observe.straggler_window_s``, is named once per attempt: one log line (rank,
node, ratio) and a line in ``RUN_DIR/stragglers.jsonl`` (``rundir/stragglers.py``). Nothing is
added to the loop but the two clock reads, and nothing is written unless a rank is named.

The host clock sees a rank slowed by its host (data loading, CPU contention or throttling, a
noisy neighbour) or by a GPU whose launch queue is full; a GPU that is slow on its own while the
host runs ahead shows only in the waits of the others (a CUDA event per step would name it, at
the cost of a sync). Under ``train.parallel=fsdp`` the forward holds collectives, so the others'
busy time also grows and the ratio understates the straggler.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

from clusterflow import rundir
from clusterflow.rundir import stragglers as record

log = logging.getLogger("clusterflow.stragglers")


def scores(ranks: list[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    """rank -> (busy / median busy of the other training ranks, that median); pure."""
    live = [
        r
        for r in ranks
        if r.get("phase") == "train" and not r.get("silent") and r.get("busy_s") is not None
    ]
    out: dict[int, tuple[float, float]] = {}
    for r in live:
        others = [o["busy_s"] for o in live if o is not r]
        if not others:
            break
        median = statistics.median(others)
        if median > 0:
            out[int(r["rank"])] = (float(r["busy_s"]) / median, median)
    return out


class StragglerWatch:
    """Called with every rank's heartbeat records after each read (rank 0's heartbeat thread)."""

    def __init__(self, paths: rundir.RunPaths, attempt: int, ratio: float, window_s: float) -> None:
        self.paths, self.attempt, self.ratio, self.window_s = paths, attempt, ratio, window_s
        self.slow_since: dict[int, float] = {}
        self.named: set[int] = set()

    def update(self, ranks: list[dict[str, Any]], now: float | None = None) -> list[int]:
        """Returns the ranks named by this read."""
        now = time.time() if now is None else now
        hosts = {int(r["rank"]): r.get("host") or "?" for r in ranks}
        busy = {int(r["rank"]): r.get("busy_s") for r in ranks}
        named = []
        scored = scores(ranks)
        for rank in list(self.slow_since):
            # A rank not training now (eval, mining, a checkpoint) keeps its clock running.
            if rank in scored and scored[rank][0] <= self.ratio:
                del self.slow_since[rank]
        for rank, (score, median) in scored.items():
            if score <= self.ratio:
                continue
            since = self.slow_since.setdefault(rank, now)
            if now - since < self.window_s or rank in self.named:
                continue
            self.named.add(rank)
            named.append(rank)
            log.warning(
                "straggler: rank %d on %s at %.2fx the other ranks' median step time "
                "(%.3f s vs %.3f s) for %.0f s",
                rank,
                hosts[rank],
                score,
                busy[rank],
                median,
                now - since,
            )
            record.record(
                self.paths,
                attempt=self.attempt,
                rank=rank,
                node=hosts[rank],
                ratio=round(score, 3),
                busy_s=busy[rank],
                median_s=median,
                since=since,
                time=now,
            )
        return named
