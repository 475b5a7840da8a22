"""What this rank is doing now: one place to read it.

The trainer, the checkpointer and the mining stage enter a phase around each stretch of work
(``train``, ``eval``, ``mining embed``, ``mining search``, ``mining wait``, ``checkpoint``), so a
heartbeat, a watchdog or per-rank status can report where a rank is and since when, without
knowing the loop. Nested phases restore the outer one when they end.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

TRAIN = "train"
EVAL = "eval"
MINING_EMBED = "mining embed"
MINING_SEARCH = "mining search"
MINING_WAIT = "mining wait"
CHECKPOINT = "checkpoint"


class Phases:
    def __init__(self) -> None:
        self.current = "start"
        self.since = time.time()

    @contextlib.contextmanager
    def enter(self, name: str) -> Iterator[None]:
        outer, outer_since = self.current, self.since
        self.current, self.since = name, time.time()
        try:
            yield
        finally:
            self.current, self.since = outer, outer_since

    def set(self, name: str) -> None:
        """Enter a phase that lasts until the next one (the training loop's)."""
        self.current, self.since = name, time.time()
