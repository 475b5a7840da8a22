"""Launch `python -m clusterflow.run` as N local ranks (torchrun-style environment), like a user
would.

Each rank is its own process, in a session of its own, started with the command, environment and
working directory given, its output in a log file. A command ``python -m MODULE ...`` or ``python
SCRIPT ...`` is forked by tests/rankserver.py, a server of this test process that has imported
torch once, instead of started as a fresh interpreter that imports torch again (seconds of CPU a
rank on a busy machine); the rank is then a :class:`Forked`, read like ``subprocess.Popen``. Any
other command (``unshare`` for ``nodes``), or an environment that differs in what the interpreter
or torch read at start-up, starts a fresh interpreter as before.
"""

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from conftest import REPO

from clusterflow.distributed import free_port

SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rankserver.py")
# What the interpreter, torch or its OpenMP read once at start-up: a fork inherits them from the
# server, so a rank is forked only from a server started with the same values.
_AT_START = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "LD_", "LC_", "LANG", "MALLOC")


def _at_start(env):
    return tuple(
        sorted((k, v) for k, v in env.items() if k.startswith(_AT_START) and k != "PYTHONPATH")
    )


class Forked:
    """A rank forked by the rank server, read like ``subprocess.Popen``: ``pid``, ``poll()``,
    ``wait(timeout)``, ``returncode`` (``-N`` when signal N ended it)."""

    def __init__(self, args, pid, status):
        self.args, self.pid, self.returncode, self._status = args, pid, None, status

    def _read(self, timeout):
        if self.returncode is None and select.select([self._status], [], [], timeout)[0]:
            message = self._status.recv(64)
            assert message, f"the rank server ended before rank {self.pid} did"
            self.returncode = int(message)
            self._status.close()
        return self.returncode

    def poll(self):
        return self._read(0)

    def wait(self, timeout=None):
        if self._read(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig):
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


class _Server:
    """One rank server (tests/rankserver.py) of this test process, for one start-up environment."""

    def __init__(self, env):
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, SERVER, str(theirs.fileno())],
            cwd=REPO,
            env={k: v for k, v in env.items() if k != "PYTHONPATH"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            pass_fds=[theirs.fileno()],
            start_new_session=True,
        )
        theirs.close()

    def start(self, argv, env, cwd, out):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        request = json.dumps({"argv": argv[1:], "env": env, "cwd": os.path.abspath(cwd)})
        with self.lock:
            socket.send_fds(self.control, [request.encode()], [theirs.fileno(), out.fileno()])
        theirs.close()
        pid = mine.recv(64)
        assert pid, f"the rank server ended (exit {self.proc.wait()}) before starting {argv}"
        return Forked(argv, int(pid), mine)


_SERVERS = {}


@atexit.register
def _stop_servers():
    """Each server ends when its control socket closes; waited for, so that its CPU time (and its
    ranks') is counted in this process's, as a rank started by Popen is."""
    for server in _SERVERS.values():
        server.control.close()
        server.proc.wait(timeout=60)


def _forkable(argv):
    """``python -m MODULE ...`` or ``python SCRIPT ...`` with no interpreter option."""
    return (
        len(argv) > 1
        and argv[0] == sys.executable
        and (argv[1] == "-m" and len(argv) > 2 or not argv[1].startswith("-"))
    )


def popen(argv, env, cwd, out):
    """``argv`` as its own process in a session of its own, stdout and stderr to ``out``:
    forked by the rank server where it can be (:func:`_forkable`), else a fresh process."""
    if not _forkable(argv):
        return subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    # Ranks of even and odd RANK fork from two servers: each interpreter draws its own hash seed,
    # so neighbouring ranks iterate a set of strings in different orders, as started ranks do.
    key = (_at_start(env), int(env.get("RANK", "0")) % 2)
    if key not in _SERVERS:
        _SERVERS[key] = _Server(env)
    return _SERVERS[key].start(argv, env, cwd, out)


def start(world, config, overrides, log_dir, command=None, env=None, cwd=REPO, nodes=None):
    """``world`` ranks of ``python -m clusterflow.run CONFIG OVERRIDES``, or of ``command`` (a
    list, e.g. a script of the user's own and its arguments, as torchrun would start it).
    ``nodes``: a host name per rank; each rank then runs as the one rank of its node, in a UTS
    namespace of its own with that host name (``unshare --uts``, root only), so that what each
    node keeps for itself (``checkpoint.memory_dir`` with ``{node}``) stays apart."""
    port = free_port()
    procs = []
    os.makedirs(log_dir, exist_ok=True)
    extra = dict(env or {})
    for r in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
        env.update(extra)
        env.update(
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        argv = command or [sys.executable, "-m", "clusterflow.run", config, *overrides]
        if nodes:
            env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
            argv = ["unshare", "--uts", "sh", "-c", f'hostname {nodes[r]} && exec "$@"', "-", *argv]
        with open(os.path.join(log_dir, f"launch-rank{r}-{time.time():.0f}.txt"), "a") as out:
            procs.append(popen(argv, env, cwd, out))
    return procs


def wait(procs, timeout=600):
    codes = [p.wait(timeout=timeout) for p in procs]
    return codes


def run(world, config, overrides, log_dir, timeout=600, env=None, nodes=None):
    return wait(start(world, config, overrides, log_dir, env=env, nodes=nodes), timeout)


def wait_for_file(path, procs, timeout=300):
    """Until ``path`` exists; fails when a process ends first or after ``timeout`` seconds."""
    t0 = time.time()
    while not os.path.exists(path):
        codes = [p.poll() for p in procs]
        assert all(c is None for c in codes), f"a rank ended before {path}: {codes}"
        assert time.time() - t0 < timeout, f"no {path} after {timeout} s"
        time.sleep(0.1)


def children(procs):
    """The live child processes of ``procs`` (a rank's DataLoader workers)."""
    out = []
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/task/{p.pid}/children", encoding="ascii") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def kill(procs, sig=signal.SIGKILL):
    """``sig`` to every process of each one's group (its DataLoader workers too), as Slurm
    signals every process of a job."""
    for p in procs:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
