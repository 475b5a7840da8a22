"""The stall watchdog: a rank whose loop stops moving dumps its stacks, names itself, and exits
fast.

A hung rank otherwise holds the whole job until ``dist.timeout_s`` and is then blamed on a peer
(rank 0's all_reduce times out first). A daemon thread watches the loop's
:class:`~clusterflow.observe.heartbeat.Progress`; when it has not moved for ``stall_s`` (or the
phase's own allowance: the mining wait is legitimately long) the thread

1. records the first cause, ``rank R on HOST stalled N s at step S in PHASE (file:line function)``,
   in RUN_DIR/errors/first.attempt<A>.json, which a peer's later error cannot overwrite;
2. dumps every thread's Python stack (``faulthandler``) into the rank's log file and into
   RUN_DIR/stalls/attempt<A>/rank<R>.stacks.txt;
3. dumps PyTorch's flight recorder (the last collectives) into
   RUN_DIR/stalls/attempt<A>/flight_recorder_rank_<R> when one is recording (see
   :func:`flight_recorder_env`), named as ``torchfrtrace DIR --prefix flight_recorder_rank_`` reads;
4. ends the process with ``os._exit(EXIT_STALLED)``, so ``srun --kill-on-bad-exit`` (or the local
   launcher) takes the job down at once.

A rank whose main thread waits inside a collective is more likely a victim of a peer than the cause,
so it waits ``victim_grace_s`` longer: the peer that stopped outside a collective records first.
A peer that cannot record (stopped by SIGSTOP, a thread holding the GIL, a hung node) stops its
heartbeat too: while it waits, a rank given ``peers`` (rank 0 and the first rank of the second
node, ``heartbeat.watches_peers``) reads its peers' heartbeats, and as soon as one has been quiet
long enough (``heartbeat.quiet_after``) it records at once, naming that rank first (``silent_rank``,
``silent_host``, ``silent_s`` in the record): the batch step's driver leaves that rank's node
out of the restart, and the wait is the watchdog's limit, not the limit and the grace (nor a
longer allowance of its phase, the mining wait's: a peer's silence is never the phase's).
The loop thread is stuck, not the watchdog: os._exit from this thread works even while the main
thread sleeps or waits in C code that released the GIL; a thread that holds the GIL forever stops
this one too, and then the peers' heartbeats (and dist.timeout_s) are what is left.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import socket
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType, ModuleType, TracebackType
from typing import Any, TypeVar

import torch

from clusterflow import rundir
from clusterflow.errors import EXIT_STALLED
from clusterflow.observe.heartbeat import Progress
from clusterflow.rundir import first_error
from clusterflow.rundir.states import Cause
from clusterflow.storage import durable

WAIT_PATHS = (
    "torch/distributed/",
    "torch/nn/parallel/",
    "torch/autograd/",
    "clusterflow/distributed/comm.py",
    "clusterflow/distributed/groups.py",  # the stop agreement's wait for its started all-reduce
)
FR_BUFFER = "2000"  # entries in the flight recorder's ring buffer (PyTorch's recommendation)
# The flight recorder's variables by the name torch reads (2.13: c10d/FlightRecorder.hpp, and its
# writer of dumps), with the older name it still reads, and warns about, on every rank.
FR_OLDER_NAMES = {
    "TORCH_FR_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_FR_DUMP_TEMP_FILE": "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
}
log = logging.getLogger("clusterflow.watchdog")
T = TypeVar("T")


def default_victim_grace_s(stall_s: float) -> float:
    """How much longer a rank that waits in a collective is given before its watchdog ends it."""
    return max(10.0, 0.25 * stall_s)


@dataclass(frozen=True)
class StallLimits:
    """When a rank counts as stalled: no step for ``stall_s`` seconds, or for its phase's own
    allowance (``allowances``: phase -> seconds, e.g. the mining wait's); ``victim_grace_s``:
    how much longer a rank that waits in a collective is given before its watchdog ends it
    (None: :func:`default_victim_grace_s`)."""

    stall_s: float
    allowances: Mapping[str, float] | None = None
    victim_grace_s: float | None = None


@dataclass(frozen=True)
class PeerWatch:
    """``quiet()``: (rank, host, seconds) of a peer whose heartbeat went quiet, or None; read at
    most once every ``every_s`` while this rank waits for its peers past its limit."""

    quiet: Callable[[], tuple[int, str, float] | None]
    every_s: float = 1.0


class Watchdog:
    """``with Watchdog(heartbeat.progress, paths, rank, StallLimits(stall_s)):`` around the loop
    (or ``start()`` and ``stop()``); an exception leaving the block stops it before anyone
    handles it. It watches the main thread, the loop's."""

    def __init__(
        self,
        progress: Progress,
        paths: rundir.RunPaths,
        rank: int,
        limits: StallLimits,
        *,
        attempt: int = 0,
        log_file: str | None = None,
        on_stall: Callable[[dict[str, Any]], None] | None = None,
        peers: PeerWatch | None = None,
    ) -> None:
        self.progress, self.paths, self.rank, self.attempt = progress, paths, rank, attempt
        self.stall_s, self.allowances = float(limits.stall_s), dict(limits.allowances or {})
        self.host = socket.gethostname()
        self.log_file, self.on_stall = log_file, on_stall
        grace = limits.victim_grace_s
        self.victim_grace_s = default_victim_grace_s(self.stall_s) if grace is None else grace
        self.loop_thread = threading.main_thread().ident
        # (rank, host, seconds) of a peer whose heartbeat went quiet, read at most once every
        # peers_every_s while this rank waits for its peers past its limit.
        self.peers = peers.quiet if peers is not None else None
        self.peers_every_s = peers.every_s if peers is not None else 1.0
        self._peers_read_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"clusterflow-watchdog-{rank}", daemon=True
        )

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Stopped before any error handler runs: reporting an error (a flight-recorder dump, a slow
        # write) is no progress, and the watchdog must not end a rank that is busy failing properly.
        self.stop()

    def limit(self, phase: str) -> float:
        return float(self.allowances.get(phase, self.stall_s))

    def _run(self) -> None:
        poll = max(0.05, min(1.0, self.stall_s / 10))
        while not self._stop.wait(poll):
            count, step, phase, at, _ = self.progress.snapshot()
            if count == 0:
                continue  # armed by the first beat: start-up is dist.timeout_s's business
            idle = time.monotonic() - at
            if idle < min(self.stall_s, self.limit(phase)):
                continue
            frame = sys._current_frames().get(self.loop_thread)
            if idle < self.limit(phase):
                # A phase allowed longer (the mining wait) waits for a peer that stopped no
                # longer than any other: its silence is never the phase's.
                waiting = waiting_in_collective(frame)
                silent = self._silent_peer() if waiting else None
                if silent is None:
                    continue
            else:
                waiting = waiting_in_collective(frame) or active_collective()
                silent = self._silent_peer() if waiting else None
                if waiting and silent is None and idle < self.limit(phase) + self.victim_grace_s:
                    continue
            if self._stop.is_set():
                return
            self.fire(idle, step, phase, frame, waiting, silent)

    def _silent_peer(self) -> tuple[int, str, float] | None:
        """A peer that stopped, by its quiet heartbeat (read at most once every
        ``peers_every_s``)."""
        now = time.monotonic()
        if self.peers is None or now - self._peers_read_at < self.peers_every_s:
            return None
        self._peers_read_at = now
        try:
            return self.peers()
        except Exception:  # noqa: BLE001 - a reader's failure must not stop the watchdog
            return None

    def fire(
        self,
        idle: float,
        step: int,
        phase: str,
        frame: FrameType | None,
        waiting: str | None,
        silent: tuple[int, str, float] | None = None,
    ) -> None:
        """Record, dump, exit. Each step is guarded: a full disk must not keep a hung rank alive.
        ``silent``: (rank, host, seconds) of the peer whose heartbeat went quiet, the cause."""
        where = describe_frame(frame)
        msg = (
            f"rank {self.rank} on {self.host} stalled {int(idle)} s at step {step} in {phase} "
            f"({where})"
        )
        if waiting:
            msg += f", waiting in {waiting} for its peers"
        if silent is not None:
            msg = (
                f"rank {silent[0]} on {silent[1]} stopped: no heartbeat for {silent[2]:.0f} s, "
                f"no progress (a frozen process or node); {msg}"
            )
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        record = {
            "step": step,
            "phase": phase,
            "stalled_s": round(idle, 1),
            "where": where,
            "waiting": waiting,  # a collective it waited in: more likely a peer's victim
            "traceback": stack,
        }
        if silent is not None:
            record.update(silent_rank=silent[0], silent_host=silent[1], silent_s=silent[2])
        paths = self.paths
        stalls = paths.stalls(self.attempt)
        _guard(
            lambda: record.update(
                won=first_error.record(
                    paths,
                    self.attempt,
                    self.rank,
                    msg,
                    host=self.host,
                    kind=Cause.STALL,
                    **record,
                )
            )
        )
        header = (
            f"clusterflow watchdog: {msg}\n"
            f"stacks of every thread (loop thread 0x{self.loop_thread or 0:016x}):\n"
        )
        for target in (self.log_file, paths.stacks_file(self.rank, self.attempt)):
            if target:
                _guard(lambda t=target: dump_stacks(t, header))
        _guard(lambda: record.update(flight_recorder=dump_flight_recorder(stalls, self.rank)))
        if self.on_stall is not None:
            _guard(
                lambda: self.on_stall(
                    {"error": msg, "rank": self.rank, "host": self.host, **record}
                )
            )
        _guard(lambda: log.error("%s; stacks in %s; exiting with %d", msg, stalls, EXIT_STALLED))
        print(
            f"clusterflow watchdog: {msg}; exiting with {EXIT_STALLED}", file=sys.stderr, flush=True
        )
        for h in logging.getLogger("clusterflow").handlers:
            _guard(h.flush)
        os._exit(EXIT_STALLED)


def _guard(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - the exit below matters more than any one report
        pass


def dump_stacks(target: str, header: str) -> None:
    """Every thread's Python stack, appended to ``target`` (faulthandler needs a real file
    descriptor)."""
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    with open(target, "a", encoding="utf-8") as f:
        f.write(header)
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.write("\n")


# -- where is the loop? ---------------------------------------------------------------------

_STDLIB = sysconfig.get_paths()["stdlib"]


def _library(filename: str) -> bool:
    name = filename.replace(os.sep, "/")
    if "/clusterflow/" in name:
        return False
    return (
        "site-packages/" in name
        or "dist-packages/" in name
        or filename.startswith(_STDLIB)
        or name.startswith("<")
    )


def _short(filename: str) -> str:
    name = filename.replace(os.sep, "/")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in name:
            return name.split(marker, 1)[1]
    if filename.startswith(_STDLIB):
        return os.path.relpath(filename, _STDLIB)
    cwd = os.getcwd()
    return os.path.relpath(filename, cwd) if filename.startswith(cwd + os.sep) else filename


def describe_frame(frame: FrameType | None) -> str:
    """``file:line function`` of the innermost frame; when that is library code (a queue, a lock,
    torch), also the innermost frame of the user's own code, which is what one has to read."""
    if frame is None:
        return "no Python frame"
    stack = traceback.extract_stack(frame)
    top = stack[-1]
    text = f"{_short(top.filename)}:{top.lineno} {top.name}"
    if _library(top.filename):
        own = next((f for f in reversed(stack) if not _library(f.filename)), None)
        if own is not None:
            text += f", called from {_short(own.filename)}:{own.lineno} {own.name}"
    return text


def waiting_in_collective(frame: FrameType | None) -> str | None:
    """The torch function the loop waits in, when its innermost frame is a collective (or DDP's
    backward, which waits for the gradient all-reduce); None otherwise."""
    if frame is None:
        return None
    name = frame.f_code.co_filename.replace(os.sep, "/")
    if any(p in name for p in WAIT_PATHS):
        return f"{frame.f_code.co_name} ({_short(frame.f_code.co_filename)})"
    return None


# -- PyTorch's flight recorder ----------------------------------------------------------------


def flight_recorder_env(
    paths: rundir.RunPaths, attempt: int, environ: Mapping[str, str], make_folder: bool = True
) -> dict[str, str]:
    """Variables to export before ``init_process_group`` so the flight recorder records, and so
    NCCL's own timeout dump lands in RUN_DIR/stalls/attempt<A>/ (torch appends the rank to the
    prefix; the folder is created here, torch does not). Only the names torch reads now
    (:data:`FR_OLDER_NAMES`: torch warns on every rank for an older one); a variable the user
    set, under either name, is kept."""
    prefix = paths.nccl_trace_prefix(attempt)
    if make_folder:  # else observer.py makes it later, once the job holds the run dir
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
    wanted = {
        "TORCH_FR_BUFFER_SIZE": FR_BUFFER,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
    }
    return {
        k: v
        for k, v in wanted.items()
        if k not in environ and FR_OLDER_NAMES.get(k, "") not in environ
    }


def _c10d() -> ModuleType | None:
    """torch's c10d bindings, None in a torch built without distributed support."""
    return getattr(torch._C, "_distributed_c10d", None)


def _with_timeout(fn: Callable[[], T], timeout_s: float) -> T:
    """Run ``fn`` on a helper thread: a recorder wedged behind a hung NCCL call must not stop the
    exit."""
    box: list[T] = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    t.join(timeout_s)
    if not box:
        raise TimeoutError(f"no answer within {timeout_s} s")
    return box[0]


def active_collective(timeout_s: float = 5.0) -> str | None:
    """The collective this process has started and not finished, from the flight recorder, if it
    records."""
    c10d = _c10d()
    dump = getattr(c10d, "_dump_fr_trace_json", None)
    if dump is None:
        return None
    try:
        trace = json.loads(
            _with_timeout(lambda: dump(includeCollectives=True, onlyActive=True), timeout_s)
        )
    except Exception:  # noqa: BLE001 - recorder off or unreadable: fall back to the stack
        return None
    return _active_in(trace)


def _active_in(trace: Mapping[str, Any]) -> str | None:
    """The newest collective a recorder dump shows as enqueued and not completed, on a group whose
    collectives run behind the host's back (NCCL: the loop may sit in its own code while the
    device waits for a peer).

    gloo groups are left to the stack: a gloo collective, or the wait for one started with
    ``async_op``, blocks the calling thread inside a :data:`WAIT_PATHS` frame, so the stack is
    exact; and gloo's recorder is not. It leaves finished entries "scheduled", and its completed
    counter can stay behind a broadcast that returned long ago, which would make a rank asleep in
    its own code look like a peer's victim and keep its node from being left out."""
    entries = trace.get("entries") or []
    for pg, st in (trace.get("pg_status") or {}).items():
        if int(st.get("last_enqueued_collective", -1)) <= int(
            st.get("last_completed_collective", -1)
        ):
            continue
        seq = int(st["last_enqueued_collective"])
        mine = [e for e in entries if str(e.get("pg_id", pg)) == str(pg)]
        if any(str(e.get("profiling_name", "")).startswith("gloo:") for e in mine):
            continue
        names = [e.get("profiling_name") for e in mine if e.get("collective_seq_id") == seq]
        return f"{(names or ['a collective'])[-1]} #{seq} (flight recorder)"
    return None


def dump_flight_recorder(folder: str, rank: int, stacks_budget_s: float = 3.0) -> list[str]:
    """Write what the flight recorders hold; returns a line per recorder saying what happened.

    ``_dump_fr_trace`` is the generic recorder (gloo in torch >= 2.8, verified here on CPU);
    ``_dump_nccl_trace`` is ProcessGroupNCCL's own (CUDA builds; not run here, no GPU). Both return
    a pickle that ``torchfrtrace`` (PyTorch's tools/flight_recorder) reads. A peer that fails in a
    collective should call this too (the error path of ``Observer.watching`` in observer.py):
    torchfrtrace compares the ranks' dumps to name the rank that never joined a collective. The
    first dump that includes stack traces symbolizes them (5-10 s measured here), so the dump
    without them is written first, and the one with them replaces it only if it comes within
    ``stacks_budget_s``.
    """
    c10d = _c10d()
    if c10d is None:
        return ["no flight recorder: this torch has no torch.distributed"]
    done = []
    for fn_name, name in (
        ("_dump_fr_trace", "flight_recorder_rank_"),
        ("_dump_nccl_trace", "nccl_trace_rank_"),
    ):
        fn = getattr(c10d, fn_name, None)
        if fn is None:
            continue
        target = os.path.join(folder, f"{name}{rank}")
        for stacks, budget in ((False, 10.0), (True, stacks_budget_s)):
            try:
                data = _with_timeout(
                    lambda fn=fn, s=stacks: fn(
                        includeCollectives=True, includeStackTraces=s, onlyActive=False
                    ),
                    budget,
                )
                # Not fsynced: the process exits next and the page cache outlives it; an fsync
                # on a slow NFS server would keep a hung rank alive.
                durable.write_atomic(target, data, fsync=False)
                done.append(
                    f"{fn_name}{' with stack traces' if stacks else ''}: "
                    f"{len(data)} bytes in {target}"
                )
            # Best effort; the Python stacks are already on disk.
            except Exception as exc:  # noqa: BLE001
                done.append(
                    f"{fn_name}{' with stack traces' if stacks else ''}: "
                    f"{type(exc).__name__}: {exc}"
                )
    return done or ["no flight recorder in this torch build"]
