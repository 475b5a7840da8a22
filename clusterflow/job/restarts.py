"""Restart inside the allocation: the batch step's driver that starts the training step with srun
and, after a failure a restart can cure, starts it again in the same Slurm job, from the newest
checkpoint, on the allocation's healthy nodes.

    python -m clusterflow.job.restarts CONFIG.yaml [KEY=VALUE ...] -- srun [FLAGS] COMMAND ...
    python -m clusterflow.job.restarts --script train.py [KEY=VALUE ...] -- srun [FLAGS] COMMAND

The job allocates ``cluster.nodes + cluster.spare_nodes`` nodes and each step runs on
``cluster.nodes`` of them (``--nodes``, ``--ntasks``, ``--nodelist`` added after ``srun``). After a
step fails, :func:`classify` names the fault from what the run dir and srun recorded, and
:func:`plan` decides (both pure, tested as tables):

| the failed step (first that applies)                  | cause  | the node                     |
|-------------------------------------------------------|--------|------------------------------|
| ended on purpose: completed, requeued, stopped,       | none   | (no restart: as before)      |
| cancelled, or this driver got SIGTERM                 |        |                              |
| first-error record, written before srun reported a    | stall  | the silent rank's node,      |
| signal: the stall watchdog ended a rank while another |        | always left out              |
| rank's heartbeat had gone silent (a frozen process;   |        |                              |
| the waiting rank's watchdog names it itself)          |        |                              |
| first-error record, written before srun reported a    | stall  | left out unless the rank was |
| signal: the stall watchdog ended a rank               |        | waiting for its peers (then  |
|                                                       |        | used again)                  |
| first-error record, written before srun reported a    | node   | always left out              |
| signal: a CUDA/NCCL device error                      |        |                              |
| srun: a task ended by a signal first (SIGKILL, OOM    | crash  | left out where a spare node  |
| killer, segfault)                                     |        | allows                       |
| first-error record: a stall or device error after it  | stall, | as above                     |
|                                                       | node   |                              |
| first-error record: a full disk (a checkpoint it      | disk   | used again, once the disk    |
| could not write)                                      |        | has room (:meth:`_room`)     |
| anything else (the task's exception, bad input, a     | none   | (no restart: fails as        |
| diverged loss)                                        |        | before)                      |

srun kills a step's other tasks after one ends badly, so a stall or device error recorded before
srun's first report of a signal is the step's cause and the signal its consequence. A rank
writes its record before it exits, but the batch node may see it later than srun's first report
(of an exit code, or of a peer's signal): the driver waits for it until ``RECORD_WAIT_S`` after
that report. A frozen process (SIGSTOP, a thread that holds the GIL, a hung node) cannot end
itself: its peers wait for it in a collective until their own watchdog fires, so a stall record
is checked against the step's heartbeats, and a rank whose heartbeat had gone silent when the
record was written (:func:`silent_peer`) is named instead.

Each curable fault is judged in the run's tries (``rundir/tries.py``): a fault after the run
committed a newer step than at the fault before is restarted however many came before; the same
step failing ``cluster.restarts_in_job + 1`` times in a row with nothing committed between ends
the run failed, with "no progress", the step and the samples of its batch (restarts here and
requeues counted together). A restart happens while enough healthy nodes remain, each node it
is about to use checked first (``job/nodecheck.py``: one that fails is left out and named);
otherwise a node fault requeues the job without its node (``node_fault.py``: the failing rank
does it, since the driver tells each step through :data:`NODE_FAULT_RESTARTS_ENV` whether it
would restart one; the driver does it for a frozen rank), and anything else fails.
Nodes left out besides the faulty one come from :func:`extra_left_out` (the place for stragglers);
they are left out only where enough nodes remain.

Each restart is a new attempt in ``attempts.jsonl`` (the new step's rank 0 records it) and a line of
``RUN_DIR/restarts.jsonl`` (``rundir/restarts.py``): the fault, when it was seen, the nodes, and,
once the new attempt trained a step, the time from the fault to that step.

Warm restarts (``cluster.warm_restarts``, ``job/standby.py``): once a step's attempt trained its
first step, the driver starts a standby step whose processes import what a rank needs and wait;
at a restart they become the next step's ranks, in-process, and new processes start only when
the standby cannot serve (its step ended, a process hangs or is still importing: one line says
why). With warm restarts the driver ends a step itself, at once with SIGKILL (``Step.kill``), on
srun's first report of a failed task, instead of srun's --kill-on-bad-exit leaving its other
ranks seconds to exit; after a task ended by a signal it looks for an earlier record only
``KILLED_RECORD_WAIT_S`` after that report.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from clusterflow import rundir
from clusterflow.config.job_config import Config
from clusterflow.distributed.env import RESTART_IN_JOB_ENV, derive_port
from clusterflow.errors import UserError
from clusterflow.job import node_fault, nodecheck
from clusterflow.job.standby import Program, Standby, program
from clusterflow.observe import events, heartbeat
from clusterflow.rundir import (
    first_error,
    records,
    restarts,
    saved_config,
    states,
    stragglers,
    timeline,
    transitions,
    tries,
)
from clusterflow.rundir.restarts import RestartCause
from clusterflow.rundir.states import Cause
from clusterflow.slurm import steps
from clusterflow.storage import diskfull, snapshots

# Set for each step: "1" when a node fault in it restarts the job inside the allocation without
# that node (a restart is left and a spare healthy node exists); the failing rank then does not
# requeue the job itself.
NODE_FAULT_RESTARTS_ENV = "CLUSTERFLOW_NODE_FAULT_RESTARTS"

# A job stopped by a full disk (a checkpoint it could not write) restarts once the disk has room
# for twice what the write needed (at least ROOM_MIN_BYTES), looked at every ROOM_POLL_S, for at
# most ROOM_WAIT_S; the allocation waits meanwhile, instead of the job failing.
ROOM_WAIT_S, ROOM_POLL_S, ROOM_MIN_BYTES = 1800.0, 1.0, 16 * 2**20
# How long after srun's first report of a failed task (an exit code or a signal) the driver waits
# for the step's first-error record: the rank that names the cause writes it before it exits, but
# the batch node may see it a moment later (a shared filesystem's lag, a loaded node still
# writing), and srun may report a peer's signal first.
RECORD_WAIT_S = 5.0
# With warm restarts the driver ends a step at once (SIGKILL to every task) on srun's first report
# of a failed task, so no task writes after it: after a task ended by a signal only a record
# written before that report can name another cause, and the driver looks for one until this
# long after the report (a shared filesystem that shows the batch node a file a moment late).
KILLED_RECORD_WAIT_S = 0.5
# The driver starts the standby for the next restart once the step's attempt trained its first
# step (before, its imports would compete with the ranks' start-up for the nodes' CPUs), or this
# long after the step started, whichever comes first.
STANDBY_AFTER_S = 60.0
# How long the check of the nodes a restart is about to use may take (``job/nodecheck.py``: a
# tenth of a second on a healthy node); a node that has not answered by then is left out.
NODE_CHECK_S = 20.0
POLL_S = 0.5
_ON_PURPOSE = (states.COMPLETED, states.REQUEUED, states.STOPPED, states.CANCELLED)


@dataclass(frozen=True)
class Fault:
    """What ended a step, when a restart can cure it."""

    cause: str  # crash, node or stall
    rank: int | None
    host: str | None
    error: str
    at: float  # when it was seen (seconds since 1970)
    leave_out: bool  # the host must not run the next step
    # Otherwise: the host is left out where a spare allows (False: it runs the next step too,
    # as a rank that only waited for a peer does).
    avoid: bool = True
    # A full disk: (the path a write could not fill, the bytes it needed).
    room: tuple[str, int] | None = None


def classify(
    state: str | None,
    first: Mapping[str, Any] | None,
    srun_first: tuple[int, str, str] | None,
    srun_at: float | None,
    silent: tuple[int, str, float] | None = None,
) -> Fault | None:
    """The curable fault that ended a step, or None. ``state``: status.json's state after it;
    ``first``: the attempt's first-error record (None when the attempt recorded none);
    ``srun_first``: (rank, node, what) of the task srun reported as failed first, at ``srun_at``;
    ``silent``: (rank, node, seconds) of another rank whose heartbeat had gone quiet when the
    record was written (:func:`silent_peer`)."""
    if state in _ON_PURPOSE:
        return None
    recorded = _recorded(first, silent)
    signalled = srun_first is not None and not srun_first[2].startswith("Exited with exit code")
    if signalled and (recorded is None or srun_at is None or recorded.at > srun_at):
        assert srun_first is not None
        rank, host, what = srun_first
        return Fault(RestartCause.CRASH, rank, host, what, srun_at or time.time(), leave_out=False)
    return recorded


def _recorded(
    first: Mapping[str, Any] | None, silent: tuple[int, str, float] | None
) -> Fault | None:
    """The curable fault a first-error record names: a stall (or the silent rank behind it) or a
    device error."""
    if first is None:
        return None
    rank, host, error = first.get("rank"), first.get("host"), str(first.get("error", ""))
    at = float(first.get("time") or time.time())
    if first.get("kind") == Cause.STALL and first.get("silent_host"):
        # The waiting rank's watchdog read its peers' heartbeats and named the one that
        # stopped (observe/watchdog.py): the cause, whose node is left out.
        return Fault(
            RestartCause.STALL,
            first.get("silent_rank"),
            str(first["silent_host"]),
            error,
            at,
            leave_out=True,
        )
    if first.get("kind") == Cause.STALL and silent is not None:
        # A frozen process (SIGSTOP, a thread holding the GIL, a hung node) cannot end itself:
        # its peers wait for it until their own watchdog fires. Its silent heartbeat names it.
        peer, node, quiet = silent
        said = (
            f"no heartbeat for {quiet:.0f} s when the stall watchdog ended rank {rank} on {host}"
            + (", which waited for it" if first.get("waiting") else "")
            + " (a frozen process or node)"
        )
        return Fault(RestartCause.STALL, peer, node, said, at, leave_out=True)
    if first.get("kind") == Cause.STALL:
        waiting = bool(first.get("waiting"))
        return Fault(
            RestartCause.STALL, rank, host, error, at, leave_out=not waiting, avoid=not waiting
        )
    if node_fault.device_error(error) is not None:
        return Fault(RestartCause.NODE, rank, host, error, at, leave_out=True)
    full = diskfull.said_full(error)
    if full is not None:  # nothing the node did: the step runs again where it ran
        return Fault(
            RestartCause.DISK, rank, host, error, at, leave_out=False, avoid=False, room=full
        )
    return None


def silent_peer(
    first: Mapping[str, Any],
    heartbeats: Sequence[Mapping[str, Any]],
    stall_s: float | None = None,
) -> tuple[int, str, float] | None:
    """(rank, node, seconds) of the rank, other than the one ``first`` (a stall's first-error
    record) names, whose heartbeat had been quiet longest when that record was written, if any
    had been quiet for longer than ``heartbeat.quiet_after`` its period and ``stall_s`` (the
    watchdog's limit); ``heartbeats``: the step's heartbeat records (``time``, ``heartbeat_s``,
    and the longest pause between two writes, ``paused_from``/``paused_to``: a frozen rank that
    Slurm's SIGCONT woke before its end wrote again after the record)."""
    at = float(first.get("time") or 0)
    quiet = []
    for hb in heartbeats:
        if hb.get("rank") == first.get("rank") or not hb.get("time") or not hb.get("host"):
            continue
        every_s = float(hb.get("heartbeat_s") or 0)
        since = float(hb["time"])
        paused = hb.get("paused_from"), hb.get("paused_to")
        if since > at and None not in paused and float(paused[0]) <= at <= float(paused[1]):
            since = float(paused[0])  # it wrote again after the record, not during the pause
        age = at - since
        if every_s > 0 and age > heartbeat.quiet_after(every_s, stall_s):
            quiet.append((age, int(hb["rank"]), str(hb["host"])))
    if not quiet:
        return None
    age, rank, host = max(quiet)
    return rank, host, round(age, 1)


@dataclass(frozen=True)
class Plan:
    restart: bool
    nodes: tuple[str, ...] = ()  # the next step's nodes
    left_out: tuple[str, ...] = ()  # the allocation's nodes it does not use
    why: str = ""  # why not, when there is no restart
    shrunk: bool = False  # on fewer nodes than cluster.nodes (cluster.shrink)


def plan(
    fault: Fault | None,
    allocation: Sequence[str],
    needed: int,
    faulty: Sequence[str] = (),
    avoid: Sequence[str] = (),
    shrink: bool = False,
) -> Plan:
    """Whether to restart after ``fault``, and on which nodes (how many times one step may be
    tried is :mod:`clusterflow.rundir.tries`' to say, before). ``faulty``: nodes an earlier node
    fault, stall or node check put out of use; ``avoid``: nodes to leave out only where enough
    others remain (stragglers, a crashed rank's node, earlier crashes), in order of preference;
    ``shrink`` (cluster.shrink): when too few healthy nodes remain, run on those there are, and
    leave a frozen rank's node out even without a spare (a crash's node is used again: nothing
    says it is at fault)."""
    if fault is None:
        return Plan(False, why="not a failure a restart cures")
    suspect = fault.leave_out or (shrink and fault.cause == RestartCause.STALL and fault.avoid)
    hard = set(faulty) | ({fault.host} if suspect and fault.host else set())
    healthy = [h for h in allocation if h not in hard]
    if len(healthy) < needed:
        if shrink and healthy:
            return Plan(
                True, tuple(healthy), tuple(h for h in allocation if h in hard), shrunk=True
            )
        return Plan(
            False,
            why=f"too few healthy nodes: {len(healthy)} of the allocation's {len(allocation)} "
            f"({', '.join(sorted(hard))} failed) for a step of {needed}",
        )
    own = [fault.host] if fault.host and not fault.leave_out and fault.avoid else []
    for host in own + list(avoid):
        if host in healthy and len(healthy) > needed:
            healthy.remove(host)
    nodes = tuple(healthy[:needed])
    return Plan(True, nodes, tuple(h for h in allocation if h not in nodes))


def extra_left_out(cfg: Config, paths: rundir.RunPaths) -> list[str]:
    """Nodes to leave out at a restart besides the failed one, where enough others remain: with
    ``cluster.exclude_stragglers``, the nodes of the ranks the straggler watch named."""
    return stragglers.straggler_nodes(paths) if cfg.cluster.exclude_stragglers else []


def node_fault_restarts(
    limit: int,
    allocation: Sequence[str],
    needed: int,
    faulty: Sequence[str],
    shrink: bool = False,
) -> bool:
    """Whether a node fault in the next step would be restarted here without its node (on fewer
    nodes, with ``shrink``); ``limit``: cluster.restarts_in_job (0: never). A step that already
    failed too often without progress is the driver's to end, not the rank's to requeue."""
    healthy = [h for h in allocation if h not in set(faulty)]
    return limit > 0 and len(healthy) - 1 >= (1 if shrink else needed)


class Driver:
    """The batch step's loop: one srun step, and another after each curable failure; with warm
    restarts (``cluster.warm_restarts``), a standby step whose processes become the next step's
    ranks (``job/standby.py``)."""

    def __init__(
        self,
        cfg: Config,
        command: Sequence[str],
        environ: Mapping[str, str],
        left_out: Callable[[Config, rundir.RunPaths], list[str]] = extra_left_out,
    ) -> None:
        self.cfg, self.command, self.environ = cfg, list(command), dict(environ)
        self.left_out = left_out
        self.paths = rundir.RunPaths(cfg.run.dir)
        self.allocation = steps.allocation(environ)
        self.per_node = steps.tasks_per_node(environ, cfg.cluster.tasks_per_node)
        spare = cfg.cluster.spare_nodes
        # Allocated by hand (sbatch -N): the step runs on all but the spare nodes.
        self.needed = max(1, len(self.allocation) - spare)
        self.limit = cfg.cluster.restarts_in_job
        self.faulty: list[str] = []  # out of use after a node fault or stall
        self.avoid: list[str] = []  # left out while enough others remain
        self.signalled = False
        self.used = 0  # restarts made
        self.warm = self._warm_program()
        self.standby: Standby | None = None
        self.events = events.OnEvent(
            cfg.observe.on_event,
            self.paths,
            f"the batch step's driver of job {environ.get('SLURM_JOB_ID', '?')}",
        )

    def _warm_program(self) -> Program | None:
        """The step's program, when warm restarts are on and a standby can run it."""
        if not self.cfg.cluster.warm_restarts or self.limit == 0:
            return None
        prog = program(self.command)
        if isinstance(prog, str):
            _say(f"warm restarts off: {prog}; a restart starts new processes")
            return None
        return prog

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_term)
        try:
            return self._run()
        finally:
            self._close_standby()

    def _run(self) -> int:
        nodes = tuple(self.allocation[: self.needed])
        ran: set[str] = set()
        attempt = rundir.attempt_count(self.paths)  # the number the step's rank 0 records
        step = self._cold(nodes)
        while True:
            ran.update(nodes)
            end = self._watch(step, attempt)
            if end.returncode == 0 or self.signalled:
                self._close_standby()
                self._forget_snapshots(sorted(ran - set(nodes)))
                return end.returncode
            fault = self._fault(end)
            if fault is not None and self.limit == 0:
                return self._not_restarted(fault, end, "cluster.restarts_in_job=0")
            verdict = self._judge(fault, nodes, attempt) if fault is not None else None
            if fault is not None and verdict is not None and verdict.gave_up:
                return self._gave_up(fault, verdict, end)
            if fault is not None and fault.room is not None and not self._room(fault.room):
                return self._not_restarted(fault, end, f"no room on {fault.room[0]}")
            p, unfit = self._place(fault)
            if not p.restart:
                if fault is not None and self._requeue(fault, p):
                    return 0
                return self._not_restarted(fault, end, p.why)
            assert fault is not None
            self.used += 1
            self._remember(fault, p)
            cold_why = self._standby_check(p.nodes)
            self._record(fault, self.used, p, cold_why, verdict, unfit)
            nodes = p.nodes
            attempt = rundir.attempt_count(self.paths)
            step = self._warm(nodes) if cold_why is None else self._cold(nodes)

    def _judge(self, fault: Fault, nodes: Sequence[str], attempt: int) -> tries.Verdict:
        """The fault of the step on ``nodes`` (whose rank 0 records ``attempt``) in the run's
        tries (``rundir/tries.py``): whether the run made progress since the fault before, and
        whether it gives up on a step that keeps failing."""
        job_id = self.environ.get("SLURM_JOB_ID", "")
        return tries.judge(
            self.paths,
            fault=tries.fault_id(job_id, self.environ.get("SLURM_RESTART_COUNT", 0), self.used),
            attempt=attempt,
            world_size=len(nodes) * self.per_node,
            limit=self.limit,
            job_id=job_id,
            failure=tries.Failure(fault.cause, fault.rank, fault.host, fault.error, at=fault.at),
        )

    def _room(self, room: tuple[str, int]) -> bool:
        """Wait until the full disk behind ``room`` (a path, the bytes a write needed) has room
        again; False when it has none after ``ROOM_WAIT_S``, or the job is told to stop."""
        path, needed = room
        want = max(2 * needed, ROOM_MIN_BYTES)
        free = diskfull.free_bytes(path)
        if free is not None and free >= want:
            return True
        _say(
            f"waiting for room on {path}'s filesystem before the restart ({free} bytes free, "
            f"{want} wanted; at most {ROOM_WAIT_S:.0f} s)"
        )
        until = time.monotonic() + ROOM_WAIT_S
        while time.monotonic() < until and not self.signalled:
            time.sleep(ROOM_POLL_S)
            free = diskfull.free_bytes(path)
            if free is not None and free >= want:
                _say(f"{free} bytes free on {path}'s filesystem: restarting")
                return True
        return False

    def _place(self, fault: Fault | None) -> tuple[Plan, dict[str, str]]:
        """Where the next step runs: :func:`plan`'s nodes, each checked first
        (``job/nodecheck.py``); a node that fails its check is left out, named, and the plan
        made again without it. Also the nodes left out so, and why."""
        unfit: dict[str, str] = {}
        checked: set[str] = set()
        while True:
            p = plan(
                fault,
                self.allocation,
                self.needed,
                self.faulty,
                self.avoid + self.left_out(self.cfg, self.paths),
                self.cfg.cluster.shrink,
            )
            new = [n for n in p.nodes if n not in checked]
            if not p.restart or not new:
                return p, unfit
            found = self._check_nodes(new, p.nodes[0])
            checked.update(new)
            for node, why in found.items():
                _say(f"node {node} left out of the restart: {why}")
                unfit[node] = why
                self.faulty.append(node)
            if not found:
                return p, unfit

    def _check_nodes(self, nodes: Sequence[str], master: str) -> dict[str, str]:
        """Why each of ``nodes`` is unfit for the next step (``job/nodecheck.py``; ``master``
        hosts its rendezvous), by one srun step on them."""
        c = self.cfg.checkpoint
        argv = [
            sys.executable,
            "-m",
            "clusterflow.job.nodecheck",
            "--probe",
            self.paths.node_probe("{node}"),
            "--port-on",
            master,
            "--port",
            str(self._next_port()),
            "--gpus",
            str(self.cfg.cluster.gpus_per_node),
        ]
        if c.memory_every_steps > 0:
            argv += ["--memory", self._memory_folder()]
        output, answered = steps.check_on(nodes, argv, self.environ, self.command[0], NODE_CHECK_S)
        return nodecheck.verdicts(nodes, output, answered)

    def _memory_folder(self) -> str:
        """The run's memory folder on each node (``{node}`` left in), for the check to probe:
        the memory_dir itself until the run has drawn its folders' key (or when its record
        cannot be read: the attempt's own refusal names it)."""
        c = self.cfg.checkpoint
        try:
            key = snapshots.folder_key(self.paths.memory_key)
        except ValueError:
            key = None
        if key is None:
            return c.memory_dir
        return snapshots.run_folder(c.memory_dir, self.cfg.run.dir, "{node}", key)

    def _next_port(self) -> int:
        """The rendezvous port of the step after this restart (``distributed/env.py``)."""
        if self.environ.get("MASTER_PORT", "").isdigit():
            return int(self.environ["MASTER_PORT"])
        attempt = self.environ.get("SLURM_RESTART_COUNT", "0")
        return derive_port(
            self.environ.get("SLURM_JOB_ID", ""),
            int(attempt) if attempt.isdigit() else 0,
            self.used + 1,
        )

    def _not_restarted(self, fault: Fault | None, end: steps.StepEnd, why: str) -> int:
        """The job ends as it would have without the driver."""
        if fault is not None:
            _say(f"not restarted in the job after {_what(fault)}: {why}")
        said = _what(fault) if fault is not None else f"exit status {end.exit_status}"
        self.events.fire(events.FAILED, rundir.current_attempt(self.paths), said)
        self.events.settle()
        return end.exit_status

    def _gave_up(self, fault: Fault, verdict: tries.Verdict, end: steps.StepEnd) -> int:
        """The same step failed too often without progress: the run ends failed, saying at
        which step and which samples its batch held."""
        _say(f"not restarted in the job after {_what(fault)}: {verdict.said}")
        transitions.mark_failed(self.paths, error=verdict.said, exit_code=end.exit_status)
        self.events.fire(events.FAILED, rundir.current_attempt(self.paths), verdict.said)
        self.events.settle()
        return end.exit_status

    def _requeue(self, fault: Fault, p: Plan) -> bool:
        """Too few healthy nodes for a restart here after a node's fault (a frozen rank, a
        device error, nodes that failed their check): requeue the job without the failed node,
        as a rank requeues it after its own node's fault (``node_fault.py``). True when
        requeued."""
        if not (fault.leave_out and fault.host and fault.rank is not None):
            return False
        if not self.cfg.cluster.exclude_failed_nodes:
            return False
        _say(f"no restart in the job after {_what(fault)} ({p.why}): requeueing it")
        # The fault is in the run's tries already (_judge): not counted again.
        requeued = node_fault.requeue_without(
            self.paths,
            self.environ,
            node_fault.Fault(fault.rank, fault.host, fault.error),
            self.cfg.cluster.max_node_failures,
        )
        if requeued:
            said = f"node {fault.host} left out and the job requeued: {_what(fault)}"
            self.events.fire(events.REQUEUED, rundir.current_attempt(self.paths), said)
            self.events.settle()
        return requeued

    # -- the steps ------------------------------------------------------------------------------

    def _cold(self, nodes: Sequence[str]) -> steps.Step:
        """A new srun step of new processes on ``nodes``."""
        command = self.command
        if self.warm is not None:  # the driver ends it on a failed task (_on_failure)
            command = [command[0], *steps.driver_ends_it(command[1:])]
        argv = steps.srun_argv(command, nodes, self.per_node)
        return steps.Step(argv, self._env(self.used), on_failure=self._on_failure)

    def _warm(self, nodes: Sequence[str]) -> steps.Step:
        """The standby's processes on ``nodes`` as the next step's ranks; new processes when
        they fail to take their ranks after all (said in one line)."""
        assert self.standby is not None
        standby, self.standby = self.standby, None
        step = standby.become(nodes, self._step_variables(self.used), self._on_failure)
        if isinstance(step, str):
            standby.close(wait_s=0)
            _say(f"the warm standby failed at the restart: {step}; starting new processes")
            return self._cold(nodes)
        return step

    def _watch(self, step: steps.Step, attempt: int) -> steps.StepEnd:
        """Wait for the step's end, starting the standby for the next restart once ``attempt``
        (the step's) trained its first step."""
        due = self.warm is not None
        while True:
            end = step.wait(POLL_S)
            if end is not None:
                return end
            if due and not self.signalled and self._trained(attempt, step.started_at):
                due = False
                self._start_standby()

    def _trained(self, attempt: int, since: float) -> bool:
        """Whether ``attempt`` trained its first step (its timeline says so), or STANDBY_AFTER_S
        passed since ``since``."""
        if time.time() - since >= STANDBY_AFTER_S:
            return True
        rec, _ = records.read_checked(
            self.paths.timeline_file(attempt), timeline.TIMELINE, within=self.paths.root
        )
        return rec is not None and float(rec.get("first_step_at") or 0) >= since

    def _start_standby(self) -> None:
        self._close_standby()
        assert self.warm is not None
        nodes = [h for h in self.allocation if h not in self.faulty]
        try:
            self.standby = Standby(
                self.warm,
                nodes,
                self.per_node,
                self._env(self.used),
                preload=self.cfg.task.target.partition(":")[0] if not self.cfg.script.path else "",
                run_dir=self.cfg.run.dir,
                say=_say,
            )
        except OSError as exc:
            _say(f"no warm standby: {exc}; a restart starts new processes")

    def _standby_check(self, nodes: Sequence[str]) -> str | None:
        """None when the standby's processes can become the ranks on ``nodes``, else why not
        (the standby is then closed)."""
        if self.warm is None:
            return ""
        if self.standby is None:
            return "no warm standby was started (the step ended before its first training step)"
        why = self.standby.check(nodes)
        if why is not None:
            self.standby.close(wait_s=0)  # a hung process must not hold the restart
            self.standby = None
            return f"the warm standby is not usable: {why}"
        return None

    def _close_standby(self) -> None:
        if self.standby is not None:
            self.standby.close()
            self.standby = None

    def _on_failure(self, step: steps.Step, failed: tuple[int, str, str]) -> None:
        """srun's first report of a failed task (from the step's reading thread). With warm
        restarts the step runs without srun's own --kill-on-bad-exit, and the driver ends it
        at once here: srun's way SIGTERMs the other ranks and leaves them seconds to see their
        collective fail, record it and exit (3 s on the test cluster), and nothing they write
        then changes the fault (:func:`classify`). Not while the job stops on purpose (the
        driver got SIGTERM, or the run says it completed, requeued or stopped): its ranks save
        and end on their own, as they would under srun's."""
        if self.warm is None or self.signalled:
            return
        status, _ = rundir.read_object(self.paths.status)
        if status.get("state") in _ON_PURPOSE:
            return
        step.kill()

    def _forget_snapshots(self, nodes: list[str]) -> None:
        """After a completed run: remove its snapshots in the memory of the nodes an earlier step
        ran on and the last one did not (the last step's ranks cleared their own)."""
        c = self.cfg.checkpoint
        status, _ = rundir.read_object(self.paths.status)
        if not nodes or c.memory_every_steps == 0 or status.get("state") != states.COMPLETED:
            return
        argv = [
            sys.executable,
            "-m",
            "clusterflow.storage.snapshots",
            c.memory_dir,
            self.cfg.run.dir,
            self.paths.memory_key,
        ]
        code = steps.run_on(nodes, argv, self.environ, self.command[0])
        if code:
            _say(f"could not remove the run's snapshots on {', '.join(nodes)} (srun: {code})")

    def _step_variables(self, used: int) -> dict[str, str]:
        """The driver's own variables for the step after ``used`` restarts."""
        restarts_node_fault = node_fault_restarts(
            self.limit, self.allocation, self.needed, self.faulty, self.cfg.cluster.shrink
        )
        return {
            RESTART_IN_JOB_ENV: str(used),
            NODE_FAULT_RESTARTS_ENV: "1" if restarts_node_fault else "0",
        }

    def _env(self, used: int) -> dict[str, str]:
        return {**self.environ, **self._step_variables(used)}

    def _fault(self, end: steps.StepEnd) -> Fault | None:
        status, _ = rundir.read_object(self.paths.status)
        # srun's first report, of an exit code or of a signal, may come before the record that
        # names the step's cause is visible here: it is waited for until RECORD_WAIT_S after
        # that report (or after the step's end when srun reported nothing); KILLED_RECORD_WAIT_S
        # after a signal when the driver ended the step at once on that report.
        reported = end.failed_at if end.failed_at is not None else end.ended_at
        crash = end.first_failure is not None and steps.signalled(end.first_failure[2])
        wait_s = KILLED_RECORD_WAIT_S if end.killed and crash else RECORD_WAIT_S
        until = max(end.ended_at, reported + wait_s) if end.killed else reported + wait_s
        first = self._first_error(end.started_at, until)
        silent = None
        if first is not None and first.get("kind") == Cause.STALL:
            beats = heartbeat.read_ranks(
                self.paths, self.cfg.dist.heartbeat_s, since=end.started_at
            )
            silent = silent_peer(first, beats, self.cfg.dist.stall_limit_s)
        return classify(status.get("state"), first, end.first_failure, end.failed_at, silent)

    def _first_error(self, since: float, until: float) -> dict[str, Any] | None:
        """The step's first-error record (one written before ``since`` is an earlier step's),
        polled while it is missing until ``until`` (seconds since 1970). The record is published
        once, so the first one seen is the step's."""
        while True:
            attempt = rundir.current_attempt(self.paths)
            first = first_error.read(self.paths, attempt)
            if first is not None and float(first.get("time") or 0) >= since:
                return first
            if time.time() >= until:
                return None
            time.sleep(0.2)

    def _remember(self, fault: Fault, p: Plan) -> None:
        if fault.host is None:
            return
        if fault.leave_out or (p.shrunk and fault.host in p.left_out):
            self.faulty.append(fault.host)
        elif fault.avoid:
            self.avoid.append(fault.host)

    def _record(
        self,
        fault: Fault,
        used: int,
        p: Plan,
        cold_why: str | None = "",
        verdict: tries.Verdict | None = None,
        unfit: Mapping[str, str] | None = None,
    ) -> None:
        """Record the restart (restarts.jsonl, the new attempt's start in status.json) and say it
        in the batch output; ``cold_why``: None when the warm standby's processes become the
        ranks, else why new processes start ("" with warm restarts off); ``verdict``: the
        fault's place in the run's tries; ``unfit``: nodes their check left out, and why."""
        job_id = self.environ.get("SLURM_JOB_ID", "")
        failed = rundir.current_attempt(self.paths)
        restarts.record_restart(
            self.paths,
            job_id=job_id,
            restart=used,
            failed_attempt=failed,
            next_attempt=rundir.attempt_count(self.paths),
            cause=fault.cause,
            rank=fault.rank,
            host=fault.host,
            error=fault.error,
            fault_at=fault.at,
            restart_at=time.time(),
            nodes=list(p.nodes),
            left_out=list(p.left_out),
            world_size=len(p.nodes) * self.per_node,
            **({"shrunk": True} if p.shrunk else {}),
            **({} if self.warm is None else {"warm": cold_why is None}),
            **(
                {"tries": verdict.tries, "progress": verdict.progress}
                if verdict is not None
                else {}
            ),
            **({"died_on": verdict.step} if verdict is not None and verdict.step else {}),
            **({"unfit": dict(unfit)} if unfit else {}),
        )
        # An attempt begins; the failed one's cause stays in its first-error record and in
        # restarts.jsonl.
        transitions.mark_started(
            self.paths,
            job_id,
            world_size=len(p.nodes) * self.per_node,
            hosts=list(p.nodes),
            attempt=rundir.attempt_count(self.paths),
        )
        out = f" ({', '.join(p.left_out)} left out)" if p.left_out else ""
        if p.shrunk:
            out += (
                f"; no spare node left: continuing on {len(p.nodes)} of {self.needed} nodes, "
                f"{len(p.nodes) * self.per_node} rank(s) instead of {self.needed * self.per_node}"
                ", the same global batch (cluster.shrink; the next requeue asks for "
                f"{self.needed} again)"
            )
        if cold_why is None:
            out += "; warm: the standby's processes there become the ranks"
        elif cold_why:
            out += f"; new processes: {cold_why}"
        said = (
            f"restart {used} in job {job_id} after {_what(fault)}: resuming from the newest "
            f"checkpoint on {', '.join(p.nodes)}{out}{_tried(verdict, self.limit)}"
        )
        _say(said)
        self.events.fire(events.REQUEUED, failed, said)

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        # Slurm signals the step itself; the driver waits for it to save and end, then stops.
        self.signalled = True


def _tried(verdict: tries.Verdict | None, limit: int) -> str:
    """How this fault counts against the run's tries of one step."""
    if verdict is None:
        return ""
    at = f" of step {verdict.step}" if verdict.step is not None else ""
    since = "progress" if verdict.progress else "no progress"
    return f"; {since} since the last fault: try {verdict.tries + 1}{at} of at most {limit + 1}"


def _what(fault: Fault) -> str:
    where = f"rank {fault.rank} on {fault.host}" if fault.host else "a rank"
    return f"{where}: {fault.error} ({fault.cause})"


def _say(text: str) -> None:
    print(f"clusterflow: {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print(
            "usage: python -m clusterflow.job.restarts CONFIG.yaml|--script PATH [KEY=VALUE ...] "
            "-- srun ...",
            file=sys.stderr,
        )
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m clusterflow.job.restarts")
    p.add_argument("config", nargs="?")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--script")
    args = p.parse_intermixed_args(argv[:cut])
    command = argv[cut + 1 :]
    try:
        cfg = saved_config.load_command(args.config, args.overrides, args.script, None)
    except (UserError, OSError) as exc:
        # The step itself reports a config it cannot use; nothing to restart.
        _say(f"no restarts inside the job: {exc}")
        cfg = None
    if cfg is None or not os.environ.get("SLURM_JOB_NODELIST"):
        os.execvp(command[0], command)
    return Driver(cfg, command, os.environ).run()


if __name__ == "__main__":
    sys.exit(main())
