"""One attempt of a job on this rank, whatever trains in it (a task's trainer, a script of the
user's own): read the environment, join the process group, take the run dir and agree on rank 0's
config, record the attempt, install the stop signals, watch the rank (heartbeats, stall
watchdog); at the end, hand the outcome to ``requeue.after_stop`` (exit, requeue, or fail) and
let go. ``run_job`` (a task) and ``clusterflow.start()`` (a script) both go through
:class:`Attempt`, so each of these guarantees has one implementation; the training itself is a
``train.session.Run`` that the attempt opens.

Requeue carries no state: the store holds it, and the next attempt resumes through the same code
as a fresh start.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import logging
import os
import socket
import sys
import warnings
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from clusterflow import rundir
from clusterflow.config.job_config import Config, from_dict
from clusterflow.distributed import comm as dist
from clusterflow.distributed.env import DistEnv
from clusterflow.errors import (
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_OK,
    EXIT_REQUEUE_OUTSIDE,
    RunFailed,
    UserError,
)
from clusterflow.job import failure, node_fault, restarts
from clusterflow.job.requeue import REQUEUE_OUTSIDE, after_stop
from clusterflow.observe import events, timeline
from clusterflow.observe import observer as observe
from clusterflow.observe.context import JobContext
from clusterflow.rundir import (
    cancel_marker,
    first_error,
    lease,
    saved_config,
    states,
    transitions,
)
from clusterflow.rundir import timeline as rundir_timeline
from clusterflow.rundir.states import State, StopReason
from clusterflow.slurm import commands as slurm_commands
from clusterflow.slurm import jobids
from clusterflow.train.preemption import EndWatch, Preemption
from clusterflow.train.seeds import GlobalSeeds
from clusterflow.train.session import Amp, Run, RunInternals

log = logging.getLogger("clusterflow")

# The outcomes after which the process exits 0: the run completed, or saved and stopped for a
# reason that brings it back (a requeue) or that the user chose.
_OK = (State.COMPLETED, StopReason.PREEMPTED, State.REQUEUED, State.CANCELLED, State.STOPPED)


def exit_code(outcome: str) -> int:
    """The process's exit status after a job's ``outcome``: 130 after Ctrl-C (saved; the same
    command resumes), 75 when the batch script outside must requeue the job, 0 for a completed or
    requeued run, 1 otherwise."""
    if outcome == StopReason.INTERRUPTED:
        return EXIT_INTERRUPTED
    if outcome == REQUEUE_OUTSIDE:
        return EXIT_REQUEUE_OUTSIDE
    return EXIT_OK if outcome in _OK else EXIT_JOB_FAILED


class Attempt:
    """This rank's share of one attempt. ``code_file``: the script a failure's traceback is
    searched in for the frame to name (None: the task's module)."""

    def __init__(
        self,
        config: Mapping[str, Any] | Config,
        environ: Mapping[str, str] | None = None,
        code_file: str | None = None,
    ) -> None:
        # Where the start-up goes, from this process's start: its interpreter, imports and config
        # end here; the attempt marks its own phases, the run the rest up to the first step.
        self.startup = timeline.Startup(timeline.process_started_at())
        self.startup.mark(timeline.IMPORTS)
        if not faulthandler.is_enabled():
            # A fatal signal in native code (gloo's abort, a segfault) leaves its name and the
            # Python stack on stderr, where `submit --local` names it and Slurm's log keeps it.
            with contextlib.suppress(ValueError, OSError, RuntimeError):  # no stderr to write to
                faulthandler.enable(file=sys.__stderr__ or 2, all_threads=True)
        self.environ = os.environ if environ is None else environ
        self.env = DistEnv.from_env(self.environ)
        self.cfg = config if isinstance(config, Config) else from_dict(dict(config))
        self.paths = rundir.RunPaths(self.cfg.run.dir)  # built once here, passed down
        self.code_file = code_file
        # Until this job holds the run dir, nothing is written there (not even an error).
        self.held = False
        self.device = torch.device("cpu")
        self.attempt = 0
        self.preemption = Preemption()
        self.run: Run | None = None
        self.internals: RunInternals | None = None  # the run's, for the trainer and the close
        self.outcome: str | None = None
        self._watch: AbstractContextManager[None] | None = None
        self.events = events.OnEvent("", self.paths)

    def begin(self) -> bool:
        """Collective. Join the group, take the run dir, record the attempt, install the stop
        signals. False when the user cancelled the run before this job started, or when the run
        completed and this launch asks for nothing more: the job has ended then (``outcome``
        cancelled, or completed), no attempt recorded."""
        env, paths = self.env, self.paths
        # The flight recorder reads its variables when the group starts.
        observe.before_init(paths, self.environ)
        self.device = dist.init(env, self.cfg.dist.backend, self.cfg.dist.timeout_s)
        self.startup.mark(timeline.RENDEZVOUS)
        # Every rank runs on rank 0's resolved config, never on a file re-read later.
        answer, done = _take_run_dir(env, self.cfg, paths, self.environ)
        self.cfg = from_dict(answer)
        self.held = True
        self.events = events.OnEvent(
            self.cfg.observe.on_event, paths, f"rank {env.rank} on {socket.gethostname()}"
        )
        if _cancelled_before_start(env, paths):
            self.outcome = _end_cancelled(paths, env, self.environ)
            return False
        if done is not None:
            self.outcome = _end_completed(paths, env, done)
            return False
        self.attempt = _start(env, self.cfg, paths, self.device)
        _threads(env, self.environ)
        # Rank 0 looks for the user's cancel, and watches the job's end, while training; the
        # agreement tells the others.
        self.preemption = Preemption(
            (lambda: cancel_marker.is_cancelled(paths)) if env.is_main else None,
            end=_end_watch(env, self.cfg, paths, self.environ),
        ).install()
        self.startup.mark(timeline.RUN_DIR)
        return True

    def open_run(
        self, amp: Amp, what: str, seeds: GlobalSeeds | None = None
    ) -> tuple[Run, RunInternals]:
        """The run that trains in this attempt, watched (heartbeats, stall watchdog) until the
        attempt ends, with its :class:`RunInternals` (what the task trainer and the attempt's close
        need beyond the library API); ``seeds``: a script's global random streams (None: a
        task's)."""
        ctx = JobContext(self.cfg, self.paths, self.attempt)
        run = Run(
            ctx,
            self.device,
            self.preemption,
            self.end,
            amp=amp,
            what=what,
            startup=self.startup,
            seeds=seeds,
        )
        stalled = functools.partial(
            _requeue_after_stall, cfg=self.cfg, paths=self.paths, env=self.env, environ=self.environ
        )
        watcher = observe.Observer(
            self.cfg,
            self.paths,
            self.env.rank,
            self.attempt,
            self.device,
            after_stall=stalled,
            world=(self.env.world_size, self.env.local_world_size),
        )
        self._watch = watcher.watching(ctx.phases)
        self._watch.__enter__()
        self.run, self.internals = run, RunInternals(run)
        return run, self.internals

    def end(self, outcome: str) -> tuple[str, int]:
        """Collective. The attempt ended with ``outcome`` (completed, or the agreed stop reason):
        rank 0 records it and requeues or not (``after_stop``); every rank learns the job's
        outcome, and the group is shut down. Returns (the job's outcome, the exit status)."""
        self._unwatch(None)
        if self.env.is_main:
            stop = self.preemption.stop_record(outcome)
            if self.run is not None:
                stop["step"] = self.run.global_step
            outcome = after_stop(
                self.paths,
                outcome,
                self.env,
                self.environ,
                self.cfg.cluster.max_timeout_requeues,
                stop,
            )
            _let_go(self.paths, self.environ, outcome)
            _tell(self.events, self.paths, self.attempt, outcome)
        outcome = dist.broadcast_object(outcome)
        dist.barrier()  # nobody tears the group down while a peer still talks to it
        dist.shutdown()
        self.events.settle()
        self.outcome = outcome
        if outcome == State.COMPLETED:  # nothing left to save: a signal ends the process again
            self.preemption.uninstall()
        return outcome, exit_code(outcome)

    def fail(self, exc: BaseException) -> None:
        """``exc`` ends this rank's attempt: the run closed, the run dir let go (rank 0), who
        failed and why recorded (``record_failure``: a SystemExit with the exit status for a
        failure it names in one line)."""
        if self.internals is not None:
            try:
                self.internals.close(State.FAILED)
            except Exception as closing:  # noqa: BLE001 - the failure being recorded comes first
                # A writer that failed with the same cause (TensorBoard's thread out of file
                # descriptors) raises it again on close; the record names the first one.
                log.warning("closing the run after it failed raised too: %s", closing)
        self._unwatch(exc)
        if self.held and self.env.is_main:
            _let_go(self.paths, self.environ, states.FAILED)
        record_failure(
            exc,
            self.cfg,
            self.paths,
            self.env.rank,
            self.environ,
            write=self.held,
            code_file=self.code_file,
        )

    def _unwatch(self, exc: BaseException | None) -> None:
        """Stop watching the rank (and the job's end); with ``exc``, as the watch sees a failure
        (a rank that fails leaves its flight recorder beside the stalled one's)."""
        if self.preemption.end is not None:
            self.preemption.end.close()
        watch, self._watch = self._watch, None
        if watch is None:
            return
        if exc is None:
            watch.__exit__(None, None, None)
        else:
            watch.__exit__(type(exc), exc, exc.__traceback__)


def _end_watch(
    env: DistEnv, cfg: Config, paths: rundir.RunPaths, environ: Mapping[str, str]
) -> EndWatch | None:
    """Rank 0 of a Slurm job (``cluster.end_check_s`` > 0): the watch of the job's end, started
    (its first question to Slurm goes out at once, on its own thread). Until this attempt's
    checkpointer measures a save, a save takes what the run's earlier attempts measured."""
    target = jobids.requeue_target(environ) if env.source in ("slurm", "torchrun") else None
    every = cfg.cluster.end_check_s
    if not env.is_main or not target or every <= 0:
        return None
    watch = EndWatch(
        functools.partial(slurm_commands.job_end, target), every, cfg.cluster.end_margin_s
    )
    earlier = rundir_timeline.longest_write(rundir_timeline.read_all(paths))
    watch.measure_saves(lambda: earlier)
    return watch.start()


def setup_logging(paths: rundir.RunPaths, rank: int, attempt: int) -> None:
    fmt = logging.Formatter(
        f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S"
    )
    root = logging.getLogger("clusterflow")
    root.setLevel(logging.INFO)
    for h in list(root.handlers):
        root.removeHandler(h)
    os.makedirs(paths.logs, exist_ok=True)
    fh = logging.FileHandler(paths.log_file(rank, attempt), mode="a")
    fh.setFormatter(fmt)
    root.addHandler(fh)
    if rank == 0:
        sh = logging.StreamHandler(sys.stdout)
        sh.setFormatter(fmt)
        root.addHandler(sh)
    root.propagate = False
    _warnings_to(paths.warnings_file(rank, attempt))


# What torch appends to a warning raised in its C++ code: where, in torch's own sources.
_TORCH_WHERE = " (Triggered internally at "
_warned = logging.getLogger("clusterflow.warnings")


def _warnings_to(whole_file: str) -> None:
    """Python warnings (torch's included, whose text can run to many lines of its internals):
    one line in the log (and so on rank 0's console), the whole warning with where it was raised
    in ``whole_file``."""

    def show(
        message: Warning | str, category: type[Warning], filename: str, lineno: int, *_: object
    ) -> None:
        text = str(message).strip()
        first = (text.splitlines() or [""])[0].split(_TORCH_WHERE)[0]
        try:
            os.makedirs(os.path.dirname(whole_file), exist_ok=True)
            with open(whole_file, "a") as f:
                f.write(f"{category.__name__} at {filename}:{lineno}:\n{text}\n\n")
        except OSError as exc:  # a full disk must not turn a warning into a failure
            first += f" (not kept whole: {exc.strerror})"
        _warned.warning(
            "%s: %s (the whole warning: %s)", category.__name__, first[:300], whole_file
        )

    warnings.showwarning = show


def _threads(env: DistEnv, environ: Mapping[str, str]) -> None:
    """Keep processes sharing a node from oversubscribing its cores."""
    if "OMP_NUM_THREADS" not in environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, env.local_world_size)))


