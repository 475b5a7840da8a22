"""Signals become a flag; ranks agree at a step boundary; the trainer saves and stops.

A handler does no I/O and no collective (either could deadlock inside a signal handler): it
only records which signal arrived. ``StopAgreement.poll`` agrees on it at each step boundary, with
an all-reduce read one step later, so that all ranks stop at the same step even when only one of
them was signalled, and no step waits for the answer.

SIGUSR2 (cluster.signal_delay_s ahead of the time limit, sent by Slurm through
``--signal``) and SIGUSR1 mean "time is up: save and requeue yourself". SIGTERM means
preemption, ``scontrol requeue`` or ``scancel``: save and exit quickly; Slurm requeues the job
itself when the job allows it.
"""

from __future__ import annotations

import signal
import time
from typing import Any

TIMEOUT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
HANDLED = (signal.SIGTERM, *TIMEOUT_SIGNALS)


class Preemption:
    def __init__(self) -> None:
        self.signum: int | None = None
        self.received_at: float | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> "Preemption":
        """Install after submitit's own handlers (submitit only logs SIGTERM, and its SIGUSR2
        handler would requeue without our checkpoint), so ours take precedence."""
        for sig in HANDLED:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None or signum in TIMEOUT_SIGNALS:
            # A time-limit signal upgrades a plain SIGTERM: the job must requeue itself then.
            self.signum = signum
        if self.received_at is None:
            self.received_at = time.time()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def is_timeout(self) -> bool:
        return self.signum in TIMEOUT_SIGNALS

    def reason(self) -> str:
        if self.signum is None:
            return ""
        return "timeout" if self.is_timeout else "preempted"


REASONS = ("", "preempted", "timeout")  # by strength: the agreed reason is the strongest any rank received


class StopAgreement:
    """The one question the loop asks at each step boundary: do all ranks stop here, and why?

    ``poll`` (every step boundary) never blocks on the answer: it reads the result of the
    all-reduce started at the previous boundary and starts the next one with this rank's flag
    (``dist.AsyncMax``: CPU tensors on a gloo group of their own, so nothing waits on the GPU).
    Every rank calls ``poll`` at the same steps, so every rank reads the result of the same
    collective at the same step, and all stop there together: a signal that reached any rank
    before it started the reduce of step s stops every rank at step s + 1 (docs/preemption.md:
    at most two step boundaries after the signal, one more than a blocking reduce would take).

    ``agree`` blocks: it finishes the reduce in flight and reduces the flags as they are now.
    The loop calls it where a blocking read costs nothing (after an epoch's last step, after the
    end-of-epoch checkpoint, after the mining embed). Every reason is "", "preempted" or
    "timeout", the strongest any rank received. ``requested`` is this rank's own flag (no
    collective), for work that polls between batches, such as the k-NN search.

    One process has nobody to agree with: both answer its own flag at once.
    """

    def __init__(self, preemption: Preemption, timeout_s: int = 600) -> None:
        from clusterflow import dist

        self.preemption = preemption
        self.single = not dist.initialized()
        self._flag = None if self.single else dist.AsyncMax(timeout_s)

    @property
    def requested(self) -> bool:
        return self.preemption.requested

    def _own(self) -> int:
        return REASONS.index(self.preemption.reason())

    def poll(self) -> str:
        """Collective, at every step boundary: the agreed reason of the previous boundary's reduce."""
        if self._flag is None:
            return self.preemption.reason()
        agreed = self._flag.finish()
        if agreed:
            return REASONS[agreed]  # the same on every rank: nobody starts another reduce
        self._flag.start(self._own())
        return ""

    def agree(self) -> str:
        """Collective and blocking: the agreed reason, counting every signal received until now."""
        if self._flag is None:
            return self.preemption.reason()
        agreed = self._flag.finish()
        if agreed:
            return REASONS[agreed]
        self._flag.start(self._own())
        return REASONS[self._flag.finish()]
