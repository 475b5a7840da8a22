"""A failure that is the node's, and the requeue that leaves that node out.

A rank that fails with a device error (CUDA: an uncorrectable ECC error, a GPU fallen off the bus,
no device, a busy or unavailable one, an unspecified launch failure; NCCL: an unhandled CUDA or
system error, an internal error), or a rank whose loop the stall watchdog ends while it was not
waiting for its peers, names its own host. With ``cluster.exclude_failed_nodes`` (default true)
that rank, when it is the attempt's first cause, requeues the batch job and adds its host to the
job's excluded nodes (``scontrol requeue``, then ``scontrol update ExcNodeList=...`` while the job
is pending again: Slurm takes excluded nodes only from a pending job, and the job cannot start
again before this process is gone). The next attempt runs on other nodes and resumes from the
last checkpoint.

Not every node fault can be handled this way: an interactive allocation is not requeued; a job
whose environment has no ``scontrol`` cannot requeue itself; a node the job asked for by name
(``--nodelist``), or one whose exclusion would leave the partition too few nodes for the job,
cannot be left out, and requeueing there would only fail again. Those end the job as failed, with
the reason in the log. Node-failure requeues are counted in ``RUN_DIR/stops.jsonl`` (reason
``node_failure``) and bounded by ``cluster.max_node_failures``, so a fault that follows the job
(a deadlock in the task's code that looks like a stalled node) does not requeue it forever.

Slurm's own NODE_FAIL (a node that stops answering) needs nothing here: Slurm requeues a
``--requeue`` job itself and sets the node down, so the next attempt does not land there.
A rank killed by a signal (the OOM killer, a segfault) cannot name itself, and srun's
``--kill-on-bad-exit`` ends its peers at once; that job fails, and ``status`` names the task srun
saw end first.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from clusterflow import rundir
from clusterflow.distributed.env import RESTART_IN_JOB_ENV
from clusterflow.rundir import transitions, tries
from clusterflow.rundir.restarts import RestartCause
from clusterflow.slurm import commands as slurm_commands
from clusterflow.slurm import jobids

log = logging.getLogger("clusterflow")

# Errors that say the device or its interconnect failed, not the task's code. An out-of-memory
# error, a device-side assert or an illegal memory access is the code's (or the batch size's).
_DEVICE_ERRORS = re.compile(
    r"uncorrectable ECC error|ECC error encountered|fallen off the bus"
    r"|CUDA-capable device\(s\) is/are busy or unavailable|no CUDA-capable device is detected"
    r"|CUDA error: unspecified launch failure|CUDA error: unknown error"
    r"|cudaErrorECCUncorrectable|cudaErrorDevicesUnavailable|cudaErrorNoDevice"
    r"|cudaErrorLaunchFailure",
    re.IGNORECASE,
)
# NCCL's own words for a failure on this rank's side; "remote process exited or there was a
# network error" (ncclRemoteError) is a peer's, and invalid usage is the code's.
_NCCL_ERRORS = re.compile(
    r"unhandled cuda error|unhandled system error|ncclUnhandledCudaError|ncclSystemError"
    r"|NCCL error.*internal error|ncclInternalError",
    re.IGNORECASE,
)
# How long the rank keeps trying to set the excluded nodes after the requeue: Slurm takes them only
# once the job is pending again, and sends SIGKILL KillWait (30 s by default) after the requeue.
EXCLUDE_TRIES_S = 8.0


def device_error(message: str) -> str | None:
    """What kind of node fault the error ``message`` is ("a CUDA device error", "an NCCL
    error"), or None when it is not one."""
    if _DEVICE_ERRORS.search(message):
        return "a CUDA device error"
    if _NCCL_ERRORS.search(message):
        return "an NCCL error"
    return None


@dataclass(frozen=True)
class Facts:
    """What the decision needs to know of Slurm and of the run."""

    interactive: bool  # an allocation made by salloc (Slurm requeues batch jobs only)
    has_scontrol: bool
    failures: int  # node-failure requeues of this run so far
    excluded: tuple[str, ...]  # the job's excluded nodes now
    requested: tuple[str, ...]  # nodes the job asked for by name (--nodelist)
    partition: tuple[str, ...] | None  # the nodes of the job's partition(s); None: unknown
    nodes_needed: int


@dataclass(frozen=True)
class Plan:
    requeue: bool
    exclude: tuple[str, ...] = ()  # the job's whole excluded list after the requeue
    why: str = ""  # why not, when the job is not requeued


def plan(host: str, facts: Facts, limit: int) -> Plan:
    """Whether a node fault on ``host`` requeues the job without it. Pure: tested as a table."""
    if facts.interactive:
        return Plan(False, why="an interactive allocation (salloc) is not requeued by Slurm")
    if not facts.has_scontrol:
        return Plan(False, why="scontrol is not in this job's PATH, so it cannot requeue itself")
    if facts.failures >= limit:
        return Plan(
            False,
            why=f"this run already requeued {facts.failures} time(s) after a node failure "
            f"(cluster.max_node_failures={limit})",
        )
    if host in facts.requested:
        return Plan(
            False,
            why=f"{host} is one of the nodes the job asked for by name (--nodelist), so it "
            "cannot be left out",
        )
    excluded = tuple(sorted({*facts.excluded, host}))
    if facts.partition is not None:
        left = len(set(facts.partition) - set(excluded))
        if left < facts.nodes_needed:
            return Plan(
                False,
                why=f"leaving out {', '.join(excluded)} would leave {left} node(s) of the "
                f"partition for a job of {facts.nodes_needed}",
            )
    return Plan(True, excluded)


def _facts(job_id: str, paths: rundir.RunPaths) -> Facts:
    """Ask Slurm (and stops.jsonl) what :func:`plan` needs."""
    has_scontrol = slurm_commands.available("scontrol")
    job = slurm_commands.job_fields(job_id) if has_scontrol else {}

    def names(expression: str) -> tuple[str, ...]:
        return tuple(slurm_commands.hostnames(expression) or ())

    partition = job.get("Partition", "")
    members = slurm_commands.partition_nodes(partition) if partition else None
    needed = re.match(r"\d+", job.get("NumNodes", ""))
    return Facts(
        interactive=job.get("BatchFlag") == "0",
        has_scontrol=has_scontrol,
        failures=rundir.count_stops(paths, rundir.NODE_FAILURE),
        excluded=names(job.get("ExcNodeList", "")),
        requested=names(job.get("ReqNodeList", "")),
        partition=names(members) if members else None,
        nodes_needed=int(needed.group()) if needed else 1,
    )


def _world_size(paths: rundir.RunPaths) -> int:
    """The attempt's ranks, as status.json recorded them at its start."""
    status, _ = rundir.read_object(paths.status)
    size = status.get("world_size")
    return size if isinstance(size, int) and size > 0 else 0


@dataclass(frozen=True)
class Fault:
    """A node fault: rank ``rank`` on ``host`` failed with ``cause`` (one line)."""

    rank: int
    host: str
    cause: str


def requeue_without(
    paths: rundir.RunPaths,
    environ: Mapping[str, str],
    fault: Fault,
    limit: int,
    tries_limit: int | None = None,
) -> bool:
    """``fault`` is its attempt's first cause: requeue the job with ``fault.host`` excluded.
    True when the job was requeued (the caller ends its process); False when it was not (the
    reason is logged; the job fails as it would have). ``tries_limit``
    (``cluster.restarts_in_job``, None: not counted): the fault counts in the run's tries of one
    step (``rundir/tries.py``), and a step that failed that often without progress is not
    requeued again."""
    job_id = jobids.requeue_target(environ)
    if not job_id:
        return False
    if tries_limit is not None:
        verdict = tries.judge(
            paths,
            fault=tries.fault_id(
                environ.get("SLURM_JOB_ID", ""),
                environ.get("SLURM_RESTART_COUNT", 0),
                environ.get(RESTART_IN_JOB_ENV, 0),
            ),
            attempt=rundir.current_attempt(paths),
            world_size=_world_size(paths),
            limit=tries_limit,
            job_id=job_id,
            failure=tries.Failure(RestartCause.NODE, fault.rank, fault.host, fault.cause),
        )
        if verdict.gave_up:
            log.error(
                "node %s failed (%s); not requeued: %s", fault.host, fault.cause, verdict.said
            )
            transitions.mark_failed(paths, error=verdict.said)
            return False
    facts = _facts(job_id, paths)
    p = plan(fault.host, facts, limit)
    if not p.requeue:
        log.warning(
            "node %s failed (%s); not requeued without it: %s", fault.host, fault.cause, p.why
        )
        return False
    said = (
        f"rank {fault.rank} on {fault.host}: {fault.cause}; node {fault.host} left out and the "
        f"job requeued (node failure {facts.failures + 1} of at most {limit})"
    )
    with _term_held():
        return _requeue(paths, job_id, fault, p.exclude, said)


def _requeue(
    paths: rundir.RunPaths, job_id: str, fault: Fault, exclude: tuple[str, ...], said: str
) -> bool:
    out = slurm_commands.requeue(job_id)
    if not out.ok:
        log.error(
            "node %s failed (%s); scontrol requeue %s failed: %s",
            fault.host,
            fault.cause,
            job_id,
            out.why(),
        )
        return False
    excluded = _exclude(job_id, exclude)
    rundir.record_stop(
        paths,
        reason=rundir.NODE_FAILURE,
        job_id=job_id,
        rank=fault.rank,
        node=fault.host,
        excluded=excluded,
        error=fault.cause,
    )
    if excluded:
        log.error("%s; excluded nodes now %s", said, ",".join(exclude))
    else:
        said += (
            f", but Slurm did not take {fault.host} as excluded: the next attempt may land there"
        )
        log.error("%s", said)
    transitions.mark_requeued(paths, error=said)
    return True


def _exclude(job_id: str, nodes: tuple[str, ...]) -> bool:
    """Set the requeued job's excluded nodes, trying again while the job is not pending yet."""
    deadline = time.monotonic() + EXCLUDE_TRIES_S
    while True:
        out = slurm_commands.exclude_nodes(job_id, list(nodes))
        if out.ok or time.monotonic() > deadline:
            return out.ok
        time.sleep(0.3)


@contextlib.contextmanager
def _term_held() -> Iterator[None]:
    """The requeue sends this process SIGTERM; on the main thread, hold it off (as a no-op) until
    the excluded nodes are set. Elsewhere (the watchdog's thread) the job's own handler, installed
    before training, already keeps the process alive."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if main else None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
