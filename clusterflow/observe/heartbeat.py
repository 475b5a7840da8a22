"""Per-rank heartbeats that need no collective: each rank says where it is; `status` reads them all.

The loop calls ``hb.beat(step, phase)`` at every step (and every eval / embedding batch). That call
only stores a tuple and reads a monotonic clock (well under a microsecond, no syscall, no host sync:
``step`` and ``phase`` are Python values the loop already has). A daemon thread wakes every
``dist.heartbeat_s`` seconds and writes what the loop last stored, so a slow NFS server delays a
heartbeat, never a step. The thread also reads NVML for this rank's GPU (memory, utilisation,
temperature: a few ms of driver calls, which is why they are not on the loop's thread either).

Storage: one small JSON file per rank, RUN_DIR/heartbeats/rank<R>.json, replaced atomically
(``storage.durable.write_atomic``: a hidden temp file, then rename), not fsynced (a heartbeat lost
to a crash is replaced 10 s later), and never recreating a run dir moved away under it. At 1,000
ranks and heartbeat_s=10 that is 1,000 files of ~400 bytes (~0.4 MB), 100 replaces per second, i.e.
~400 NFS RPCs/s (open, write, close, rename) and ~40 KB/s into one directory: a small load for any
NFS server, which serves thousands of metadata operations per second. `status` reads the 1,000
files in about a second (~3 RPCs each) and only when someone asks. Per-node aggregation would cut
the writes eightfold but needs a second channel between the ranks of a node, and a hung aggregator
would silence every rank of its node: the very moment a heartbeat must speak. One file per rank
keeps every rank independent. Beyond ~10,000 ranks, raise ``dist.heartbeat_s``.

A record also carries ``progress_at``: the writer keeps running while the loop is stuck in Python
(time.sleep, a lock, a collective), so a fresh ``time`` with an old ``progress_at`` reads "alive but
not moving", while an old ``time`` reads "process gone, frozen with the GIL held, or node down".
And ``paused_from``/``paused_to``: the longest pause between two of this process's writes (the
writer frozen with the process, or held off the GIL), which stays on record after the process
resumes: Slurm's SIGCONT before the SIGTERM that ends a step wakes a frozen (SIGSTOPped) rank,
whose next write would otherwise hide that it had been silent (``job/restarts.py`` reads it).

Efficiency, what ``seff`` and jobstats tell after the fact, measured as the run goes, all on the
writer's thread but the data wait: ``cpu_percent`` (this process's CPU time, every thread, over
the wall time since the last write: 100 is one core busy), ``rss_bytes`` (its resident memory
now, from /proc/self/statm) and ``data_wait_fraction`` (the share of the training steps since the
last write that the loop spent waiting for its next batch: ``run.loader`` reads a clock when a
batch arrives, and the step's start is the clock ``run.step`` already reads).
"""

from __future__ import annotations

import json
import os
import resource
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from clusterflow import rundir
from clusterflow.observe import nvml, stragglers
from clusterflow.rundir import records as run_records
from clusterflow.storage import durable

PHASES = ("train", "eval", "mining embed", "mining wait", "checkpoint")
SILENT_FLOOR_S = 30.0  # clock skew between nodes and NFS attribute caching stay well below this
# A rank whose heartbeat has been quiet for more than SILENT_PERIODS of its periods plus
# SILENT_MARGIN_S, and for at least SILENT_SHARE of the stall watchdog's limit, while a peer
# waits for it in a collective, stopped (SIGSTOP, a thread holding the GIL, a hung node): a live
# rank's writer thread writes once a period whatever its loop does. The share of the limit
# keeps a shared filesystem's caches (a heartbeat seen tens of seconds late) from naming a live
# rank where the limit is minutes.
SILENT_PERIODS, SILENT_MARGIN_S, SILENT_SHARE = 1.5, 2.0, 0.5


def quiet_after(heartbeat_s: float, stall_s: float | None) -> float:
    """How long a rank's heartbeat must have been quiet for that rank to be called stopped."""
    return max(SILENT_PERIODS * heartbeat_s + SILENT_MARGIN_S, SILENT_SHARE * (stall_s or 0.0))


