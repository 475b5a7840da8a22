"""One checkpoint write at a time, on a background thread.

:meth:`BackgroundWrite.start` runs a write on a fresh thread; :meth:`BackgroundWrite.wait` blocks
until it has finished and hands back its :class:`Outcome` once (how long it took, how long the
caller waited for it, and the error that ended it, if any). The checkpointer decides what a
failure means; this module only makes sure none goes unnoticed: the error is kept until someone
waits, and ``on_error`` runs on the writer's thread at once (to log it and put it in ``status``).

:class:`Writer` is the same for work handed over every few steps (snapshots in memory): one
thread that lives as long as its owner, so that handing a write over costs the loop a queue's
put, not the start of a thread (which waits until the OS has run the new thread, a wait that
grows with the machine's load).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from clusterflow.storage import gil
from clusterflow.storage.worker import Worker


@dataclass(frozen=True)
class Outcome:
    step: int
    seconds: float  # the write itself
    waited: float  # how long ``wait`` blocked its caller
    error: str | None  # None: committed (or already committed)


class BackgroundWrite:
    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._result: tuple[float, str | None] = (0.0, None)
        self._step = -1

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(
        self, step: int, write: Callable[[], object], on_error: Callable[[int, BaseException], str]
    ) -> None:
        """Run ``write`` on a new thread; the previous write must have been waited for.
        ``on_error(step, exc)`` returns the message kept for ``wait``."""
        if self._thread is not None:
            raise RuntimeError(
                "a checkpoint write is still in flight; wait() for it first "
                "(this is a bug in clusterflow)"
            )

        def run() -> None:
            t0 = time.perf_counter()
            error = None
            try:
                with gil.writing():
                    write()
            # Kept and reported: a failed save is never silent.
            except BaseException as exc:  # noqa: BLE001
                error = on_error(step, exc)
            self._result = (time.perf_counter() - t0, error)

        self._step = step
        # A daemon: a write hung on a dead filesystem must not keep a failed job alive; the
        # checkpointer waits for it on every normal path, and a kill leaves only a .tmp- folder.
        self._thread = threading.Thread(target=run, name=f"checkpoint-step-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> Outcome | None:
        """The outcome of the write in flight or just finished (None when there is none)."""
        if self._thread is None:
            return None
        t0 = time.perf_counter()
        self._thread.join()
        self._thread = None
        seconds, error = self._result
        return Outcome(self._step, seconds, time.perf_counter() - t0, error)


class Writer:
    """One write at a time on a thread that lives until :meth:`close`; ``name``: the thread's.
    ``write`` handles its own errors (a snapshot's are said and dropped); one that escapes is
    logged with its traceback."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._worker = Worker(name)
        self._done = threading.Event()
        self._done.set()

    @property
    def busy(self) -> bool:
        return not self._done.is_set()

    def start(self, write: Callable[[], object]) -> None:
        """Hand ``write`` to the thread; the previous write must have finished."""
        if self.busy:
            raise RuntimeError(
                f"{self.name}: a write is still in flight (this is a bug in clusterflow)"
            )

        def run() -> None:
            with gil.writing():
                write()

        self._done = self._worker.submit(run)

    def wait(self) -> None:
        """Block until the write in flight, if any, has finished."""
        self._done.wait()

    def close(self) -> None:
        """End the thread once the write in flight has finished (returns at once)."""
        self._worker.close()
