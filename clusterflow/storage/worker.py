"""One long-lived daemon thread that runs queued work in order, off its callers' paths.

A store deletes pruned steps on one (``store.py``), and the snapshots in memory write on one per
attempt (``checkpoint/background.py``, ``Writer``): starting a thread per piece of work makes the
caller wait until the OS has run the new thread, a wait that grows with the machine's load. The
thread starts with the first piece of work and again in a forked child (which inherits the
object but not the thread); an error the work did not handle is logged with its traceback and
the thread goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("clusterflow.worker")


class Worker:
    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[tuple[Callable[[], object], threading.Event] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, work: Callable[[], object]) -> threading.Event:
        """Queue ``work``; the event is set once it has run (or failed)."""
        done = threading.Event()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._queue.put((work, done))
        return done

    def close(self) -> None:
        """End the thread once the queued work has run (returns at once)."""
        with self._lock:
            if self._thread is not None:
                self._queue.put(None)
                self._thread = None

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            work, done = item
            try:
                work()
            except BaseException:  # said; the next piece of work still needs the thread
                log.exception("%s: work ended with an error it did not handle", self.name)
            finally:
                done.set()
