"""What an open run page follows as it grows: the metrics and each rank's log, read on from an
offset, kept within a fixed size, and handed to each stream as "what changed since".

Each feed counts its changes (``version``) and its restarts (``generation``: a file replaced, a
purge, a thinning of old points, a new attempt's log). A stream remembers the pair it last sent
and asks :meth:`since`; a generation it did not see gets everything again, otherwise only what
changed after its version.
"""

from __future__ import annotations

import itertools
import math
import os
from collections import deque
from dataclasses import dataclass, field

from clusterflow import rundir
from clusterflow.manage import logs
from clusterflow.observe import scalar_log
from clusterflow.rundir.records import JsonLinesFollower


@dataclass
class Delta:
    """What a stream gets: everything (``reset``) or what changed since the version it had."""

    generation: int
    version: int
    reset: bool
    items: list[object] = field(default_factory=list)


# Generations are unique across feeds: a stream that held a cursor of a feed since dropped and
# made again (a page closed and opened) can never take the new feed's for its own.
_GENERATIONS = itertools.count(1)


def _finite(v: float) -> float | None:
    """A value as JSON carries it: a NaN or infinite loss is shown as a gap."""
    return v if math.isfinite(v) else None


class MetricFeed:
    """``RUN_DIR/metrics.jsonl`` as ``{step: {tag: value}}`` by :func:`scalar_log.fold` (and
    each step's time, ``times``, for a wall-clock axis), at most
    ``max_steps`` steps (when full, every other step of the older three quarters is dropped: a
    long run's chart keeps its shape and its recent detail in bounded memory) and ``max_tags``
    tags (a file with more names is no run's metrics; the rest are counted in ``dropped_tags``).
    """

    def __init__(self, paths: rundir.RunPaths, max_steps: int = 2000, max_tags: int = 400) -> None:
        self.paths, self.max_steps, self.max_tags = paths, max_steps, max_tags
        self.follower = JsonLinesFollower(paths.metrics)  # no link, no FIFO: records.py
        self.table: dict[int, dict[str, float]] = {}
        self.times: dict[int, float] = {}  # step -> when it was logged (rows that say so)
        self.changed: dict[int, int] = {}  # step -> version of its last change
        self.tags: set[str] = set()
        self.dropped_tags = 0
        self.version, self.generation = 0, next(_GENERATIONS)
        # A huge file is taken a few chunks per update (4 MiB each): the poll goes on meanwhile.
        self.chunks_per_update = 4

    def update(self) -> bool:
        """Read what was appended; True when the table changed."""
        changed = False
        for _ in range(self.chunks_per_update):
            rows, restarted = self.follower.read()
            if restarted:
                self._reset()
                changed = True
            for row in rows:
                changed |= self._add(row)
            if not self.follower.behind:
                break
        return changed

    def _reset(self) -> None:
        self.table, self.times, self.changed, self.tags = {}, {}, {}, set()
        self.generation = next(_GENERATIONS)

    @property
    def refused(self) -> str:
        """Why metrics.jsonl is not read ("" when it is): a link, a FIFO (``records.py``)."""
        return f"metrics.jsonl {self.follower.refused}" if self.follower.refused else ""

    def _add(self, row: dict[str, object]) -> bool:
        if "purge_step" in row:
            # An attempt's marker: it drops what earlier attempts logged from its step on and
            # adds no step (its step may never get a value: an own loop logs from its first
            # train.log_every_steps).
            if not scalar_log.fold(self.table, row, self.times):
                return False
            self.generation = next(_GENERATIONS)
            self.changed = {s: v for s, v in self.changed.items() if s in self.table}
            return True
        row = {k: v for k, v in row.items() if k in scalar_log.ROW_KEYS or self._room(k)}
        if scalar_log.fold(self.table, row, self.times) is None:
            return False
        step = row["step"]
        if isinstance(step, int):
            self.version += 1
            self.changed[step] = self.version
        if len(self.table) > self.max_steps:
            self._thin()
        return True

    def _room(self, tag: str) -> bool:
        if tag in self.tags:
            return True
        if len(self.tags) >= self.max_tags:
            self.dropped_tags += 1
            return False
        self.tags.add(tag)
        return True

    def _thin(self) -> None:
        steps = sorted(self.table)
        older = steps[: len(steps) * 3 // 4]
        for s in older[1::2]:
            del self.table[s]
            self.times.pop(s, None)
            self.changed.pop(s, None)
        self.generation = next(_GENERATIONS)

    def since(self, generation: int, version: int) -> Delta:
        """The steps changed since ``version`` of ``generation``, as ``[step, {tag: value},
        time]`` (all of them for another generation; time None for a row that says none);
        values that are not finite are None."""
        reset = generation != self.generation
        steps = sorted(s for s, v in self.changed.items() if reset or v > version)
        items: list[object] = [
            [s, {k: _finite(v) for k, v in self.table[s].items()}, self.times.get(s)] for s in steps
        ]
        return Delta(self.generation, self.version, reset, items)


class LogFeed:
    """One rank's log across attempts (``manage.logs``: its files, headers and :class:`Tail`),
    the newest ``keep_bytes`` of it: a new attempt's log follows the old one's last lines under
    its header, and a 2 GB log costs a seek to its end."""

    def __init__(self, paths: rundir.RunPaths, rank: int, keep_bytes: int = 64 * 1024) -> None:
        self.paths, self.rank, self.keep = paths, rank, keep_bytes
        self.attempt: int | None = None
        self.tail: logs.Tail | None = None
        self.chunks: deque[tuple[int, str]] = deque()
        self.size = 0
        self.version, self.generation = 0, next(_GENERATIONS)

    def update(self) -> bool:
        """Read what was written since; True when there is more to show."""
        attempts = logs.attempts(self.paths, self.rank)
        changed = False
        if attempts and attempts[-1] != self.attempt:
            self.attempt = attempts[-1]
            target = self.paths.log_file(self.rank, self.attempt)
            self.tail = logs.Tail(target, self.paths.root)  # no link, no FIFO: storage/confined
            header = logs.header(self.paths, self.rank, self.attempt)
            changed = self._add(("\n" if self.chunks else "") + header + "\n")
        if self.tail is not None:
            said = self.tail.refused
            text = self.tail.read(limit=self.keep)
            if self.tail.refused and self.tail.refused != said:
                text += f"[{os.path.basename(self.tail.path)} {self.tail.refused}: not shown]\n"
            if text:
                changed = self._add(text)
        return changed

    def _add(self, text: str) -> bool:
        self.version += 1
        self.chunks.append((self.version, text))
        self.size += len(text)
        while self.size > self.keep and len(self.chunks) > 1:
            _, old = self.chunks.popleft()
            self.size -= len(old)
        return True

    def since(self, generation: int, version: int) -> Delta:
        """The text added since ``version``; all that is kept when the stream has missed some
        (it was dropped to stay within ``keep_bytes``), which the page then shows alone."""
        missed = bool(self.chunks) and version < self.chunks[0][0] - 1
        reset = generation != self.generation or missed
        items: list[object] = [t for v, t in self.chunks if reset or v > version]
        return Delta(self.generation, self.version, reset, items)
