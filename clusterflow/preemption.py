"""Signals become a flag; ranks agree at a step boundary; the trainer saves and stops.

A handler does no I/O and no collective (either could deadlock inside a signal handler): it
only records which signal arrived. ``StopAgreement.poll`` runs one tiny all-reduce at each step
boundary so that all ranks stop at the same step even when only one of them was signalled.

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


class StopAgreement:
    """The one question the loop asks at each step boundary: do all ranks stop here, and why?

    ``poll`` is collective: every rank gets "" (carry on), "preempted" or "timeout", the strongest
    reason any rank received, so all ranks stop at the same step even when only one was signalled.
    Today it is one tiny blocking all-reduce per step; it can be made asynchronous (started at one
    step, read at the next) by changing this class alone, as long as every rank still gets the same
    answer at the same step. ``requested`` is this rank's own flag (no collective), for work that
    polls between batches, such as the k-NN search.
    """

    def __init__(self, preemption: Preemption, device: Any = None) -> None:
        self.preemption, self.device = preemption, device

    @property
    def requested(self) -> bool:
        return self.preemption.requested

    def poll(self) -> str:
        from clusterflow import dist

        code = {"": 0, "preempted": 1, "timeout": 2}[self.preemption.reason()]
        agreed = dist.all_reduce_dict({"s": code}, op="max", device=self.device)["s"]
        return ("", "preempted", "timeout")[int(agreed)]