def quietest(
    records: list[dict[str, Any]], now: float, quiet_s: float, exclude: int, since: float
) -> tuple[int, str, float] | None:
    """(rank, host, seconds) of the rank, other than ``exclude``, whose heartbeat has been quiet
    longest at ``now``, if that is more than ``quiet_s``; a rank with no heartbeat since
    ``since`` (the attempt's start) has been quiet since then. Pure."""
    quiet = []
    for rec in records:
        if rec.get("rank") == exclude:
            continue
        age = now - float(rec.get("time") or since)
        if age > quiet_s:
            quiet.append((age, int(rec["rank"]), str(rec.get("host") or "?")))
    if not quiet:
        return None
    age, rank, host = max(quiet)
    return rank, host, round(age, 1)


def watches_peers(rank: int, world: int, local_world: int) -> bool:
    """Whether this rank's watchdog reads its peers' heartbeats while it waits for them: rank 0
    and the first rank of the second node (a hung node takes all its ranks; two readers of
    every heartbeat, not one per rank, keep a hang of thousands of ranks off the shared
    filesystem)."""
    return rank in (0, min(world - 1, max(1, local_world)))


class Progress:
    """What the loop bumps: a call count (any call is progress), the step, the phase, and when.

    One writer (the loop's thread); readers (heartbeat writer, watchdog) take :meth:`snapshot`,
    a tuple replaced whole, so they never see half an update.
    """

    def __init__(self) -> None:
        self._state: tuple[int, int, str, float, float | None] = (0, 0, "", 0.0, None)
        # (training steps with a busy time, their busy seconds): two adds per step.
        self.busy: tuple[int, float] = (0, 0.0)
        # (seconds waited for batches, seconds of the steps they belong to): two adds per step.
        self.waited: tuple[float, float] = (0.0, 0.0)

    def bump(
        self,
        step: int,
        phase: str,
        step_time_s: float | None = None,
        busy_s: float | None = None,
        wait_s: float | None = None,
        step_s: float | None = None,
    ) -> None:
        self._state = (self._state[0] + 1, step, phase, time.monotonic(), step_time_s)
        if busy_s is not None:
            n, total = self.busy
            self.busy = (n + 1, total + busy_s)
        if wait_s is not None and step_s is not None:
            waited, stepped = self.waited
            self.waited = (waited + wait_s, stepped + step_s)

    def snapshot(self) -> tuple[int, int, str, float, float | None]:
        """(count, step, phase, monotonic time of the last bump, step time the loop passed or
        None)."""
        return self._state


