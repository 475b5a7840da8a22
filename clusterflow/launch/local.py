"""``submit --local``: run the job on this machine with submitit's local executor, echo rank 0's
log, and end the job at once when a rank process dies.

submitit's local controller waits until every task has exited. A rank that dies before the
rendezvous (killed, out of memory, an import that fails on one rank) would leave the others
waiting in ``init_process_group`` for ``dist.timeout_s``; one that dies later leaves them to fail
with a peer's "Connection closed". The parent sees more: the controller's children (``/proc``),
each one's rank (its ``SUBMITIT_LOCAL_GLOBALID``), and whether it left a successful result. The
first rank seen gone without one is the cause: the job is ended and that rank named, with its own
error when it recorded one (``errors/rank<R>.json``), else with what is known (no Python error:
killed by a signal, out of memory, or a crash in native code). Slurm does the same for real
jobs with ``srun --kill-on-bad-exit=1``.

Ctrl-C in the terminal reaches every process of the foreground group. The ranks take it as a stop
(``train/preemption.py``: agree, save at the step reached, end ``stopped``); submitit's local
controller is started with SIGINT blocked, so that it never kills them (SIGINT, then SIGKILL a
second later) before they have saved, and the ranks unblock it once their handler is in place (a
Ctrl-C during their start-up is held until then); this process keeps echoing the log until they
have stopped, and a second Ctrl-C ends them at once.

A SIGTERM to this process alone (``kill``, ``timeout``, a workflow manager) would otherwise end
it silently and leave the ranks training: it is passed on to the ranks, which save at the step
reached and end ``stopped`` (stop reason ``preempted``), and this process exits 143 once they
have; a second SIGTERM ends them at once. SIGTERM is held back while the job starts, as SIGINT
is, so a rank never receives it before its handler is in place.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import time
from types import FrameType
from typing import Any

import submitit

from clusterflow import rundir
from clusterflow.config import Config
from clusterflow.distributed.env import free_port
from clusterflow.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_OK,
    EXIT_TERMINATED,
)
from clusterflow.launch import jobs
from clusterflow.manage import logs
from clusterflow.observe import events
from clusterflow.rundir import first_error, lease, states, transitions
from clusterflow.rundir.states import StopReason

# The others may still end by themselves (and record their side) before they are stopped.
GRACE_S = 3.0
# What this process passes on to the ranks: the signals that stop them with a save, and what it
# says when one comes, and when a second one ends the ranks at once.
STOPS = (signal.SIGINT, signal.SIGTERM)
_STOPPING = {
    signal.SIGINT: "interrupted: the ranks save a checkpoint at the step reached and stop "
    "(Ctrl-C again ends them at once, without saving)",
    signal.SIGTERM: "terminated (SIGTERM): the ranks save a checkpoint at the step reached and "
    "stop (a second SIGTERM ends them at once, without saving)",
}
_KILLED = {signal.SIGINT: "interrupted twice", signal.SIGTERM: "terminated twice"}


class Terminated(BaseException):
    """SIGTERM reached ``submit --local``: raised in its main thread, as Ctrl-C raises
    KeyboardInterrupt."""


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        return int(env[b"SUBMITIT_LOCAL_GLOBALID"])
    except (OSError, KeyError, ValueError):
        return None


# What Python's faulthandler (every rank enables it: job/attempt.py) prints for each fatal
# signal, and the signal.
_FATAL = {
    "Aborted": "SIGABRT",
    "Segmentation fault": "SIGSEGV",
    "Floating point exception": "SIGFPE",
    "Bus error": "SIGBUS",
    "Illegal instruction": "SIGILL",
}
_FATAL_LINE = "Fatal Python error: "


def _fatal_signal(lines: list[str]) -> str:
    """The fatal signal a rank's stderr names (faulthandler's dump), with the Python line it came
    in: "killed by SIGABRT (Aborted) in native code, called from FILE:LINE in FUNCTION"; "" when
    it names none."""
    at = max((i for i, line in enumerate(lines) if line.startswith(_FATAL_LINE)), default=None)
    if at is None:
        return ""
    what = lines[at][len(_FATAL_LINE) :].strip()
    name = _FATAL.get(what)
    said = f"killed by {name} ({what})" if name else f"{what} (a fatal signal)"
    # The first frame of the thread that got it (most recent call first), after the others'.
    current = next(
        (i for i in range(at + 1, len(lines)) if lines[i].startswith("Current thread ")), None
    )
    frame = lines[current + 1].strip() if current is not None and current + 1 < len(lines) else ""
    if not frame.startswith("File "):
        return f"{said} in native code"
    return f"{said} in native code, called from {frame[5:]}"


class RankWatch:
    def __init__(
        self,
        job: submitit.LocalJob,
        folder: str,
        paths: rundir.RunPaths,
        ntasks: int,
        on_event: str = "",
    ) -> None:
        self.job, self.folder, self.paths, self.ntasks = job, folder, paths, ntasks
        self.on_event = on_event  # observe.on_event
        self.controller = int(job.job_id)
        self.procs: dict[int, tuple[int, str | None]] = {}  # rank -> (pid, start time)
        self.started_at = time.time()
        # When the first task appeared (the controller starts all at once).
        self.first_seen: float | None = None
        self.attempts_before = rundir.attempt_count(paths)

    def first_dead(self) -> int | None:
        """The rank of a task that is gone without a successful result, if any: one seen and gone,
        or one never seen although its siblings started seconds ago (it died at once)."""
        for pid in _children(self.controller):
            rank = _rank_of(pid)
            if rank is not None and rank not in self.procs:
                self.procs[rank] = (pid, lease.process_start(pid))
                self.first_seen = self.first_seen or time.time()
        for rank in range(self.ntasks):
            if rank in self.procs:
                pid, start = self.procs[rank]
                gone = lease.process_start(pid) != start
            else:
                gone = self.first_seen is not None and time.time() - self.first_seen > 10.0
            if gone and not self._succeeded(rank):
                return rank
        return None

    def signal_ranks(self, sig: int) -> None:
        """Send ``sig`` to every rank process seen, if it still runs."""
        for pid, start in self.procs.values():
            if start is not None and lease.process_start(pid) == start:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass

    def _kill_survivors(self) -> None:
        """SIGKILL any rank the controller did not stop (a busy machine can delay it past our
        wait): a rank left in the rendezvous would live on for dist.timeout_s, holding the
        terminal's pipes."""
        for pid, start in self.procs.values():
            if start is not None and lease.process_start(pid) == start:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def _succeeded(self, rank: int) -> bool:
        from submitit.core.utils import JobPaths

        try:
            with open(JobPaths(self.folder, self.job.job_id, rank).result_pickle, "rb") as f:
                return pickle.load(f)[0] == "success"
        except Exception:  # noqa: BLE001 - no result, or one that does not load: not a success
            return False

    def _cause(self, rank: int, paths: rundir.RunPaths) -> str:
        """The rank's own account: its error record, else the one-line error it printed (a refusal
        to use the run dir writes nothing there), else what its disappearance says."""
        own = rundir.read_json(paths.error_file(rank))
        if isinstance(own, dict) and float(own.get("time") or 0) >= self.started_at:
            return str(own.get("error"))
        from submitit.core.utils import JobPaths

        stderr = str(JobPaths(self.folder, self.job.job_id, rank).stderr)
        try:
            with open(stderr, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            lines = []
        printed = [line[7:].strip() for line in lines if line.startswith("error: ")]
        if printed:
            return printed[-1]
        fatal = _fatal_signal(lines)
        if fatal:
            return f"it recorded no Python error: {fatal}; its Python stack then is in {stderr}"
        return (
            "it recorded no Python error: killed by a signal, out of memory, or a crash in native "
            f"code; see {self.folder}"
        )

    def unexplained(self) -> str | None:
        """After the job ended without a recorded cause (a rank killed in native code before the
        watch saw it gone): the first rank gone without a result, named and recorded as
        :meth:`stop` does, or None."""
        rank = self.first_dead()
        return self.stop(rank) if rank is not None else None

    def stop(self, rank: int) -> str:
        """End the job because ``rank`` died; returns (and, if this run dir is free, records)
        why."""
        deadline = time.time() + GRACE_S
        while time.time() < deadline and not self.job.done():
            time.sleep(0.2)
        if not self.job.done():
            # The controller ignores SIGINT (submit_local), so job.cancel() would not reach it: the
            # ranks are ended here, and the controller ends once its tasks have.
            self._kill_survivors()
            deadline = time.time() + 10
            while time.time() < deadline and not self.job.done():
                time.sleep(0.1)
        self._kill_survivors()  # also when the controller is done but left a rank behind
        paths = self.paths
        when = (
            "before the rendezvous"
            if rundir.attempt_count(paths) == self.attempts_before
            else "during the run"
        )
        cause = self._cause(rank, paths)
        who = f"rank {rank} (pid {self.procs[rank][0]})" if rank in self.procs else f"rank {rank}"
        why = f"{who} died first, {when}: {cause}; the other rank(s) were stopped"
        try:
            # Raises while another live job holds the run dir.
            lease.check(paths, lease.identity())
        except lease.RunDirBusy:
            return why
        transitions.mark_failed(paths, error=why)
        # A rank that died without a word could not tell observe.on_event itself.
        notify = events.OnEvent(self.on_event, paths, f"submit --local on {socket.gethostname()}")
        notify.fire(events.FAILED, rundir.current_attempt(paths), why)
        return why


def failed_exit_code(status: dict[str, Any], first: dict[str, Any] | None = None) -> int:
    """The exit status of a job that ended ``failed``: what the rank that failed first exited
    with (2 for bad input, see ``job/failure.py``; ``first``: the attempt's first-error record,
    which no later write replaces), so ``submit --local``, ``--wait`` and ``run`` agree whatever
    the world size."""
    code = (first or {}).get("exit_code", status.get("exit_code"))
    return code if code in (EXIT_JOB_FAILED, EXIT_BAD_INPUT) else EXIT_JOB_FAILED


def _start(cfg: Config, gpus: list[int] | None, folder: str) -> submitit.LocalJob:
    """The local job, submitted to submitit's local executor (its controller starts the ranks)."""
    ex = submitit.LocalExecutor(folder=folder)
    if gpus is not None:
        # CUDA numbers them as NVML (and nvidia-smi) does.
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    ex.update_parameters(
        tasks_per_node=cfg.cluster.tasks_per_node,
        nodes=1,
        timeout_min=cfg.cluster.time_min,
        gpus_per_node=cfg.cluster.gpus_per_node or 0,
        **({"visible_gpus": gpus} if gpus else {}),
    )
    os.environ["MASTER_PORT"] = str(free_port())  # inherited by the local processes
    return ex.submit(jobs.job_for(cfg))


def submit_local(cfg: Config, paths: rundir.RunPaths, gpus: list[int] | None = None) -> int:
    """Run here; ``gpus``: the NVML indices chosen by ``gpus.for_local`` (one per process). A
    lease this process took at submission (``lease.hold_for_launch``) is handed to the job, and
    let go here if the job never took it."""
    try:
        return _run_here(cfg, paths, gpus)
    finally:
        lease.release(paths)


def _run_here(cfg: Config, paths: rundir.RunPaths, gpus: list[int] | None) -> int:
    folder = os.path.abspath(paths.submitit_logs)
    # A Ctrl-C or SIGTERM while the job starts is held back, not lost: both are blocked from
    # before the job's folder exists until the loop below, so the controller and the ranks
    # inherit them blocked (the ranks unblock them with their stop handler in place); and since
    # another thread of this process (the lease's renewal) may still receive one, it is only
    # recorded meanwhile and raised again inside the loop.
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum)) for sig in STOPS}
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOPS))
    try:
        job = _start(cfg, gpus, folder)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        raise
    print(
        f"started local job {job.job_id}: {cfg.cluster.tasks_per_node} process(es), "
        f"run dir {cfg.run.dir}"
    )
    print(f"logs: {paths.logs}   tensorboard --logdir {paths.tb}")
    watch = RankWatch(job, folder, paths, cfg.cluster.tasks_per_node, cfg.observe.on_event)
    tail = logs.Tail(paths.log_file(0, rundir.attempt_count(paths)))
    why, results = None, None
    stopping: int | None = None  # the stop signal passed on to the ranks, once one came
    while True:
        try:
            signal.signal(signal.SIGINT, previous[signal.SIGINT])
            signal.signal(signal.SIGTERM, _terminated)
            signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
            if held:
                first = held[0]
                held.clear()
                signal.raise_signal(first)  # the stop held back while starting
            why = _follow(paths, job, watch, tail, stopping)
            # A job that recorded its failure pickled no result: asking submitit for it waits
            # 15 s for nothing.
            if rundir.read_object(paths.status)[0].get("state") != states.FAILED:
                results = job.results()
            break
        except (KeyboardInterrupt, Terminated) as exc:
            if stopping is not None:
                return _kill_now(job, watch, paths, stopping)
            stopping = signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT
            watch.signal_ranks(stopping)  # Ctrl-C reached them too; a SIGTERM only this process
            print(f"\n{_STOPPING[stopping]}", file=sys.stderr)
        except Exception:  # noqa: BLE001 - the job's own traceback is in its logs
            break
    signal.signal(signal.SIGTERM, previous[signal.SIGTERM])
    if results is None:
        status, _ = rundir.read_object(paths.status)
        attempt = rundir.current_attempt(paths)
        code = failed_exit_code(status, first_error.read(paths, attempt))
        said = (
            why
            or first_error.cause(paths, status, attempt)
            or watch.unexplained()
            or "the job failed; see the logs"
        )
        print(f"error: {said}", file=sys.stderr)
        if code != EXIT_BAD_INPUT:
            print(
                f"see python -m clusterflow.status {cfg.run.dir} and the logs in {paths.logs}",
                file=sys.stderr,
            )
        return code
    return ended(job.job_id, results[0], paths)


