"""Run a function on N real gloo processes (torch.multiprocessing), collecting each rank's
result.

The ranks are forked by multiprocessing's fork server, started once per test session with torch
already imported, instead of spawned as fresh interpreters that each import torch (seconds on a
busy 2-core machine). Each rank still gets its own process, the test process's environment and
working directory at the call, and its own process group.
"""

import multiprocessing
import os
import traceback

import torch.multiprocessing as mp

from clusterflow.distributed import free_port

_CTX = mp.get_context("forkserver")
# torch only: what every rank imports anyway; clusterflow's modules are imported by each rank
_CTX.set_forkserver_preload(["torch"])


def _entry(rank, world, port, fn, args, queue, pg_timeout=120, environ=None, cwd=None):
    if environ is not None:  # as a spawned rank would see them, not as the fork server saw them
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
    # What a spawned rank starts its own processes (DataLoader workers) with, as before.
    multiprocessing.set_start_method("spawn", force=True)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    try:
        import torch

        from clusterflow.distributed import DistEnv
        from clusterflow.distributed import comm as dist

        torch.set_num_threads(1)
        dist.init(DistEnv.from_env(os.environ), "gloo", pg_timeout)
        queue.put((rank, "ok", fn(*args)))
        dist.shutdown()
    except BaseException:  # noqa: BLE001
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(world, fn, *args, timeout=300, pg_timeout=120):
    """``pg_timeout``: the process group's timeout (a rank waiting longer for another fails)."""
    queue = _CTX.Queue()
    port = free_port()
    here = (dict(os.environ), os.getcwd())
    procs = [
        _CTX.Process(target=_entry, args=(r, world, port, fn, args, queue, pg_timeout, *here))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def _each(calls):
    """Every ``(fn, args)`` of ``calls`` in turn on this rank; a call that raises gives its
    traceback as its result and the next call still runs."""
    out = []
    for fn, args in calls:
        try:
            out.append(("ok", fn(*args)))
        except Exception:  # noqa: BLE001
            out.append(("error", traceback.format_exc()))
    return out


class SharedRanks:
    """Calls that each need their own ``world`` gloo ranks, run one after another on a single
    spawn of ``world`` processes: the start of each rank (seconds of torch imports on a busy
    machine) is paid once per world size instead of once per call.

    ``calls``: ``{key: (world, fn, args)}``. ``shared[key]`` runs, on first use of that world size,
    every call of that world in the order given, and returns the ranks' results of ``key`` like
    ``run_ranks`` (an AssertionError naming the rank when ``key``'s call raised on one). A call
    that fails fails only the tests that read it; the next calls of its spawn still run."""

    def __init__(self, calls, timeout=600):
        self.calls, self.timeout, self.done = calls, timeout, {}

    def __getitem__(self, key):
        world = self.calls[key][0]
        if world not in self.done:
            keys = [k for k, (w, _, _) in self.calls.items() if w == world]
            ranks = run_ranks(world, _each, [self.calls[k][1:] for k in keys], timeout=self.timeout)
            self.done[world] = {k: [r[i] for r in ranks] for i, k in enumerate(keys)}
        results = self.done[world][key]
        for rank, (status, value) in enumerate(results):
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
        return [value for _, value in results]