class Heartbeat:
    """``Heartbeat(paths, rank, host, every_s).beat(step=..., phase=...)``; ``close()`` at exit.

    ``gpu`` is this rank's GPU as NVML knows it (an index or a ``GPU-...`` UUID; see
    :func:`clusterflow.observe.nvml.nvml_id_for_torch_device`), None on CPU. With
    ``gather=True`` (rank 0) the thread also reads every rank's file after writing its own, so
    :meth:`ranks` hands the trainer a fresh per-rank list for TensorBoard without a collective or
    a read on the loop's thread.
    """

    def __init__(
        self,
        paths: rundir.RunPaths,
        rank: int,
        host: str | None = None,
        every_s: float = 10.0,
        *,
        gpu: int | str | None = None,
        gather: bool = False,
        start: bool = True,
        snapshot: Callable[[], list[dict[str, Any]] | None] = nvml.read_snapshot,
    ) -> None:
        self.paths, self.rank, self.every_s = paths, rank, float(every_s)
        self.host = host or socket.gethostname()
        self.gpu, self.gather, self._snapshot = gpu, gather, snapshot
        self.progress = Progress()
        # Step, monotonic time, phase at the last write.
        self._last: tuple[int, float, str] | None = None
        self._step_time: float | None = None
        self._ranks: list[dict[str, Any]] = []
        self._busy_at_write: tuple[int, float] = (0, 0.0)
        self._busy_s: float | None = None
        self._waited_at_write: tuple[float, float] = (0.0, 0.0)
        self._wait_fraction: float | None = None
        # (this process's CPU seconds, monotonic seconds) at the last write
        self._cpu_at_write = (time.process_time(), time.monotonic())
        # The wall-clock time of the last record, and the longest pause between two of them.
        self._recorded_at: float | None = None
        self._paused: tuple[float, float] | None = None
        # Rank 0: called with every rank's records after each gather (the straggler watch).
        self.watch: Callable[[list[dict[str, Any]]], None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        os.makedirs(self.paths.heartbeats, exist_ok=True)
        if start:
            self._thread = threading.Thread(
                target=self._run, name=f"clusterflow-heartbeat-{rank}", daemon=True
            )
            self._thread.start()

    def beat(
        self,
        step: int,
        phase: str = "train",
        step_time_s: float | None = None,
        busy_s: float | None = None,
        wait_s: float | None = None,
        step_s: float | None = None,
    ) -> None:
        """Called by the loop as often as it likes; costs a tuple and a clock read. ``wait_s``:
        the seconds a training step waited for its batches, of its ``step_s``."""
        self.progress.bump(step, phase, step_time_s, busy_s, wait_s, step_s)

    def ranks(self) -> list[dict[str, Any]]:
        """Rank 0 with gather=True: every rank's latest record, as :func:`read_ranks` gives it."""
        return self._ranks

    def write(self) -> dict[str, Any]:
        """Write this rank's record now (the thread does it every ``every_s``); returns the
        record."""
        record = self.record()
        durable.write_atomic(
            self.paths.heartbeat_file(self.rank), json.dumps(record), fsync=False, make_folder=False
        )
        return record

    def record(self) -> dict[str, Any]:
        count, step, phase, at, passed = self.progress.snapshot()
        mono, wall = time.monotonic(), time.time()
        self._update_step_time(step, phase, at, passed)
        self._update_busy()
        self._update_wait()
        self._update_paused(wall)
        rec: dict[str, Any] = {
            "rank": self.rank,
            "host": self.host,
            "pid": os.getpid(),
            "time": wall,
            "step": step,
            "phase": phase or "starting",
            "beats": count,
            "progress_at": wall - (mono - at) if count else None,
            "step_time_s": self._step_time,
            "busy_s": self._busy_s,
            "heartbeat_s": self.every_s,
            "paused_from": self._paused[0] if self._paused else None,
            "paused_to": self._paused[1] if self._paused else None,
            "cpu_percent": self._cpu_percent(mono),
            "rss_bytes": rss_bytes(),
            "data_wait_fraction": self._wait_fraction,
        }
        if self.gpu is not None:
            rec.update(nvml.gpu_fields(nvml.find_gpu(self._snapshot(), self.gpu)))
        return rec

    def _update_step_time(self, step: int, phase: str, at: float, passed: float | None) -> None:
        """Mean seconds per training step since the last write: wall time, so no CUDA sync is
        needed."""
        if passed is not None:
            self._step_time = float(passed)
        elif self._last and phase == "train" == self._last[2] and step > self._last[0]:
            self._step_time = (at - self._last[1]) / (step - self._last[0])
        self._last = (step, at, phase)

    def _update_busy(self) -> None:
        """Mean busy seconds per training step since the last write (kept when no step
        passed)."""
        n, total = self.progress.busy
        n0, total0 = self._busy_at_write
        if n > n0:
            self._busy_s = (total - total0) / (n - n0)
        self._busy_at_write = (n, total)

    def _update_wait(self) -> None:
        """The share of the training steps since the last write spent waiting for batches (kept
        when no step passed)."""
        waited, stepped = self.progress.waited
        waited0, stepped0 = self._waited_at_write
        if stepped > stepped0:
            self._wait_fraction = round(
                min(1.0, max(0.0, (waited - waited0) / (stepped - stepped0))), 4
            )
        self._waited_at_write = (waited, stepped)

    def _cpu_percent(self, mono: float) -> float | None:
        """This process's CPU use (all its threads) since the last write, in percent of a
        core."""
        cpu = time.process_time()
        cpu0, mono0 = self._cpu_at_write
        self._cpu_at_write = (cpu, mono)
        if mono - mono0 <= 0:
            return None
        return round(100.0 * (cpu - cpu0) / (mono - mono0), 1)

    def _update_paused(self, wall: float) -> None:
        """The longest pause between two records of this process so far."""
        last, self._recorded_at = self._recorded_at, wall
        if last is None:
            return
        if self._paused is None or wall - last > self._paused[1] - self._paused[0]:
            self._paused = (last, wall)

    def close(self) -> None:
        """Stop the thread and leave a last record (phase as the loop left it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.every_s + 5)
        try:
            self.write()
        except OSError:
            pass

    def _run(self) -> None:
        while True:
            try:
                self.write()
                if self.gather:
                    self._ranks = read_ranks(self.paths, self.every_s)
                    if self.watch is not None:
                        self.watch(self._ranks)
            # A full disk or a flaky NFS must never end the run; retried next tick.
            except Exception:  # noqa: BLE001
                pass
            if self._stop.wait(self.every_s):
                return


_PAGE = resource.getpagesize()


def rss_bytes() -> int | None:
    """This process's resident memory now (Linux's /proc/self/statm), None where there is none."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