def _start(env: DistEnv, cfg: Config, paths: rundir.RunPaths, device: torch.device) -> int:
    """Record this attempt (rank 0) and set up logging everywhere; returns the attempt number."""

    # Every rank's process, so that `status` can tell a live run from one whose processes are all
    # gone; and when the first of them started, where the attempt's start-up began (the goodput
    # ledger's, also for an attempt that dies before its first step).
    mine = [socket.gethostname(), os.getpid(), lease.process_start(os.getpid())]
    gathered = dist.gather_object([mine, timeline.process_started_at()])
    attempt = 0
    if env.is_main:
        os.makedirs(paths.root, exist_ok=True)
        procs = [p for p, _ in gathered]
        starts = [t for _, t in gathered if t is not None]
        attempt = rundir.record_attempt(
            paths,
            job_id=env.job_id,
            restart_count=env.attempt,
            restart_in_job=env.restart_in_job,
            hosts=list(env.hosts),
            world_size=env.world_size,
            source=env.source,
            host=socket.gethostname(),
            procs=procs,
            process_started_at=min(starts) if starts else None,
        )
    attempt = int(dist.broadcast_object(attempt))
    setup_logging(paths, env.rank, attempt)
    if env.is_main:
        transitions.mark_started(
            paths,
            job_id=env.job_id,
            world_size=env.world_size,
            hosts=sorted({p[0] for p, _ in gathered or []}),
            attempt=attempt,
        )
    log.info(
        "rank %d/%d on %s (%s, local rank %d, device %s), job %s attempt %d, master %s:%d",
        env.rank,
        env.world_size,
        socket.gethostname(),
        env.source,
        env.local_rank,
        device,
        env.job_id,
        attempt,
        env.master_addr,
        env.master_port,
    )
    return attempt


