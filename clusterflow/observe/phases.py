"""What this rank is doing now: one place to read it, and to report it.

The trainer, the checkpointer and the mining stage enter a phase around each stretch of work
(``train``, ``eval``, ``mining embed``, ``mining search``, ``mining graph``, ``mining wait``,
``checkpoint``), so a heartbeat, a watchdog or per-rank status can report where a rank is and
since when, without knowing the loop. Nested phases restore the outer one when they end.

Each phase change and each :meth:`Phases.tick` (the loop calls it once per step or batch) is
handed to ``beat(step, phase)``: with heartbeats on,
:meth:`clusterflow.observe.heartbeat.Heartbeat.beat`, which stores a tuple and reads a clock (no
I/O, no host sync); without, nothing.

:attr:`Phases.seconds` adds up the time spent in each phase, at phase changes only (a clock read
there, nothing per step): the goodput ledger's eval, mining and checkpoint stall come from it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

TRAIN = "train"
EVAL = "eval"
MINING_EMBED = "mining embed"
MINING_SEARCH = "mining search"
MINING_WAIT = "mining wait"
# mining.search=sharded: the mutual graph, curve and components computed across ranks.
MINING_GRAPH = "mining graph"
CHECKPOINT = "checkpoint"
# checkpoint.memory_every_steps: the loop's part of a snapshot in memory (the rest runs beside it).
SNAPSHOT = "snapshot"


def _nothing(step: int, phase: str, *more: float | None) -> None:
    pass


class Phases:
    def __init__(self) -> None:
        self.current = "start"
        self.since = time.time()
        self.step = 0
        # Seconds spent in each phase so far (the current one up to its last change).
        self.seconds: dict[str, float] = {}
        self._changed = time.monotonic()
        self.beat: Callable[..., None] = _nothing
        # Rank 0 with heartbeats: every rank's, for TensorBoard.
        self.scalars: Callable[[], dict[str, Any]] = dict

    def unwatch(self) -> None:
        """No heartbeat hears the phases any more (the observer's watch ended)."""
        self.beat, self.scalars = _nothing, dict

    @contextlib.contextmanager
    def enter(self, name: str) -> Iterator[None]:
        outer, outer_since = self.current, self.since
        self._account()
        self.current, self.since = name, time.time()
        self.beat(self.step, name)
        try:
            yield
        finally:
            self._account()
            self.current, self.since = outer, outer_since
            self.beat(self.step, outer)

    def set(self, name: str) -> None:
        """Enter a phase that lasts until the next one (the training loop's)."""
        self._account()
        self.current, self.since = name, time.time()
        self.beat(self.step, name)

    def totals(self) -> dict[str, float]:
        """Seconds per phase up to now, the current phase included."""
        while True:
            try:  # the checkpointer's write thread may ask while a first phase is added
                out = dict(self.seconds)
                break
            except RuntimeError:
                continue
        out[self.current] = out.get(self.current, 0.0) + time.monotonic() - self._changed
        return out

    def _account(self) -> None:
        now = time.monotonic()
        self.seconds[self.current] = self.seconds.get(self.current, 0.0) + now - self._changed
        self._changed = now

    def tick(
        self,
        step: int | None = None,
        busy_s: float | None = None,
        wait_s: float | None = None,
        step_s: float | None = None,
    ) -> None:
        """Progress within the current phase (a training step, an embedding or eval batch).
        ``busy_s``: the training step's own part (``observe/stragglers.py``); ``wait_s``: the
        seconds it waited for its batches, of its ``step_s`` (the heartbeat's data wait)."""
        if step is not None:
            self.step = step
        if busy_s is None and wait_s is None:
            self.beat(self.step, self.current)
        else:
            self.beat(self.step, self.current, None, busy_s, wait_s, step_s)
