"""``python -m clusterflow.job.warm --driver HOST:PORT [--preload MODULE] [--run-dir DIR] -- -m
ENTRY [ARGS]``: one process of a warm standby (``job/standby.py``), started by the batch step's
driver in an srun step of its own.

It imports what a rank needs (torch, clusterflow's job, ``torch._dynamo``, the step entry's
modules and the task's module, from the code frozen in the run dir), connects to the driver and
waits. Told to become a rank, it sets the variables the driver sends (Slurm's for its place in
the next step, the driver's per step), points its stdout and stderr at the files srun would have
opened for that rank, puts back the signal dispositions it started with, and runs ``python -m
ENTRY ARGS`` in-process (``runpy``, as ``-m`` does): the rank's code from there on is a cold
rank's. Told to leave, or when the driver's connection ends, it exits 0; a stop signal while it
waits (preemption's SIGTERM, the time limit's signal) ends it with 0 as well: it has nothing to
save.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import signal
import socket
import sys
import time
from collections.abc import Mapping
from types import FrameType
from typing import Any

# What a standby is for: torch imported before a restart needs it, and torch._dynamo, which DDP's
# first construction imports (0.49 s).
import torch._dynamo  # noqa: F401

from clusterflow.job import run  # noqa: F401  the rank's own code (clusterflow.run's entry)
from clusterflow.job.standby import ENTRIES, TOKEN_ENV
from clusterflow.observe.timeline import STARTED_AT_ENV
from clusterflow.rundir import frozen_code
from clusterflow.rundir.paths import RunPaths

# The stop signals a job receives (preemption, the time limit, scancel --signal): a waiting
# process leaves on them; once it becomes a rank, they are the rank's, as in a cold one.
WAITING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _leave(signum: int, frame: FrameType | None) -> None:
    os._exit(0)


def preload(entry: str, module: str, run_dir: str) -> None:
    """Import the entry's modules and the task's module (``module``, from the run's frozen code
    where it has some). A failure is the rank's to report when it imports them itself."""
    importlib.import_module(ENTRIES[entry])
    if not module:
        return
    try:
        if run_dir:
            frozen_code.activate(RunPaths(run_dir))
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - the rank meets it again, and reports it, in its own place
        pass


def _send(conn: socket.socket, message: Mapping[str, object]) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def wait(conn: socket.socket) -> dict[str, Any] | None:
    """The driver's order to become a rank, answering its pings meanwhile; None when told to
    leave or when the driver's connection ended."""
    for line in conn.makefile("r", encoding="utf-8"):
        order = json.loads(line)
        if order.get("do") == "ping":
            _send(conn, {"pong": os.getpid()})
        elif order.get("do") == "become":
            return dict(order)
        else:
            return None
    return None


def output_files(order: Mapping[str, Any]) -> dict[int, int]:
    """The files srun would have opened for the rank's stdout (1) and stderr (2), opened (file
    descriptors by the one each replaces); none where the step's output goes through srun."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if order.get("append") else os.O_TRUNC)
    opened: dict[str, int] = {}
    out: dict[int, int] = {}
    for fd, path in ((1, order.get("stdout")), (2, order.get("stderr"))):
        if path:
            if path not in opened:
                opened[path] = os.open(str(path), flags, 0o666)
            out[fd] = opened[path]
    return out


def become(order: Mapping[str, Any], files: Mapping[int, int]) -> None:
    """This process's environment and output as a cold rank's would be."""
    os.environ.update({str(k): str(v) for k, v in order["env"].items()})
    for name in order.get("unset", []):
        os.environ.pop(str(name), None)
    os.environ[STARTED_AT_ENV] = repr(time.time())
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, new in files.items():
        os.dup2(new, fd)
    for new in set(files.values()):
        os.close(new)


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    cut = words.index("--") if "--" in words else len(words)
    p = argparse.ArgumentParser(prog="python -m clusterflow.job.warm")
    p.add_argument("--driver", required=True)
    p.add_argument("--preload", default="")
    p.add_argument("--run-dir", default="")
    args = p.parse_args(words[:cut])
    command = words[cut + 1 :]
    if len(command) < 2 or command[0] != "-m" or command[1] not in ENTRIES:
        p.error(f"expected -- -m ENTRY [ARGS] with ENTRY one of {', '.join(ENTRIES)}")
    entry, entry_args = command[1], command[2:]
    dispositions = {s: signal.getsignal(s) for s in WAITING_SIGNALS}
    for s in WAITING_SIGNALS:
        signal.signal(s, _leave)
    preload(entry, args.preload, args.run_dir)
    host, _, port = args.driver.rpartition(":")
    try:
        conn = socket.create_connection((host, int(port)), timeout=60)
    except OSError as exc:
        print(f"clusterflow: warm standby: cannot reach the driver at {args.driver}: {exc}")
        return 0
    conn.settimeout(None)
    hello = {
        "token": os.environ.get(TOKEN_ENV, ""),
        "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "local": int(os.environ.get("SLURM_LOCALID", "0")),
        "task": int(os.environ.get("SLURM_PROCID", "0")),
        "step": os.environ.get("SLURM_STEP_ID", ""),
        "pid": os.getpid(),
    }
    conn.sendall(json.dumps(hello).encode() + b"\n")
    try:
        order = wait(conn)
        if order is None:
            return 0
        try:
            files = output_files(order)
        except OSError as exc:
            _send(conn, {"refused": f"cannot open the rank's output file: {exc}"})
            return 0
        _send(conn, {"ack": os.getpid()})
    except (OSError, ValueError):
        return 0
    finally:
        conn.close()
    become(order, files)
    for s, handler in dispositions.items():
        signal.signal(s, handler)
    sys.argv = [sys.argv[0], *entry_args]
    runpy.run_module(entry, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