# -- reading ------------------------------------------------------------------------------------


def read_ranks(
    paths: rundir.RunPaths,
    heartbeat_s: float,
    *,
    now: float | None = None,
    since: float | None = None,
    world_size: int | None = None,
    damaged: list[str] | None = None,
    straggler_ratio: float = 0.0,
) -> list[dict[str, Any]]:
    """Every rank's latest heartbeat, oldest rank first, with ``heartbeat_age_s``,
    ``progress_age_s`` and the marks ``straggler`` (above ``straggler_ratio``, 0: none) and
    ``silent``.

    ``since`` (the attempt's start) drops records an earlier attempt left; with ``world_size``, a
    rank that has not written yet in this attempt is listed too, as silent with no phase. A record
    that does not fit its schema is named in ``damaged`` (when given); its other fields are kept,
    and one without a rank is dropped.
    """
    now = time.time() if now is None else now
    folder = paths.heartbeats
    records: dict[int, dict[str, Any]] = {}
    try:
        names = os.listdir(folder)
    except OSError:  # missing, or a file where the folder should be
        names = []
    for name in names:
        if not (name.startswith("rank") and name.endswith(".json")):
            continue
        rec, said = run_records.read_checked(
            os.path.join(folder, name),
            run_records.HEARTBEAT,
            f"heartbeats/{name}",
            within=paths.root,
        )
        if damaged is not None:
            damaged += said
        if rec is None or (since is not None and (rec.get("time") or 0) < since):
            continue
        if world_size is not None and rec["rank"] >= world_size:
            continue  # a larger earlier attempt's rank
        records[rec["rank"]] = rec
    if world_size is not None:
        for r in range(world_size):
            records.setdefault(
                r, {"rank": r, "host": None, "step": None, "phase": None, "time": None}
            )
    return mark([records[r] for r in sorted(records)], heartbeat_s, now, straggler_ratio)


def mark(
    records: list[dict[str, Any]], heartbeat_s: float, now: float, straggler_ratio: float = 0.0
) -> list[dict[str, Any]]:
    """Ages and marks, pure. Silent: no heartbeat for max(3 x heartbeat_s, 30 s). Straggler: a
    training rank whose own part of a step (``busy_s``) is above ``straggler_ratio`` x the median
    of the other training ranks' on this read: the straggler watch's score
    (``observe/stragglers.py``), which names a rank once it stays there for
    ``observe.straggler_window_s``. Adds ``busy_ratio`` and ``median_busy_s`` to each scored
    rank."""
    silent_after = max(3 * heartbeat_s, SILENT_FLOOR_S)
    out = []
    for rec in records:
        r = dict(rec)
        r["heartbeat_age_s"] = (
            None if r.get("time") is None else round(max(0.0, now - r["time"]), 1)
        )
        r["progress_age_s"] = (
            None if r.get("progress_at") is None else round(max(0.0, now - r["progress_at"]), 1)
        )
        r["silent"] = r["heartbeat_age_s"] is None or r["heartbeat_age_s"] > silent_after
        r["straggler"] = False
        out.append(r)
    scores = stragglers.scores(out)
    for r in out:
        scored = scores.get(int(r["rank"]))
        if scored is not None:
            r["busy_ratio"], r["median_busy_s"] = round(scored[0], 3), scored[1]
            r["straggler"] = straggler_ratio > 0 and scored[0] > straggler_ratio
    return out