def _take_run_dir(
    env: DistEnv, cfg: Config, paths: rundir.RunPaths, environ: Mapping[str, str]
) -> tuple[dict[str, Any], int | None]:
    """Collective. Rank 0 takes the run dir's lease (one job per run dir), then resolves the
    config against the saved one (writing it on a first start); every rank gets that config and,
    for a completed run that this launch asks nothing more of, the step it completed at; or the
    reason this job may not run there."""

    answer: Any = None
    if env.is_main:
        try:
            lease.hold(paths, env, cfg.run.lease_s, dict(environ))
            relaunch = env.attempt > 0 or env.restart_in_job > 0
            done = saved_config.nothing_to_train(cfg)
            resolved, _ = saved_config.resolve(cfg, relaunch=relaunch)
            answer = (resolved.to_dict(), done)
        except (UserError, OSError) as exc:
            # Every rank must hear it, or the others wait for rank 0.
            lease.release(paths)
            answer = (
                str(exc)
                if isinstance(exc, UserError)
                else f"run dir {paths.root!r} cannot be used: {exc}"
            )
    answer = dist.broadcast_object(answer)
    if isinstance(answer, str):
        raise UserError(answer)
    return answer[0], answer[1]


def _end_completed(paths: rundir.RunPaths, env: DistEnv, step: int) -> str:
    """End the job of a completed run launched again with nothing more to train: said on rank 0,
    nothing recorded, the run dir released; outcome ``completed`` (the process exits 0)."""
    if env.is_main:
        print(saved_config.nothing_to_train_said(paths.root, step), flush=True)
        lease.release(paths)
    dist.barrier()
    dist.shutdown()
    return states.COMPLETED