# What a local job's outcome prints (after "job N"), and its exit status. A stop resumes.
_RESUME = "resume by running the same command again"
OUTCOMES = {
    states.COMPLETED: (states.COMPLETED, EXIT_OK),
    states.CANCELLED: (
        "cancelled by the user at step {step}; submitting the run again resumes it",
        EXIT_OK,
    ),
    StopReason.INTERRUPTED: (
        "stopped by Ctrl-C at step {step}, checkpoint saved; " + _RESUME,
        EXIT_INTERRUPTED,
    ),
    StopReason.PREEMPTED: (
        "stopped by SIGTERM at step {step}, checkpoint saved; " + _RESUME,
        EXIT_TERMINATED,
    ),
    StopReason.TIMEOUT: (
        "stopped at cluster.time_min at step {step}, checkpoint saved; " + _RESUME,
        EXIT_JOB_FAILED,
    ),
}


def ended(job_id: str, outcome: str, paths: rundir.RunPaths) -> int:
    """Say how the local job ended and what to do next; returns the exit status."""
    step = rundir.read_object(paths.status)[0].get("global_step", 0)
    said, code = OUTCOMES.get(outcome, (outcome, EXIT_JOB_FAILED))
    print(f"job {job_id} {said.format(step=step)}; python -m clusterflow.status {paths.root}")
    return code


