"""DataLoader worker processes leave the job's stop signals to their rank.

Slurm signals every process of a job (a preemption, ``scontrol requeue``, ``scancel``), and
Ctrl-C reaches every process of the terminal's foreground group: a rank's DataLoader workers
too. A torch worker dies of a SIGTERM its rank did not send, and of SIGINT (its loop ends on the
``KeyboardInterrupt``); the rank then raises "DataLoader worker (pid N) is killed by signal"
wherever it is, inside the stop's save too, and a stop becomes a failure. The rank handles those
signals itself (``train/preemption.py``: agree, save, stop) and shuts its workers down as it
leaves, so a worker only has to outlive them:

- :func:`quiet` wraps a DataLoader's ``worker_init_fn`` (the user's still runs after it): the
  worker gives the stop signals a handler that does nothing, before anything else of the user's
  runs in it (a handler, not "ignored": a program the worker starts gets the default back);
- :func:`started` creates the DataLoader's iterator, which starts the workers, with the stop
  signals blocked in the rank: a worker inherits them blocked, so none can end it before its
  handlers are in place, and the rank receives one that came meanwhile once its workers run.

A worker whose rank is gone ends by itself (torch's watchdog in the worker sees its parent
change), and SIGKILL (Slurm's, after ``KillWait``) ends it as any process. A rank that ends its
run shuts its workers down itself (:func:`shut_down`): left to the interpreter's exit, a
process that leaves normally (``python train.py``, torchrun) would send its daemonic workers
SIGTERM, which they outlive, and wait for them forever.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from torch.utils.data import DataLoader

# The signals a rank handles as a stop (train/preemption.py installs its handlers for them):
# preemption and requeue, Ctrl-C, the time limit.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


def _outlive(signum: int, frame: FrameType | None) -> None:
    """A worker's handler of a stop signal: its rank stops, and ends it."""


class _Quiet:
    """A DataLoader's ``worker_init_fn``: the stop signals handled (by nothing), then the user's
    ``worker_init_fn``. A class, so that the spawn start method can pickle it."""

    def __init__(self, then: Callable[[int], object] | None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, _outlive)
        # Blocked since the rank started this worker (started): one that came meanwhile is
        # handled now, by nothing.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        if self.then is not None:
            self.then(worker_id)


def quiet(worker_init_fn: Callable[[int], object] | None) -> _Quiet:
    """The ``worker_init_fn`` to build a DataLoader with, around the user's (None: none)."""
    return _Quiet(worker_init_fn)


def started(loader: DataLoader) -> Iterator[Any]:
    """``iter(loader)``, its workers started with the stop signals blocked (see above)."""
    if not loader.num_workers:
        return iter(loader)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def shut_down(batches: Iterator[Any]) -> None:
    """Stop the worker processes behind ``batches`` (a DataLoader's iterator) now and wait for
    them, as torch does when such an iterator is collected: they leave their loop when told to,
    so no stop signal is needed. Nothing for an iterator without workers, or one already shut
    down."""
    stop = getattr(batches, "_shutdown_workers", None)
    if callable(stop):
        stop()