def _cancelled_before_start(env: DistEnv, paths: rundir.RunPaths) -> bool:
    """Collective. Whether the user cancelled the run before this job started (a job that was
    queued, or requeued, when ``clusterflow cancel`` ran): rank 0 reads the marker, every rank
    hears its answer."""
    seen = cancel_marker.is_cancelled(paths) if env.is_main else None
    return bool(dist.broadcast_object(seen))


def _end_cancelled(paths: rundir.RunPaths, env: DistEnv, environ: Mapping[str, str]) -> str:
    """End a cancelled run's job before anything is trained or recorded: state ``cancelled``,
    the run dir released, outcome ``cancelled`` (the process exits 0)."""
    if env.is_main:
        transitions.mark_cancelled(paths, job_id=env.job_id)
        print(
            f"run {paths.root} was cancelled by the user ({paths.cancelled}): not training. "
            "Submitting the run again resumes it.",
            flush=True,
        )
        _let_go(paths, environ, states.CANCELLED)
    dist.barrier()
    dist.shutdown()
    return states.CANCELLED


def _let_go(paths: rundir.RunPaths, environ: Mapping[str, str], outcome: str) -> None:
    """Rank 0 at the end: release the run dir, except for a Slurm job that may come back (its
    requeued attempt takes its own lease; anyone else finds the job gone from squeue)."""

    ended = (states.COMPLETED, states.FAILED, states.CANCELLED)
    if outcome in ended or not environ.get("SLURM_JOB_ID"):
        lease.release(paths)


