"""Launch `python -m clusterflow.run` as N local ranks (torchrun-style environment), like a user
would."""

import os
import signal
import subprocess
import sys
import time

from conftest import REPO

from clusterflow.distributed import free_port


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
        out = open(os.path.join(log_dir, f"launch-rank{r}-{time.time():.0f}.txt"), "a")
        procs.append(
            subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
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
