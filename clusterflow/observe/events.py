"""``observe.on_event: COMMAND``: a command of the user's, run when the run fails, stalls, is
requeued or completes (a mail, a chat webhook: the user's script), never in the way of training.

The command runs under ``/bin/sh -c`` with the job's environment and these added:

| variable              | value                                                             |
|-----------------------|-------------------------------------------------------------------|
| ``CLUSTERFLOW_EVENT`` | ``failed``, ``stalled``, ``requeued`` or ``completed``            |
| ``CLUSTERFLOW_RUN_DIR`` | the run dir                                                     |
| ``CLUSTERFLOW_ATTEMPT`` | the attempt the event ended (0 for the first)                   |
| ``CLUSTERFLOW_MESSAGE`` | one line: what happened (the first cause of a failure or stall) |

Who runs it: whoever records the event, which is rank 0 at an attempt's end (completed,
requeued, or failed by its stop's decision), the rank that records the attempt's failure or
requeues the job without a faulty node, the rank whose stall watchdog names the attempt's first
cause, the batch step's restart driver (a restart inside the allocation is ``requeued``; a step it
does not restart, ``failed``) and ``submit --local`` (a rank that died without a word). Several
of them may see the same event (rank 0 and the rank that failed): each (attempt, event) runs the
command once, decided by ``RUN_DIR/events/attempt<A>.<event>.json`` published once
(``storage.durable.publish_once``), which also records who ran it, when and with what.

Never in the way: no event happens inside a training step (each comes at the end of an attempt,
or on the watchdog's thread of a rank that is stuck anyway); the command is started in a session
of its own and not waited for; its output goes to ``RUN_DIR/logs/events.log``, its exit status
(a failing command) into the run's log. Before the process that started it exits, it waits up to
:data:`GRACE_S` for the command (Slurm ends every process of a job when the job ends, a command
still running then included); a command that hangs costs that exit those seconds and no more.

The job's signals are not the command's: Slurm signals every process of a job, and a rank that
requeues its job (``scontrol requeue``) has Slurm send SIGTERM to all of them a moment later,
the ``requeued`` command it starts right after included. So the command starts with the stop
signals (:data:`JOB_SIGNALS`) ignored, set before its shell runs (a shell resets blocked signals
but keeps ignored ones, and so do the programs it starts): only SIGKILL ends it, Slurm's after
``KillWait`` or at the step's end, once :meth:`OnEvent.settle` gave it its seconds.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

from clusterflow import rundir
from clusterflow.rundir.states import State
from clusterflow.storage import durable

log = logging.getLogger("clusterflow.observe")

# Three are the run states the event leaves; a stall has no state of its own (it fails the
# attempt, or restarts or requeues it).
FAILED, REQUEUED, COMPLETED = State.FAILED.value, State.REQUEUED.value, State.COMPLETED.value
STALLED = "stalled"
EVENTS = (FAILED, STALLED, REQUEUED, COMPLETED)
EVENT_ENV = "CLUSTERFLOW_EVENT"
RUN_DIR_ENV = "CLUSTERFLOW_RUN_DIR"
ATTEMPT_ENV = "CLUSTERFLOW_ATTEMPT"
MESSAGE_ENV = "CLUSTERFLOW_MESSAGE"
GRACE_S = 10.0
_SHELL = "/bin/sh"
# What Slurm and a terminal send a job's processes to stop or end them: preemption and requeue,
# Ctrl-C, a hang-up, the time-limit signal (USR1 or USR2, as --signal chose).
JOB_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# Started with JOB_SIGNALS blocked (so that none is delivered before it runs), the interpreter
# ignores them (one pending is dropped), gives back the defaults it changed at its start-up
# (SIGPIPE, SIGXFSZ), and becomes the shell running the command (``argv[1]``). No preexec_fn:
# it is not safe in a process with threads, as a rank is.
_IGNORE_THEN_EXEC = (
    "import os, signal, sys\n"
    f"for s in {tuple(int(s) for s in JOB_SIGNALS)}: signal.signal(s, signal.SIG_IGN)\n"
    "for s in (signal.SIGPIPE, signal.SIGXFSZ): signal.signal(s, signal.SIG_DFL)\n"
    f"os.execv({_SHELL!r}, [{_SHELL!r}, '-c', sys.argv[1]])\n"
)


class OnEvent:
    """``OnEvent(command, paths).fire(event, attempt, message)``; ``settle()`` before the process
    exits. An empty command: nothing happens."""

    def __init__(self, command: str, paths: rundir.RunPaths, who: str = "") -> None:
        self.command, self.paths = command.strip(), paths
        self.who = who or f"pid {os.getpid()} on {socket.gethostname()}"
        self.started: list[subprocess.Popen[bytes]] = []

    def fire(self, event: str, attempt: int, message: str = "") -> bool:
        """Run the command for ``event`` of ``attempt`` unless someone ran it already; True when
        this call started it. Never raises: a command that cannot start is logged."""
        if not self.command or event not in EVENTS:
            return False
        message = " ".join(str(message).split())[:2000]
        record = {
            "event": event,
            "attempt": attempt,
            "time": time.time(),
            "by": self.who,
            "command": self.command,
            "message": message,
        }
        try:
            os.makedirs(self.paths.events, exist_ok=True)
            if not durable.publish_once(
                self.paths.event_file(attempt, event), json.dumps(record) + "\n"
            ):
                return False  # a peer, or the driver, ran it for this event already
        except OSError as exc:
            # A full disk is an event worth telling about: run it without the record.
            log.warning("observe.on_event: %s not recorded (%s); running it anyway", event, exc)
        return self._start(event, attempt, message)

    def _start(self, event: str, attempt: int, message: str) -> bool:
        env = {
            **os.environ,
            EVENT_ENV: event,
            RUN_DIR_ENV: self.paths.root,
            ATTEMPT_ENV: str(attempt),
            MESSAGE_ENV: message,
        }
        try:
            os.makedirs(self.paths.logs, exist_ok=True)
            out = open(self.paths.event_log, "ab")  # noqa: SIM115 - the child holds it open
        except OSError:
            out = None
        try:
            if out is not None:
                when = time.strftime("%Y-%m-%d %H:%M:%S")
                out.write(f"== {when} {event}, attempt {attempt} ({self.who}): ".encode())
                out.write(f"{shlex.quote(self.command)}\n".encode())
                out.flush()
            held = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _IGNORE_THEN_EXEC, self.command],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out if out is not None else subprocess.DEVNULL,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # a Ctrl-C at the terminal is not the command's
                    close_fds=True,
                )
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
        except OSError as exc:
            log.warning("observe.on_event could not run %r for %s: %s", self.command, event, exc)
            return False
        finally:
            if out is not None:
                out.close()
        self.started.append(proc)
        threading.Thread(
            target=_reap, args=(proc, event, self.command), name="clusterflow-on-event", daemon=True
        ).start()
        log.info("observe.on_event: ran %r for %s (attempt %d)", self.command, event, attempt)
        return True

    def settle(self, timeout_s: float = GRACE_S) -> None:
        """Wait up to ``timeout_s`` in all for the commands this object started (the process is
        about to exit, and Slurm ends what a job leaves behind)."""
        deadline = time.monotonic() + timeout_s
        for proc in self.started:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning(
                    "observe.on_event: %r still runs after %.0f s; leaving it",
                    self.command,
                    timeout_s,
                )
                return


def _reap(proc: subprocess.Popen[bytes], event: str, command: str) -> None:
    """Wait for the command (no zombie left) and log a failure."""
    code = proc.wait()
    if code != 0:
        log.warning("observe.on_event: %r for %s exited with %d", command, event, code)