def record_failure(
    exc: BaseException,
    cfg: Config,
    paths: rundir.RunPaths,
    rank: int,
    environ: Mapping[str, str],
    *,
    write: bool = True,
    code_file: str | None = None,
) -> None:
    """Write who failed and why, with the exit status (``failure.describe``; only into a run dir
    this job holds): bad input is one line and exit 2; a full disk or a diverged loss one line and
    exit 1; the task's (or script's, ``code_file``) own code its traceback and exit 1. A node's
    fault that is the attempt's first cause requeues the job without that node
    (``node_fault``)."""
    if isinstance(exc, SystemExit) and exc.code in (0, None):
        return
    f = failure.describe(exc, cfg.task.target, script=code_file)
    host = socket.gethostname()
    notify = events.OnEvent(cfg.observe.on_event, paths, f"rank {rank} on {host}")
    device_error = node_fault.device_error(f.message) if cfg.cluster.exclude_failed_nodes else None
    requeued = False
    try:
        if write:
            rundir.write_error(paths, rank, host, f.message, f.trace)
            # The first rank to fail names the cause; a peer's later "connection closed" does not
            # replace it. Two ranks' read-modify-writes of status.json at once may lose the
            # winner's error: status then reads the cause from the first-error record, which no
            # later write replaces.
            # Its exit status too: a bad image (2) on rank 0 stays 2 when rank 1 then fails on
            # the closed connection (1), whatever the world size.
            attempt = _attempt_of(paths)
            first = first_error.record(paths, attempt, rank, f.message, exit_code=f.code)
            requeued = (
                first
                and device_error is not None
                and not _restarted_here(host, environ)
                and node_fault.requeue_without(
                    paths,
                    environ,
                    node_fault.Fault(rank, host, f.message),
                    cfg.cluster.max_node_failures,
                    cfg.cluster.restarts_in_job or None,
                )
            )
            if requeued:
                notify.fire(events.REQUEUED, attempt, f"node {host} left out: {f.message}")
            if not requeued and (first or not _requeued_already(paths)):
                _write_failed(paths, rank, f, first)
                cause = first_error.read(paths, attempt) or {}
                notify.fire(events.FAILED, attempt, str(cause.get("error") or f.message))
    except (OSError, RunFailed):
        pass  # a full disk or a vanished run dir: the message below still reaches the user
    notify.settle()
    # The task's traceback, in the rank log (echoed by --local).
    shown = f.trace if f.named and f.trace else ""
    log.error("rank %d failed: %s%s", rank, f.message, f"\n{shown}" if shown else "")
    if f.named or requeued:
        later = (
            f"; its traceback is in {paths.log_file(rank, _attempt_of(paths))}"
            if shown and write
            else ""
        )
        left_out = f"; node {host} left out and the job requeued" if requeued else ""
        print(f"error: {f.message}{left_out}{later}", file=sys.stderr)
        raise SystemExit(f.code) from None


