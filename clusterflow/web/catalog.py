"""The dashboard's picture of its runs, kept fresh by one poll: what changed on disk is read
again by the readers that own each fact, at a bounded cost.

- A run's summary is ``manage.status.collect`` (the state and its verdict, progress, ranks from
  the heartbeats, goodput, mining rounds, the sample ledger): collected again when one of the
  files it reads changed (one ``stat`` each, :func:`signature`), at most every
  :data:`CHANGED_EVERY_S` (:data:`WATCHED_EVERY_S` for a run a page shows), and every
  :data:`ALIVE_EVERY_S` while it has not ended (a process that died writes nothing; the verdict
  sees it). A poll collects for at most :data:`BUDGET_S`, newest changes of watched runs first,
  so hundreds of busy runs never starve the server; the rest wait for the next poll.
- A run a page shows also gets its goodput ledger per attempt (``observe.goodput``), each
  attempt's first cause (``rundir.first_error``) and its feeds (``feeds.py``: metrics and logs
  read on from offsets). A run a compare page shows (``watch(..., follow=True)``) gets its
  metrics feed only; its records are collected at the Runs page's pace.
- Slurm is asked once per :data:`QUEUE_EVERY_S` for every job the runs name, with each job's
  times (``slurm.commands.queued_jobs``: the job panel's time limit, time left, pending reason
  and expected start), never once per run.
- Nothing is written into a run dir here.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from clusterflow import rundir
from clusterflow.config import masking
from clusterflow.errors import UserError
from clusterflow.manage import status as run_status
from clusterflow.observe import goodput
from clusterflow.rundir import first_error, saved_config, states
from clusterflow.slurm import commands as slurm_commands
from clusterflow.sweeps import index as sweep_index
from clusterflow.web import discover
from clusterflow.web.feeds import LogFeed, MetricFeed

SCAN_EVERY_S = 5.0  # look for new runs
POLL_EVERY_S = 1.0  # stat every run's records
WATCHED_POLL_S = 0.25  # a shown run's records and feeds
CHANGED_EVERY_S = 2.0
WATCHED_EVERY_S = 0.5
ALIVE_EVERY_S = 30.0
WATCHED_ALIVE_EVERY_S = 5.0
BUDGET_S = 0.25
QUEUE_EVERY_S = 5.0
GPUS_EVERY_S = 2.0
# A run no page shows keeps its feeds this long (a reload finds them), and at most this many.
LINGER_S = 60.0
MAX_FED = 8

Snapshot = Callable[[], list[dict[str, Any]] | None]
StatKey = tuple[int, int, int] | None


def _stat(path: str) -> StatKey:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def signature(paths: rundir.RunPaths) -> tuple[StatKey, ...]:
    """What ``status.collect`` reads, as one stat each: a file replaced atomically changes its
    folder's time, a record appended its size, a new heartbeat or timeline its folder's."""
    return tuple(
        _stat(p)
        for p in (
            paths.root,
            paths.config,
            paths.status,
            paths.attempts,
            paths.heartbeats,
            paths.timelines,
            paths.restarts,
            paths.stragglers,
            paths.stops,
            paths.submissions,
            paths.errors,
            paths.lease,
            paths.checkpoints,
            paths.logs,
        )
    )


Queued = slurm_commands.QueuedJob


class QueueCache:
    """squeue's answer for every job the runs named lately, with its times, asked in one call
    per :data:`QUEUE_EVERY_S`. Until its first answer a job reads as "squeue did not answer"
    (``status`` then goes by the run's records and its lease), and the runs that asked are
    collected again once it comes, or once its state changes (not when only its clock moved:
    the page counts the time down from the answer it has)."""

    def __init__(
        self,
        ask: Callable[[Iterable[str]], dict[str, Queued | None] | None] = (
            slurm_commands.queued_jobs
        ),
    ) -> None:
        self.ask = ask
        self.answers: dict[str, Queued | None] = {}
        self.wanted: dict[str, float] = {}
        self.asked_at: float | None = None
        self.held_at: float | None = None  # a new job waits for the runs not yet collected

    def state(self, job_id: str) -> str | None:
        """``STATE|REASON``, "" when squeue does not list the job, None before an answer."""
        self.wanted[str(job_id)] = time.monotonic()
        if str(job_id) not in self.answers:
            return None
        job = self.answers[str(job_id)]
        return job.line if job is not None else ""

    def job(self, job_id: str) -> Queued | None:
        return self.answers.get(str(job_id))

    def refresh(self, now: float, waiting: bool = False) -> set[str]:
        """Ask squeue when due; the jobs whose answer changed (state, reason, limit, nodes or
        expected start). A job no answer has yet is asked about at once, unless ``waiting``:
        runs not collected yet will name theirs soon, and one call asks for all of them (it
        waits for them at most :data:`QUEUE_EVERY_S`)."""
        if not self.wanted:
            return set()
        due = self.asked_at is not None and now - self.asked_at >= QUEUE_EVERY_S
        new = any(j not in self.answers for j in self.wanted)
        if new and waiting:
            self.held_at = now if self.held_at is None else self.held_at
            new = now - self.held_at >= QUEUE_EVERY_S
        if not (due or new):
            return set()
        self.asked_at, self.held_at = now, None
        self.wanted = {j: t for j, t in self.wanted.items() if now - t < 10 * QUEUE_EVERY_S}
        answers = self.ask(list(self.wanted)) or {}
        changed = {
            j for j in self.wanted if _settled(answers.get(j)) != _settled(self.answers.get(j))
        }
        self.answers = answers
        return changed


def _settled(job: Queued | None) -> tuple[object, ...] | None:
    """What of squeue's answer changes only when the job does (its clock moves every second)."""
    if job is None:
        return None
    return (job.line, job.time_limit_s, job.start_at, job.nodes, job.scheduled_nodes)


class RunEntry:
    """One run dir as the dashboard holds it."""

    def __init__(self, found: discover.Found) -> None:
        self.found = found
        self.id, self.name = found.id, found.name
        self.paths = rundir.RunPaths(found.root)
        self.sig: tuple[StatKey, ...] | None = None  # the records as last seen
        self.collected_sig: tuple[StatKey, ...] | None = None  # ... as last collected
        self.changed_at = 0.0
        self.collected_at = 0.0
        self.plain: tuple[dict[str, Any], str] | None = None
        self.plain_key: StatKey = None
        self.status: dict[str, Any] | None = None
        self.problem = ""
        self.version = 0
        self.jobs: set[str] = set()  # the Slurm jobs its last collect asked about
        # For a run a page shows:
        self.watchers = 0
        # Compare pages that show it: its metrics are followed, as for a page of its own, but
        # its records are collected at the pace of the Runs page (a compare page shows its row).
        self.followers = 0
        self.watched_at = 0.0
        self.ledger: dict[str, Any] | None = None
        self.first_errors: dict[int, dict[str, Any]] = {}
        self.metrics: MetricFeed | None = None
        self.logs: dict[int, LogFeed] = {}

    @property
    def state(self) -> str | None:
        return (self.status or {}).get("state")

    @property
    def unread(self) -> bool:
        """No collect has read its records yet."""
        return self.status is None and not self.problem

    @property
    def config(self) -> dict[str, Any]:
        return self.plain[0] if self.plain else {}

    def due(self, now: float) -> bool:
        if self.unread:
            return True
        since = now - self.collected_at
        watched = self.watchers > 0
        if watched and self.ledger is None:
            return True  # a page opened: its attempts' timeline is read once now
        if self.sig != self.collected_sig:
            return since >= (WATCHED_EVERY_S if watched else CHANGED_EVERY_S)
        alive_every = WATCHED_ALIVE_EVERY_S if watched else ALIVE_EVERY_S
        return not states.ended(self.state) and since >= alive_every

    def collect(self, queue: QueueCache, now: float) -> bool:
        """Collect again; True when what the pages show changed."""
        sig = self.sig
        key = _stat(self.paths.config)
        asked: set[str] = set()

        def queue_state(job_id: str) -> str | None:
            asked.add(str(job_id))
            return queue.state(job_id)

        problem, got = "", None
        try:
            if self.plain is None or key != self.plain_key:
                self.plain, self.plain_key = saved_config.read_plain(self.paths), key
            got = run_status.collect(self.paths, queue_state, self.plain, queue.job)
        except UserError as exc:
            problem = masking.mask_text(str(exc))  # a damaged record's text may quote a secret
        except Exception as exc:  # noqa: BLE001 - one run dir a reader chokes on must not stop the others
            said = masking.mask_text(str(exc))
            problem = f"its records could not be read ({type(exc).__name__}: {said})"
        if self.watchers:
            self._watched_records(got)
        self.collected_sig, self.collected_at, self.jobs = sig, now, asked
        if got is not None:
            got.pop("latest_checkpoint_age_s", None)  # a clock, not a change
        if got == self.status and problem == self.problem:
            return False
        self.status, self.problem = got, problem
        self.version += 1
        return True

    def _watched_records(self, got: dict[str, Any] | None) -> None:
        running = (got or {}).get("state") == states.RUNNING
        try:
            self.ledger = goodput.ledger(self.paths, running=running)
        except Exception:  # noqa: BLE001 - the summary still shows; the timeline waits
            self.ledger = None
        attempts = [r["attempt"] for r in (self.ledger or {}).get("attempts", [])]
        self.first_errors = {
            n: e for n in attempts if (e := first_error.read(self.paths, n)) is not None
        }

    def feed(self, log_ranks: Iterable[int]) -> bool:
        """Read the metrics and the shown ranks' logs on; True when any changed."""
        if self.metrics is None:
            self.metrics = MetricFeed(self.paths)
        changed = self.metrics.update()
        for rank in log_ranks:
            if rank not in self.logs:
                self.logs[rank] = LogFeed(self.paths, rank)
            changed |= self.logs[rank].update()
        return changed

    def drop_feeds(self) -> None:
        self.metrics, self.logs = None, {}


class Sweep:
    """A sweep dir: its index, read again when it changes; its members' rows come from their
    runs' summaries (``manage.sweep_status``)."""

    def __init__(self, found: discover.Found) -> None:
        self.found = found
        self.id, self.name = found.id, found.name
        self.paths = rundir.RunPaths(found.root)
        self.index: dict[str, Any] | None = None
        self.problem = ""
        self.key: StatKey = None
        self.version = 0

    def update(self) -> bool:
        key = _stat(self.paths.sweep_index)
        if key == self.key:
            return False
        self.key = key
        try:
            self.index, self.problem = sweep_index.read_index(self.paths), ""
        except UserError as exc:
            self.index, self.problem = None, masking.mask_text(str(exc))
        self.version += 1
        return True


class Catalog:
    """Every run and sweep under the PATHs, and the poll that keeps them fresh (one thread calls
    :meth:`poll`; pages read under :attr:`lock`)."""

    def __init__(
        self,
        given: list[str],
        snapshot: Snapshot,
        queue: QueueCache | None = None,
    ) -> None:
        self.finder = discover.Finder(given)
        self.snapshot = snapshot
        self.queue = queue or QueueCache()
        self.lock = threading.Lock()
        self.runs: dict[str, RunEntry] = {}
        self.sweeps: dict[str, Sweep] = {}
        self.version = 0  # the set of runs and sweeps
        self.gpus: list[dict[str, Any]] | None = None
        # run id -> how many pages show each rank's log
        self.log_ranks: dict[str, Counter[int]] = {}
        self._scanned = self._polled = self._gpus_at = -1e9

    # -- what pages ask -------------------------------------------------------------------------

    def watch(self, run_id: str, log_rank: int | None, delta: int, follow: bool = False) -> None:
        """A page showing ``run_id`` (and a rank's log) opened (+1) or closed (-1); ``follow``:
        a compare page, which wants its metrics only."""
        with self.lock:
            run = self.runs.get(run_id)
            if run is None:
                return
            if follow:
                run.followers = max(0, run.followers + delta)
            else:
                run.watchers = max(0, run.watchers + delta)
            run.watched_at = time.monotonic()
            if log_rank is not None:
                shown = self.log_ranks.setdefault(run_id, Counter())
                shown[log_rank] += delta
                if shown[log_rank] <= 0:
                    del shown[log_rank]
                    run.logs.pop(log_rank, None)

    # -- the poll -------------------------------------------------------------------------------

    def poll(self, now: float | None = None) -> bool:
        """One round: new runs, changed records, watched feeds, GPUs. True when anything a page
        shows changed."""
        now = time.monotonic() if now is None else now
        changed = False
        if now - self._scanned >= SCAN_EVERY_S:
            self._scanned = now
            changed |= self._scan()
        full = now - self._polled >= POLL_EVERY_S
        if full:
            self._polled = now
        waiting = any(r.unread for r in self.runs.values())
        for job in self.queue.refresh(now, waiting):
            for run in list(self.runs.values()):
                if job in run.jobs:
                    run.collected_sig = None  # its job's answer changed: collect again
        changed |= self._collect(now, full)
        changed |= self._feed(now)
        if now - self._gpus_at >= GPUS_EVERY_S:
            self._gpus_at = now
            changed |= self._read_gpus()
        return changed

    def _scan(self) -> bool:
        found = self.finder.scan()
        with self.lock:
            before = set(self.runs) | set(self.sweeps)
            runs = {f.id: f for f in found.values() if f.kind == discover.RUN}
            sweeps = {f.id: f for f in found.values() if f.kind == discover.SWEEP}
            self.runs = {
                i: self.runs[i] if i in self.runs and self.runs[i].found == f else RunEntry(f)
                for i, f in runs.items()
            }
            self.sweeps = {
                i: self.sweeps[i] if i in self.sweeps and self.sweeps[i].found == f else Sweep(f)
                for i, f in sweeps.items()
            }
            # The first search changes the page even when it found nothing: it says so.
            changed = set(self.runs) | set(self.sweeps) != before or self.version == 0
            if changed:
                self.version += 1
        for sweep in list(self.sweeps.values()):
            changed |= sweep.update()
        return changed

    def _collect(self, now: float, full: bool) -> bool:
        runs = list(self.runs.values())
        for run in runs:
            if full or run.watchers:
                sig = signature(run.paths)
                if sig != run.sig:
                    run.sig, run.changed_at = sig, run.changed_at if run.sig is None else now
        due = [r for r in runs if r.due(now)]
        due.sort(key=lambda r: (not r.watchers, r.status is not None, r.changed_at))
        changed = False
        start = time.perf_counter()
        for run in due:  # at least one a round, however slow
            # No lock: a collect publishes whole new objects, which pages read as they are.
            changed |= run.collect(self.queue, now)
            if time.perf_counter() - start > BUDGET_S:
                break
        return changed

    def _feed(self, now: float) -> bool:
        changed = False
        fed = sorted(
            (r for r in self.runs.values() if r.metrics is not None or r.watchers or r.followers),
            key=lambda r: (r.watchers + r.followers > 0, r.watched_at),
            reverse=True,
        )
        for i, run in enumerate(fed):
            shown = run.watchers or run.followers
            if not shown and (i >= MAX_FED or now - run.watched_at > LINGER_S):
                with self.lock:
                    run.drop_feeds()
                    self.log_ranks.pop(run.id, None)
                continue
            if shown:
                with self.lock:
                    changed |= run.feed(sorted(self.log_ranks.get(run.id) or ()))
        return changed

    def _read_gpus(self) -> bool:
        try:
            gpus = self.snapshot()
        except Exception:  # noqa: BLE001 - a driver that fails must not stop the dashboard
            gpus = None
        if gpus == self.gpus:
            return False
        self.gpus = gpus
        return True