def _kill_now(
    job: submitit.LocalJob, watch: RankWatch, paths: rundir.RunPaths, stopping: int
) -> int:
    """A second Ctrl-C (or SIGTERM, ``stopping``): end the ranks and the controller at once."""
    watch.signal_ranks(signal.SIGKILL)
    try:
        os.kill(int(job.job_id), signal.SIGKILL)
    except (OSError, ValueError):
        pass
    print(
        f"{_KILLED[stopping]}: the job was killed without saving; running the same command "
        f"again resumes from the newest checkpoint (python -m clusterflow.status {paths.root})",
        file=sys.stderr,
    )
    return EXIT_TERMINATED if stopping == signal.SIGTERM else EXIT_INTERRUPTED


def _follow(
    paths: rundir.RunPaths,
    job: submitit.LocalJob,
    watch: RankWatch,
    tail: logs.Tail,
    stopping: int | None,
) -> str | None:
    """Echo rank 0's log of the newest attempt to the terminal until the local job ends; end it
    at once when a rank dies (its peers would wait for it), returning why. Once ``stopping``
    (SIGINT or SIGTERM came), that signal is sent again to the ranks while the run says it is
    running: a rank that did not exist yet when it came (while the job was being started) hears
    it then."""
    while True:
        done = job.done()
        running = (None, states.PENDING, states.RUNNING)
        recorded = rundir.read_object(paths.status)[0].get("state") if stopping else None
        if stopping is not None and not done and recorded in running:
            watch.signal_ranks(stopping)
        dead = None if done else watch.first_dead()
        # Echoed before acting on a death: the dead rank's last lines (its traceback) are
        # already written.
        tail.drain(sys.stdout)
        if dead is not None:
            why = watch.stop(dead)
            tail.drain(sys.stdout)  # what the others wrote while they were stopped
            return why
        if done:
            return None
        time.sleep(0.5)