def _write_failed(paths: rundir.RunPaths, rank: int, f: failure.Failure, first: bool) -> None:
    """status.json says failed; the first cause also gives its error and exit status."""
    cause = {"error": f"rank {rank}: {f.message}", "exit_code": f.code} if first else {}
    transitions.mark_failed(paths, **cause)


def _requeued_already(paths: rundir.RunPaths) -> bool:
    """Whether the rank that failed first requeued the job (a node's fault): a peer's later error,
    a consequence of that, must not turn the state into failed."""
    recorded, _ = rundir.read_object(paths.status)
    return recorded.get("state") == states.REQUEUED


def _requeue_after_stall(
    rec: dict[str, Any],
    cfg: Config,
    paths: rundir.RunPaths,
    env: DistEnv,
    environ: Mapping[str, str],
) -> None:
    """The watchdog ended this rank: when it is the attempt's first cause and was not waiting for
    its peers (then it is more likely their victim), its node is the suspect."""
    if not (cfg.cluster.exclude_failed_nodes and rec.get("won") and not rec.get("waiting")):
        return
    if _restarted_here(rec["host"], environ):
        return
    # "rank R on HOST stalled N s at step S in PHASE (where)": the fault names rank and host
    cause = str(rec["error"]).removeprefix(f"rank {env.rank} on {rec['host']} ")
    if node_fault.requeue_without(
        paths,
        environ,
        node_fault.Fault(env.rank, rec["host"], cause),
        cfg.cluster.max_node_failures,
        cfg.cluster.restarts_in_job or None,
    ):
        notify = events.OnEvent(cfg.observe.on_event, paths, f"rank {env.rank} on {rec['host']}")
        notify.fire(events.REQUEUED, _attempt_of(paths), f"node {rec['host']} left out: {cause}")
        notify.settle()


def _restarted_here(host: str, environ: Mapping[str, str]) -> bool:
    """Whether the batch step's driver restarts this job inside its allocation without ``host``
    after a node fault (``job/restarts.py``): then the failing rank does not requeue the job."""
    if environ.get(restarts.NODE_FAULT_RESTARTS_ENV) != "1":
        return False
    log.error("node %s failed; the job restarts inside its allocation without it", host)
    return True


# The state an attempt's end recorded, and the event it is.
_EVENTS = {
    State.COMPLETED: events.COMPLETED,
    State.REQUEUED: events.REQUEUED,
    State.FAILED: events.FAILED,
}


def _tell(notify: events.OnEvent, paths: rundir.RunPaths, attempt: int, outcome: str) -> None:
    """Rank 0 at an attempt's end: observe.on_event for the state the end recorded."""
    recorded, _ = rundir.read_object(paths.status)
    event = _EVENTS.get(recorded.get("state"))
    if event is None:
        return
    said = {
        events.COMPLETED: f"completed at global step {recorded.get('global_step')}",
        events.REQUEUED: f"requeued after it stopped ({outcome}) at global step "
        f"{recorded.get('global_step')}",
        events.FAILED: str(recorded.get("error") or outcome),
    }
    notify.fire(event, attempt, said[event])


def _attempt_of(paths: rundir.RunPaths) -> int:
    return rundir.current_attempt(paths)


__all__ = ["Attempt", "exit_code"]