def summary(ranks: list[dict[str, Any]]) -> str | None:
    """One line naming stragglers and silent ranks, or None when all is well."""
    parts = []
    for r in ranks:
        who = f"rank {r['rank']} on {r.get('host') or '?'}"
        if r["silent"] and r["heartbeat_age_s"] is None:
            parts.append(f"rank {r['rank']} has sent no heartbeat in this attempt")
        elif r["silent"]:
            parts.append(f"{who} is silent (last heartbeat {r['heartbeat_age_s']:.0f} s ago)")
        elif r["straggler"]:
            parts.append(
                f"{who} straggles ({r['busy_s']:.3f} s of its own work a step, "
                f"{r['busy_ratio']:.2f}x the others' median {r['median_busy_s']:.3f} s)"
            )
    return "; ".join(parts) or None


def render(ranks: list[dict[str, Any]]) -> str:
    """The table of `status --ranks`."""
    head = (
        f"{'rank':>4}  {'host':<12} {'step':>7}  {'phase':<13} {'beat':>6} {'moved':>6} "
        f"{'s/step':>7} {'cpu':>6} {'rss':>9} {'data wait':>9}  {'gpu mem':>13} {'util':>5} "
        f"{'temp':>5}  marks"
    )
    lines = [head]
    for r in ranks:
        mem = (
            f"{r['gpu_mem_used_mb'] / 1024:.1f}/{r['gpu_mem_total_mb'] / 1024:.0f} GiB"
            if r.get("gpu_mem_used_mb") is not None and r.get("gpu_mem_total_mb")
            else "-"
        )
        marks = ",".join(m for m in ("silent", "straggler") if r.get(m))
        lines.append(
            f"{r['rank']:>4}  {r.get('host') or '?'!s:<12} {_num(r.get('step'), '{}'):>7}  "
            f"{r.get('phase') or '-'!s:<13} "
            f"{_num(r['heartbeat_age_s'], '{:.0f}s'):>6} "
            f"{_num(r.get('progress_age_s'), '{:.0f}s'):>6} "
            f"{_num(r.get('step_time_s'), '{:.3f}'):>7} "
            f"{_num(r.get('cpu_percent'), '{:.0f}%'):>6} {_bytes(r.get('rss_bytes')):>9} "
            f"{_num(r.get('data_wait_fraction'), '{:.0%}'):>9}  {mem:>13} "
            f"{_num(r.get('gpu_util_pct'), '{}%'):>5} "
            f"{_num(r.get('gpu_temp_c'), '{}C'):>5}  {marks}"
        )
    return "\n".join(lines)


def _num(value: object, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _bytes(value: object) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.0f} MiB"


def tensorboard_scalars(ranks: list[dict[str, Any]]) -> dict[str, float]:
    """Per-rank step time, busy time (a rank's own part of a step, what the straggler watch
    scores), CPU use, resident memory and data wait, and per-GPU memory/utilisation of every
    node, for rank 0's writer."""
    out: dict[str, float] = {}
    for r in ranks:
        if r["silent"]:
            continue
        if r.get("step_time_s") is not None:
            out[f"ranks/step_time_s/rank{r['rank']}"] = float(r["step_time_s"])
        if r.get("busy_s") is not None:
            out[f"ranks/busy_s/rank{r['rank']}"] = float(r["busy_s"])
        for key in ("cpu_percent", "data_wait_fraction"):
            if r.get(key) is not None:
                out[f"ranks/{key}/rank{r['rank']}"] = float(r[key])
        if r.get("rss_bytes") is not None:
            out[f"ranks/rss_gb/rank{r['rank']}"] = r["rss_bytes"] / 2**30
        gpu = f"gpus/{r.get('host')}/gpu{r.get('gpu_index')}"
        if r.get("gpu_mem_used_mb") is not None:
            out[f"{gpu}/mem_used_gb"] = r["gpu_mem_used_mb"] / 1024
        if r.get("gpu_util_pct") is not None:
            out[f"{gpu}/util_pct"] = float(r["gpu_util_pct"])
    return out
