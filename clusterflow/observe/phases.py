"""What this rank is doing now: one place to read it, and to report it.

The trainer, the checkpointer and the mining stage enter a phase around each stretch of work
(``train``, ``eval``, ``mining embed``, ``mining search``, ``mining graph``, ``mining wait``,
``checkpoint``), so a heartbeat, a watchdog or per-rank status can report where a rank is and
since when, without knowing the loop. Nested phases restore the outer one when they end.

Each phase change and each :meth:`Phases.tick` (the loop calls it once per step or batch) is
handed to ``beat(step, phase)``: with heartbeats on,
:meth:`clusterflow.observe.heartbeat.Heartbeat.beat`, which stores a tuple and reads a clock (no
I/O, no host sync); without, nothing.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

TRAIN = "train"
EVAL = "eval"
MINING_EMBED = "mining embed"
MINING_SEARCH = "mining search"
MINING_WAIT = "mining wait"
# mining.search=sharded: the mutual graph, curve and components computed across ranks.
MINING_GRAPH = "mining graph"
CHECKPOINT = "checkpoint"


def _nothing(step: int, phase: str) -> None:
    pass


class Phases:
    def __init__(self) -> None:
        self.current = "start"
        self.since = time.time()
        self.step = 0
        self.beat: Callable[[int, str], None] = _nothing
        # Rank 0 with heartbeats: every rank's, for TensorBoard.
        self.scalars: Callable[[], dict[str, Any]] = dict

    @contextlib.contextmanager
    def enter(self, name: str) -> Iterator[None]:
        outer, outer_since = self.current, self.since
        self.current, self.since = name, time.time()
        self.beat(self.step, name)
        try:
            yield
        finally:
            self.current, self.since = outer, outer_since
            self.beat(self.step, outer)

    def set(self, name: str) -> None:
        """Enter a phase that lasts until the next one (the training loop's)."""
        self.current, self.since = name, time.time()
        self.beat(self.step, name)

    def tick(self, step: int | None = None) -> None:
        """Progress within the current phase (a training step, an embedding or eval batch)."""
        if step is not None:
            self.step = step
        self.beat(self.step, self.current)
