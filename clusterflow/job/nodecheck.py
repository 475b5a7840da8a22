"""Is a node fit to run the next step? Checked on every node a restart inside the job is about to
use, before it uses them (``job/restarts.py``): a node that fails is left out, and named.

    python -m clusterflow.job.nodecheck --probe RUN_DIR/.nodecheck-{node} \\
        [--memory DIR ...] [--port-on NODE --port P] [--gpus G]

run once on each node (``srun --overlap``, ``slurm/steps.py``'s :func:`check_on`), prints one
JSON line: ``{"node": "node2", "problems": ["..."]}``. What it checks, each in a few
milliseconds and nothing beyond the standard library (the step starts in a tenth of a second):

- the run dir is writable from the node: a probe file (``--probe``, ``{node}`` the node's name)
  written, synced and removed, as a rank writes its records and checkpoints;
- the memory folder is writable (``--memory``, with ``checkpoint.memory_every_steps``): a probe
  file in the run's folder there when it exists, else in the nearest folder that does, where
  the rank would create it;
- the rendezvous port is free on the node that hosts it (``--port-on``): bound and let go, as
  the next step's rank 0 binds it (a stray process that holds it makes every rank's rendezvous
  fail);
- the GPUs are visible where ``cluster.gpus_per_node`` expects them (``--gpus``): the driver's
  list of devices (``/proc/driver/nvidia/gpus``), without initialising CUDA.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence

NVIDIA_GPUS = "/proc/driver/nvidia/gpus"
PROBE = b"clusterflow node check\n" * 64


def node_name() -> str:
    """The node's name as the allocation lists it (``storage/snapshots.py``'s too)."""
    return socket.gethostname().split(".")[0]


def _probe(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, PROBE)
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(path)


def run_dir_problem(probe: str) -> str | None:
    try:
        _probe(probe)
    except OSError as exc:
        return f"the run dir is not writable from here ({os.path.dirname(probe)}: {_said(exc)})"
    return None


def memory_problem(folder: str) -> str | None:
    """A probe file in ``folder``, or in the nearest folder above it that exists."""
    where = folder
    while not os.path.isdir(where) and os.path.dirname(where) != where:
        if os.path.lexists(where):
            return f"the memory folder {folder} is not usable: {where} is not a folder"
        where = os.path.dirname(where)
    try:
        fd, path = tempfile.mkstemp(dir=where, prefix=".clusterflow-nodecheck-")
        try:
            os.write(fd, PROBE)
        finally:
            os.close(fd)
            os.unlink(path)
    except OSError as exc:
        return f"the memory folder {folder} is not writable ({where}: {_said(exc)})"
    return None


def port_problem(port: int) -> str | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # As the rendezvous binds it: a socket of the previous step in TIME_WAIT does not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return f"the rendezvous port {port} is in use here (a process left holding it)"
        return f"the rendezvous port {port} cannot be bound here ({_said(exc)})"
    finally:
        s.close()
    return None


def gpu_problem(expected: int, listed: Callable[[], list[str]]) -> str | None:
    """Fewer GPUs than ``expected`` in ``listed()`` (the driver's list of devices)."""
    try:
        seen = len(listed())
    except OSError:
        seen = 0
    if seen < expected:
        return f"{seen} GPU(s) visible here, cluster.gpus_per_node expects {expected}"
    return None


def _said(exc: OSError) -> str:
    return exc.strerror or str(exc)


def nvidia_gpus() -> list[str]:
    return sorted(os.listdir(NVIDIA_GPUS))


def problems(
    node: str,
    probe: str,
    *,
    memory: Sequence[str] = (),
    port_on: str = "",
    port: int = 0,
    gpus: int = 0,
    listed: Callable[[], list[str]] = nvidia_gpus,
) -> list[str]:
    """What makes ``node`` unfit for the next step (none: fit). ``{node}`` in ``probe`` and
    ``memory`` becomes the node's name."""
    out = [run_dir_problem(probe.replace("{node}", f"{node}-{os.getpid()}"))]
    out += [memory_problem(m.replace("{node}", node)) for m in memory]
    if port and port_on == node:
        out.append(port_problem(port))
    if gpus > 0:
        out.append(gpu_problem(gpus, listed))
    return [p for p in out if p]


def verdicts(nodes: Sequence[str], output: str, answered: bool) -> dict[str, str]:
    """Why each of ``nodes`` is unfit, from the check's ``output`` (one JSON line per node);
    a node that printed nothing did not answer (``answered``: whether the check ended in
    time). Pure."""
    said: dict[str, list[str]] = {}
    for line in output.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("node"), str):
            said[rec["node"]] = [str(p) for p in rec.get("problems") or []]
    out = {}
    for node in nodes:
        if node not in said:
            out[node] = (
                "its node check ended without an answer (srun could not start it there)"
                if answered
                else "it did not answer the node check in time (a hung or lost node)"
            )
        elif said[node]:
            out[node] = "; ".join(said[node])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clusterflow.job.nodecheck")
    p.add_argument("--probe", required=True)
    p.add_argument("--memory", action="append", default=[])
    p.add_argument("--port-on", default="")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--gpus", type=int, default=0)
    args = p.parse_args(argv)
    node = node_name()
    found = problems(
        node,
        args.probe,
        memory=args.memory,
        port_on=args.port_on,
        port=args.port,
        gpus=args.gpus,
    )
    print(json.dumps({"node": node, "problems": found}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
