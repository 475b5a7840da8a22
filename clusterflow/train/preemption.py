"""Signals and a user's cancel become a flag; ranks agree at a step boundary; the trainer saves and
stops.

A handler does no I/O and no collective (either could deadlock inside a signal handler): it
only records which signal arrived. ``StopAgreement.poll`` agrees on it at each step boundary, with
an all-reduce read one step later, so that all ranks stop at the same step even when only one of
them was signalled, and no step waits for the answer.

SIGUSR2 (cluster.signal_delay_s ahead of the time limit, sent by Slurm through
``--signal``) and SIGUSR1 mean "time is up: save and requeue yourself". SIGTERM means
preemption, ``scontrol requeue`` or ``scancel``: save and exit quickly; Slurm requeues the job
itself when the job allows it. SIGINT (Ctrl-C in the terminal of ``submit --local``) means "stop
here": save and end ``stopped``, never requeued.

The job's end (``EndWatch``, rank 0 of a Slurm job): Slurm's end time, read again every
``cluster.end_check_s`` on a thread of its own (an admin's ``scontrol update TimeLimit=...`` is
seen there), compared at each agreement with the time a stop needs: two saves as this run
measured them (the write in flight, then the stop's own) plus ``cluster.end_margin_s``. Once the
end is closer, the reason is ``timeout``, as for the time-limit signal: the ranks agree, save and
requeue, whether or not Slurm's ``--signal`` came (its lead may be shorter than a save).

A user's cancel (``RUN_DIR/cancelled.json``, written by ``clusterflow cancel``) reaches a running
job as one more reason, ``cancelled``: rank 0 looks for the marker at most every
``AGREE_EVERY_S`` seconds when the loop asks for its flag, and the agreement carries it to every
rank (a local run cannot be scancelled, so the job must see the marker itself).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from clusterflow.distributed import comm as dist
from clusterflow.distributed.groups import AsyncMax
from clusterflow.distributed.workers import STOP_SIGNALS
from clusterflow.rundir.states import StopHow, StopReason
from clusterflow.slurm.commands import JobEnd

log = logging.getLogger("clusterflow")

TIMEOUT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
# SIGTERM, SIGINT and the time-limit signals: the ranks' DataLoader workers outlive them
# (distributed/workers.py), and the rank stops.
HANDLED = STOP_SIGNALS
# The training loop's interval_s: how much training may pass between two agreements; also how
# often rank 0 looks for the cancel marker.
AGREE_EVERY_S = 0.2
# By strength: the agreed reason is the strongest any rank received. A user's interrupt or cancel
# beats a requeue; a time-limit signal upgrades a plain SIGTERM.
REASONS = (
    "",
    StopReason.PREEMPTED,
    StopReason.TIMEOUT,
    StopReason.INTERRUPTED,
    StopReason.CANCELLED,
)
# What the log says when the loop stops for each reason.
WHY = {
    StopReason.PREEMPTED: "SIGTERM received",
    StopReason.TIMEOUT: "time-limit signal received",
    StopReason.INTERRUPTED: "interrupted (SIGINT, Ctrl-C)",
    StopReason.CANCELLED: "cancelled by the user (clusterflow cancel)",
}


def _reason_of(signum: int | None) -> str:
    if signum is None:
        return ""
    if signum == signal.SIGINT:
        return StopReason.INTERRUPTED
    return StopReason.TIMEOUT if signum in TIMEOUT_SIGNALS else StopReason.PREEMPTED


class EndWatch:
    """Rank 0's watch of the job's end: ``read`` asks Slurm (``slurm.commands.job_end``) on a
    thread every ``every_s`` seconds; :meth:`due` (at each agreement: a clock read, no I/O) says
    whether the end is closer than a stop needs, ``margin_s`` plus two saves as
    :meth:`measure_saves` says they take (the write in flight, then the stop's own). Once due it
    stays due, and :attr:`said` says why."""

    def __init__(
        self,
        read: Callable[[], JobEnd | None],
        every_s: float,
        margin_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._read, self.every_s, self.margin_s, self._clock = read, every_s, margin_s, clock
        self.end_at: float | None = None
        self._save_s: Callable[[], float] = lambda: 0.0
        self.due_at: float | None = None
        self.said = ""
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def measure_saves(self, save_s: Callable[[], float]) -> None:
        """How long a save takes from now on: the checkpointer's measure, or before it is made
        the longest write of an earlier attempt."""
        self._save_s = save_s

    def start(self) -> EndWatch:
        self._thread = threading.Thread(target=self._watch, name="job-end", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.is_set():
            self.ask()
            self._closed.wait(self.every_s)

    def ask(self) -> None:
        """Read Slurm's end once (the thread's work; a test calls it directly)."""
        try:
            answer = self._read()
        except Exception as exc:  # noqa: BLE001 - a question, never a reason to stop training
            log.warning("could not read the job's end time from Slurm: %s", exc)
            answer = None
        if answer is not None and answer.end_at != self.end_at:
            if self.end_at is not None or answer.end_at is not None:
                log.info(
                    "Slurm ends this job at %s (time limit %s)",
                    _clock(answer.end_at),
                    answer.limit or "?",
                )
            self.end_at = answer.end_at

    def needed_s(self) -> float:
        return self.margin_s + 2 * self._save_s()

    def due(self) -> bool:
        if self.due_at is not None:
            return True
        end = self.end_at
        if end is None:
            return False
        now = self._clock()
        left, needed = end - now, self.needed_s()
        if left > needed:
            return False
        self.due_at = now
        self.said = (
            f"the job's end ({_clock(end)}, Slurm's EndTime) is {max(0.0, left):.1f} s away, "
            f"closer than two saves ({self._save_s():.1f} s each, as measured) plus "
            f"cluster.end_margin_s ({self.margin_s:g} s): saving and requeueing before it"
        )
        log.warning("%s", self.said)
        return True

    def record(self) -> dict[str, Any]:
        """What a time-limit stop's line in stops.jsonl says of the end: when it was, how long a
        save took, and when the stop was decided (``due_at``, None: the signal came first)."""
        return {
            "end_at": self.end_at,
            "save_s": round(self._save_s(), 3),
            "due_at": self.due_at,
        }


def _clock(t: float | None) -> str:
    return "none" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


class Preemption:
    """``cancelled``: rank 0's question "did the user cancel the run?" (the marker), asked at most
    every ``check_every_s`` seconds; None on the other ranks, which hear it through the
    agreement."""

    def __init__(
        self,
        cancelled: Callable[[], bool] | None = None,
        check_every_s: float = AGREE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        end: EndWatch | None = None,
    ) -> None:
        self.signum: int | None = None
        self.received_at: float | None = None
        self._installed = False
        self._cancelled, self._check_every_s, self._clock = cancelled, check_every_s, clock
        self._checked_at: float | None = None
        self.cancel_seen = False
        self.end = end  # rank 0 of a Slurm job with a time limit: the watch of its end

    def install(self) -> Preemption:
        """Install after submitit's own handlers (submitit only logs SIGTERM, and its SIGUSR2
        handler would requeue without our checkpoint), so ours take precedence."""
        for sig in HANDLED:
            signal.signal(sig, self._handle)
        self._installed = True
        # `submit --local` starts the ranks with SIGINT blocked (so that submitit's controller
        # cannot act on Ctrl-C); from here on it is handled, and one held back arrives now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(HANDLED))
        return self

    def uninstall(self) -> None:
        """After the run completed: the stop signals end the process again (SIGINT raises
        KeyboardInterrupt), whatever handled them before (submitit's own SIGTERM handler only
        logs), so that a script kept alive by a thread of its own still ends on ``timeout``,
        Ctrl-C or Slurm's SIGTERM."""
        if not self._installed:
            return
        for sig in HANDLED:
            signal.signal(
                sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            )
        self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # The strongest signal so far wins: a time-limit signal upgrades a plain SIGTERM (the job
        # must requeue itself then), and Ctrl-C upgrades both (nothing requeues it).
        if REASONS.index(_reason_of(signum)) > REASONS.index(_reason_of(self.signum)):
            self.signum = signum
        if self.received_at is None:
            self.received_at = time.time()

    def _cancel_requested(self) -> bool:
        """Whether the user cancelled the run (the marker; looked for at most every
        check_every_s)."""
        if self.cancel_seen or self._cancelled is None:
            return self.cancel_seen
        now = self._clock()
        if self._checked_at is None or now - self._checked_at >= self._check_every_s:
            self._checked_at = now
            self.cancel_seen = bool(self._cancelled())
        return self.cancel_seen

    def _end_near(self) -> bool:
        return self.end is not None and self.end.due()

    @property
    def requested(self) -> bool:
        return self.signum is not None or self._cancel_requested() or self._end_near()

    @property
    def is_timeout(self) -> bool:
        return self.signum in TIMEOUT_SIGNALS

    def reason(self) -> str:
        if self._cancel_requested():
            return StopReason.CANCELLED
        said = _reason_of(self.signum)
        # The job's end near stops a run nothing else stops. A SIGTERM near the end stays a
        # preemption: it may be Slurm's own requeue under way, which a second requeue would fail.
        if not said and self._end_near():
            return StopReason.TIMEOUT
        return said

    def why(self, reason: str) -> str:
        """What the log says when the loop stops for the agreed ``reason``."""
        if reason == StopReason.TIMEOUT and self.signum is None and self._end_near():
            return "the job's end is closer than a save"
        return WHY.get(reason, reason)

    def measure_saves(self, save_s: Callable[[], float]) -> None:
        """How long a save takes, as the checkpointer measures it (the watch of the job's end
        needs it)."""
        if self.end is not None:
            self.end.measure_saves(save_s)

    def stop_record(self, reason: str) -> dict[str, Any]:
        """What a stop's line in stops.jsonl says of how it came about (``reason``: the agreed
        one): when this rank's signal came, and for a time-limit stop whether Slurm's signal or
        the job's own watch of its end began it (``how``), with the end and the save time."""
        out: dict[str, Any] = {"signal_at": self.received_at}
        if reason != StopReason.TIMEOUT:
            return out
        watched = self.end is not None and self.end.due_at is not None
        signalled_first = (
            self.is_timeout
            and self.received_at is not None
            and self.end is not None
            and self.end.due_at is not None
            and self.received_at <= self.end.due_at
        )
        out["how"] = StopHow.END if watched and not signalled_first else StopHow.SIGNAL
        if self.end is not None:
            out.update(self.end.record())
        return out


