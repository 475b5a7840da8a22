"""Threads that write beside the training loop hand the interpreter back to it quickly.

A snapshot or a background checkpoint is serialised and hashed on a thread of the rank, mostly in
Python (pickling), holding the GIL. The loop's thread releases the GIL inside many torch calls
and must take it back after each; CPython makes it wait up to the switch interval (5 ms by
default) for a thread that holds it. With a step of tens of milliseconds that wait, several times
a step, costs the loop far more than the writer's CPU time (``benchmarks/recovery.py --part
cost``). While any writer runs, :func:`writing` lowers the interval to ``WRITING_SWITCH_S``
and puts the previous one back when the last writer ends: the writer takes a little longer, the
loop waits a tenth as long. The interval is the interpreter's, so the writers share one count.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# How long the loop's thread may wait for the GIL while a writer runs.
WRITING_SWITCH_S = 0.0005


class _Switch:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.writers = 0
        self.before = sys.getswitchinterval()

    def enter(self) -> None:
        with self.lock:
            if self.writers == 0:
                self.before = sys.getswitchinterval()
                sys.setswitchinterval(min(self.before, WRITING_SWITCH_S))
            self.writers += 1

    def leave(self) -> None:
        with self.lock:
            self.writers -= 1
            if self.writers == 0:
                sys.setswitchinterval(self.before)


_SWITCH = _Switch()


@contextmanager
def writing() -> Iterator[None]:
    """Around the work of a thread that writes beside the loop (see the module's docstring)."""
    _SWITCH.enter()
    try:
        yield
    finally:
        _SWITCH.leave()
