"""Rank 0's record of its attempt in time (``rundir/timeline.py``), for the goodput ledger.

The trainer tells :class:`AttemptTimeline` when the restore ended, when the first step ended,
each committed checkpoint (from the checkpointer, possibly on its write thread), each step
(a clock read) and the end of the loop. Phase seconds come from
:class:`~clusterflow.observe.phases.Phases`, which adds them up at phase changes only; the
start-up's phases come from :class:`Startup`, which the attempt and the run mark as they get
there. Writes: one at the first step, one per commit, at most one per ``WRITE_EVERY_S`` as steps
go (a kill loses at most that much of the record), one at the end. Other ranks get
:class:`NullTimeline` (nothing to write, nothing to report).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any

from clusterflow import rundir
from clusterflow.observe import goodput, phases
from clusterflow.observe.metrics import NullWriter
from clusterflow.observe.phases import Phases
from clusterflow.rundir import timeline as record

log = logging.getLogger("clusterflow.goodput")


# Set by a warm standby's process when it becomes a rank (job/warm.py): when it did, which is
# where the rank's start-up begins (the process itself started long before, to import).
STARTED_AT_ENV = "CLUSTERFLOW_STARTED_AT"


def process_started_at(pid: int | None = None) -> float | None:
    """When a process started, in seconds since 1970 (Linux /proc), or None where unknown; for
    this process, when it became a rank where a warm standby's process did
    (:data:`STARTED_AT_ENV`)."""
    if pid is None and os.environ.get(STARTED_AT_ENV):
        with contextlib.suppress(ValueError):
            return float(os.environ[STARTED_AT_ENV])
    try:
        with open(f"/proc/{pid or os.getpid()}/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


# The phases of an attempt's start-up, in order (:class:`Startup`): the interpreter, the imports
# and the config; joining the process group; the run dir taken and the attempt recorded; the
# task and its data built; the model, optimizer and loader set up; the checkpoint read; the first
# batch loaded; the first step (its forward, backward and optimizer step). A script's code
# between ``clusterflow.start()`` and ``run.restore`` is the model's up to ``run.setup``, the
# data's up to ``run.loader`` (in whichever order it calls them), the model's after both.
IMPORTS = "imports"
RENDEZVOUS = "rendezvous"
RUN_DIR = "run dir"
TASK_DATA = "task data"
MODEL = "model"
RESTORE = "restore"
FIRST_BATCH = "first batch"
FIRST_STEP = "first step"
PHASES = (IMPORTS, RENDEZVOUS, RUN_DIR, TASK_DATA, MODEL, RESTORE, FIRST_BATCH, FIRST_STEP)


class Startup:
    """Where this rank's start-up went: seconds per phase from the process's start to the end of
    its first step. :meth:`mark` ends a phase (one clock read, no I/O), so the phases add up to
    the time from the process's start to the last mark."""

    def __init__(self, started_at: float | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.time() if started_at is None else started_at

    def mark(self, phase: str) -> None:
        now = time.time()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + max(0.0, now - self._last)
        self._last = now
        # In the phases' order, whichever a script reached first (its model or its data).
        ordered = sorted(self.seconds, key=lambda p: PHASES.index(p) if p in PHASES else 99)
        self.seconds = {p: self.seconds[p] for p in ordered}


def categories(seconds: dict[str, float]) -> dict[str, float]:
    """Phase seconds as the ledger's activities: train, eval, mining (its phases), checkpoint (the
    loop's part of a snapshot in memory too)."""
    out = {"train": 0.0, "eval": 0.0, "mining": 0.0, "checkpoint": 0.0}
    for name, s in seconds.items():
        key = "mining" if name.startswith("mining") else name
        key = phases.CHECKPOINT if key == phases.SNAPSHOT else key
        if key in out:
            out[key] += s
    return out


class NullTimeline:
    def restored(
        self, step: int, seconds: float, source: tuple[str, str, int] | None = None
    ) -> None:
        pass

    def first_step(self, step: int) -> None:
        pass

    def progress(self, step: int) -> None:
        pass

    def committed(self, step: int, write_s: float | None = None) -> None:
        pass

    def ended(self, outcome: str, step: int, writer: NullWriter) -> None:
        pass


class AttemptTimeline(NullTimeline):
    # As often as status.json's progress (a kill loses at most this much record).
    WRITE_EVERY_S = 1.0

    def __init__(
        self,
        paths: rundir.RunPaths,
        attempt: int,
        phases: Phases,
        startup: Startup | None = None,
        **fields: object,
    ) -> None:
        self.paths, self.phases = paths, phases
        self.startup = startup or Startup(process_started_at())
        self._lock = threading.Lock()
        self._base: dict[str, float] | None = None  # phase seconds at the first step
        self._written = 0.0  # monotonic time of the last write
        self.rec: dict[str, Any] = {
            "attempt": attempt,
            "process_started_at": process_started_at(),
            **fields,
        }

    def _since_first(self) -> dict[str, float]:
        if self._base is None:
            return {}
        now = categories(self.phases.totals())
        return {k: max(0.0, v - self._base.get(k, 0.0)) for k, v in now.items()}

    def _write(self, fsync: bool = False, **fields: object) -> None:
        """Rewrite the record with ``fields``, the phase seconds until now and, once the loop has
        trained, the step it trained last (a commit reported from the save's write thread while
        the loop trained on records where the loop is, not the step of the last progress write);
        the loop's thread and the write thread both call it, and ``last_step`` only grows."""
        with self._lock:
            self._written = time.monotonic()
            said = [fields.get("last_step"), self.rec.get("last_step")]
            if self._base is not None:
                said.append(self.phases.step)
            steps = [s for s in said if isinstance(s, int)]
            if steps:
                fields["last_step"] = max(steps)
            self.rec.update(fields, written_at=time.time(), seconds=self._since_first())
            try:
                record.write(self.paths, dict(self.rec), fsync=fsync)
            except OSError as exc:  # a record, never a reason to stop training
                where = self.paths.timeline_file(int(self.rec["attempt"]))
                log.warning("could not write %s: %s", where, exc)

    def restored(
        self, step: int, seconds: float, source: tuple[str, str, int] | None = None
    ) -> None:
        """The restore ended at ``step``; ``source``: (tier, where, step) it read (None: a fresh
        start)."""
        where = {"restored_from": source[0], "restored_where": source[1]} if source else {}
        self._write(
            restored_step=step,
            restore_s=seconds,
            last_step=step,
            startup=dict(self.startup.seconds),
            **where,
        )

    def first_step(self, step: int) -> None:
        self._base = categories(self.phases.totals())
        self._write(
            first_step_at=time.time(),
            first_step=step,
            last_step=step,
            startup=dict(self.startup.seconds),
        )

    def progress(self, step: int) -> None:
        if time.monotonic() - self._written >= self.WRITE_EVERY_S:
            self._write(last_step=step)

    def committed(self, step: int, write_s: float | None = None) -> None:
        """Checkpoint ``step`` was published, its write having taken ``write_s`` seconds until
        then (None: not measured)."""
        commit = {"step": step, "at": time.time(), "seconds": self._since_first()}
        longest = max(float(self.rec.get("write_s") or 0.0), write_s or 0.0)
        more = {"write_s": round(longest, 3)} if longest else {}
        self._write(fsync=True, commit=commit, last_step=step, **more)

    def ended(self, outcome: str, step: int, writer: NullWriter) -> None:
        """The loop ended: the last record; the run's goodput so far goes to the writer
        (TensorBoard and the trackers)."""
        self._write(fsync=True, ended_at=time.time(), outcome=outcome, last_step=step)
        try:
            writer.scalars(goodput.scalars(goodput.ledger(self.paths, running=False)), step)
        except Exception as exc:  # noqa: BLE001 - a report must never hide how the run ended
            log.warning("goodput not reported: %s", exc)


def timeline_for(
    is_main: bool,
    paths: rundir.RunPaths,
    attempt: int,
    phases: Phases,
    startup: Startup | None = None,
    **fields: object,
) -> NullTimeline:
    if not is_main:
        return NullTimeline()
    return AttemptTimeline(paths, attempt, phases, startup, **fields)