class StopAgreement:
    """The one question the loop asks at each step boundary: do all ranks stop here, and why?

    ``poll`` (every step boundary) never blocks on the answer: it reads the result of an
    all-reduce started at an earlier boundary and starts the next one with this rank's flag
    (``AsyncMax``: CPU tensors on a gloo group of their own, so nothing waits on the GPU).
    Every rank calls ``poll`` at the same steps and reads the same collective at the same
    boundary, so all stop there together.

    How often: with ``interval_s`` 0, a reduce at every boundary, read at the next. Otherwise each
    reduce also carries every rank's proposal of how many boundaries to leave until the next
    (as many as fill ``interval_s`` at the pace this rank measured, 1 to ``MAX_EVERY``); the
    smallest proposal is the cadence from then on, the same on every rank because it is read from
    the same reduce. A signal travels in the next reduce started after it, so every rank stops at
    most two cadences after it (docs/preemption.md#how-the-ranks-agree-to-stop): on a 20 ms step
    and interval_s 0.2 that is 0.4 s of training for a tenth of the collectives.

    ``agree`` blocks: it finishes the reduce in flight and reduces the flags as they are now.
    The loop calls it where a blocking read costs nothing (after an epoch's last step, after the
    end-of-epoch checkpoint, after the mining embed). Every reason is one of ``REASONS``, the
    strongest any rank received. ``requested`` is this rank's own flag (no
    collective), for work that polls between batches, such as the k-NN search.

    One process has nobody to agree with: both answer its own flag at once.
    """

    # A step that suddenly slows (a neighbour's job) delays a stop by 2 x 16 steps at most.
    MAX_EVERY = 16

    def __init__(
        self,
        preemption: Preemption,
        timeout_s: int = 600,
        interval_s: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:

        self.preemption = preemption
        self.single = not dist.initialized()
        # (reason, minus the proposed cadence): one maximum gives the strongest reason and the
        # smallest proposal.
        self._flag = None if self.single else AsyncMax(timeout_s, size=2)
        self.interval_s, self._clock = interval_s, clock
        self.every = 1  # boundaries from the start of a reduce to its read, agreed by every rank
        self._wait = 0  # boundaries left before the reduce in flight is read
        self._started: float | None = None  # this rank's clock when it started that reduce
        self._span = 1  # the boundaries until it is read
        self.reduces = 0

    @property
    def requested(self) -> bool:
        return self.preemption.requested

    def _own(self) -> int:
        return REASONS.index(self.preemption.reason())

    def _proposal(self) -> int:
        """This rank's cadence: as many boundaries as fill interval_s at the pace since the last
        start (none known yet, or after an agreement: the cadence as it is)."""
        if not self.interval_s or self._started is None:
            return self.every
        per_step = max((self._clock() - self._started) / self._span, 1e-9)
        return max(1, min(self.MAX_EVERY, int(self.interval_s / per_step)))

    def _read(self) -> str:
        reason, minus_every = self._flag.finish()
        if minus_every:
            self.every = -minus_every
        return REASONS[reason]

    def _start(self, proposal: int) -> None:
        self._flag.start(self._own(), -proposal)
        self._started, self._span, self._wait = self._clock(), self.every, self.every - 1
        self.reduces += 1

    def poll(self) -> str:
        """Collective, at every step boundary: the agreed reason, when a reduce is read here."""
        if self._flag is None:
            return self.preemption.reason()
        if self._wait > 0:
            self._wait -= 1
            return ""
        agreed = self._read()
        if agreed:
            return agreed  # the same on every rank: nobody starts another reduce
        self._start(self._proposal())
        return ""

    def agree(self) -> str:
        """Collective and blocking: the agreed reason, counting every signal received until now."""
        if self._flag is None:
            return self.preemption.reason()
        agreed = self._read()
        if agreed:
            return agreed
        self._start(self.every)
        agreed = self._read()
        # Polling resumes with a fresh reduce at the next boundary; what happens until then (eval,
        # mining) is no measure of a step's pace.
        self._started, self._wait = None, 0
        return agreed
