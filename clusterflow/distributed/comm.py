"""The process group and the collectives clusterflow uses, with single-process defaults.

``rank()`` is 0, ``world()`` is 1 and every collective is the identity when no process group
exists, so the same code runs as one process. Nothing outside ``distributed`` calls a collective of
``torch.distributed`` itself (FSDP and DCP run their own): what mining, the k-NN search and the
losses need lives here, the groups with their own timeout in ``groups.py``. It imports
torch, so the login side never imports it (the forbidden contract in pyproject.toml): what a
launcher needs (ports, nodelists) is in ``env.py``.

Who this process is comes from ``env.py``.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as tdist

from clusterflow.distributed import tree
from clusterflow.distributed.env import DistEnv
from clusterflow.errors import UserError


def pick_backend(requested: str = "auto") -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise UserError(
            "dist.backend=nccl but this process sees no CUDA "
            "device; use dist.backend=auto or gloo on CPU"
        )
    return requested


def device_for(env: DistEnv, backend: str) -> torch.device:
    """One device per local rank. When Slurm binds one GPU per task, CUDA sees only index 0,
    so the local rank is taken modulo the visible devices."""
    if backend == "nccl" or (backend != "gloo" and torch.cuda.is_available()):
        index = env.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init(env: DistEnv, backend: str = "auto", timeout_s: int = 600) -> torch.device:
    """Join the process group (when there is more than one rank) and return this rank's device."""
    backend = pick_backend(backend)
    device = device_for(env, backend)
    if env.world_size > 1 and not tdist.is_initialized():
        tdist.init_process_group(
            backend=backend,
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return device


def init_alone(device: torch.device) -> None:
    """A process group of this one process, when there is none (one rank needs no group, but
    FSDP's device mesh and DCP do); in memory, no port. ``shutdown`` ends it."""
    if not tdist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        tdist.init_process_group(backend, store=tdist.HashStore(), rank=0, world_size=1)


# The longest shutdown waits for the process's other threads to go quiet, and its poll.
SETTLE_S = 0.25
_SETTLE_POLL_S = 0.005


def shutdown() -> None:
    if tdist.is_available() and tdist.is_initialized():
        _settle()
        tdist.destroy_process_group()


def _settle() -> None:
    """Let gloo's worker threads finish with the GIL before the group goes.

    A gloo worker thread frees a finished collective's tensors with the GIL held; whoever drops
    the last reference to a group (DDP's reducer, when the model is freed after the job's end)
    joins those threads while holding the GIL. A thread still waiting for the GIL then never
    ends, nor does the join: the process hangs at its end (seen with gloo, two ranks, a loaded
    machine). So this thread sleeps, the GIL released, until no other thread of the process is
    runnable on three polls in a row (a thread that waits for the GIL is woken, runnable, the
    moment this one lets it go; one the kernel has not run yet is runnable too), at most
    ``SETTLE_S``; without ``/proc`` (not Linux), the whole ``SETTLE_S``."""
    deadline = time.monotonic() + SETTLE_S
    quiet = 0
    while quiet < 3:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(_SETTLE_POLL_S, left))
        busy = _others_runnable()
        if busy is None:
            time.sleep(max(0.0, deadline - time.monotonic()))
            return
        quiet = 0 if busy else quiet + 1


def _others_runnable() -> bool | None:
    """Whether a thread of this process other than the caller is running or runnable (Linux
    ``/proc``), None where that cannot be read."""
    me = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        if tid == str(me):
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        if state == b"R":
            return True
    return False


def initialized() -> bool:
    """True when a process group exists (more than one rank)."""
    return tdist.is_available() and tdist.is_initialized()


def rank() -> int:
    return tdist.get_rank() if initialized() else 0


def world() -> int:
    return tdist.get_world_size() if initialized() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if initialized():
        tdist.barrier()


# ---------------------------------------------------------------------------------------------
# Python objects and numbers


def broadcast_object(obj: object, src: int = 0) -> Any:
    """Rank ``src``'s object on every rank (pickled; for configs, labels and small state)."""
    if not initialized():
        return obj
    box = [obj if rank() == src else None]
    tdist.broadcast_object_list(box, src=src)
    return box[0]


def gather_object(obj: object, dst: int = 0) -> list[Any] | None:
    """Every rank's object on rank ``dst`` (None elsewhere)."""
    if not initialized():
        return [obj]
    out = [None] * world() if rank() == dst else None
    tdist.gather_object(obj, out, dst=dst)
    return out


def scatter_object(objs: list[object] | None, src: int = 0) -> Any:
    """Rank r's entry of rank ``src``'s list ``objs`` (pickled; small objects such as one RNG state
    per rank)."""
    if not initialized():
        return objs[0] if objs else None
    out = [None]
    tdist.scatter_object_list(out, objs if rank() == src else None, src=src)
    return out[0]


def collective_device() -> torch.device:
    """Where the default group's tensors must live: NCCL reduces only CUDA tensors, gloo CPU
    ones."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if tdist.get_backend() == "nccl"
        else torch.device("cpu")
    )


def all_reduce_dict(
    metrics: Mapping[str, float], op: str = "sum", device: torch.device | None = None
) -> dict[str, float]:
    """Reduce a dict of numbers across ranks in one collective (sum, mean or max)."""
    if not metrics:
        return {}
    keys = sorted(metrics)
    if not initialized():
        return {k: float(metrics[k]) for k in keys}
    t = torch.tensor(
        [float(metrics[k]) for k in keys], dtype=torch.float64, device=device or collective_device()
    )
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX if op == "max" else tdist.ReduceOp.SUM)
    if op == "mean":
        t /= world()
    return dict(zip(keys, t.tolist()))


def all_reduce_sum(
    values: npt.ArrayLike, device: torch.device | None = None
) -> npt.NDArray[np.float64]:
    """Element-wise float64 sum of a 1-D array across ranks (a numpy array comes back)."""
    values = np.asarray(values, dtype=np.float64)
    if not initialized():
        return values
    t = torch.from_numpy(values.copy()).to(device or collective_device())
    tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
    return t.cpu().numpy()


def any_rank(flag: bool, device: torch.device | None = None) -> bool:
    """True on every rank when it is true on at least one (one tiny all-reduce)."""
    if not initialized():
        return bool(flag)
    return all_reduce_dict({"f": 1.0 if flag else 0.0}, op="max", device=device)["f"] > 0


# ---------------------------------------------------------------------------------------------
# Tensors


def broadcast_tensor(t: torch.Tensor, src: int) -> torch.Tensor:
    """``t`` filled in place with rank ``src``'s values."""
    if initialized():
        tdist.broadcast(t, src=src)
    return t


# Bytes per broadcast of a state: few collectives, bounded extra memory (16 MiB measured best of
# 8-64 here).
_BUCKET = 16 << 20


def _buckets(
    specs: list[tuple[tuple[int, ...], torch.dtype]],
) -> list[list[tuple[int, int, int]]]:
    """(index, offset, nbytes) of each tensor, grouped into buckets; offsets aligned for any
    dtype's view."""
    out: list[list[tuple[int, int, int]]] = [[]]
    size = 0
    for i, (shape, dtype) in enumerate(specs):
        n = dtype.itemsize * math.prod(shape)
        if out[-1] and size + n > _BUCKET:
            out.append([])
            size = 0
        out[-1].append((i, size, n))
        size += -(-n // 16) * 16
    return [b for b in out if b]


def broadcast_state(obj: object, src: int = 0) -> Any:
    """Rank ``src``'s nested state (dicts and lists of tensors and small objects) on every rank,
    with CPU tensors. Only the structure and the small objects are pickled (``tree.flatten``); the
    tensors travel as byte buckets of up to 16 MiB, never as a pickle of the whole state."""
    if not initialized():
        return obj
    mine = rank() == src
    skeleton, tensors = tree.flatten(obj) if mine else (None, [])
    skeleton, specs = broadcast_object(
        (skeleton, [(tuple(t.shape), t.dtype) for t in tensors]), src
    )
    device = collective_device()
    received: list[torch.Tensor] = []
    buckets = _buckets(specs)
    # One buffer for every bucket: a fresh buffer per bucket costs page faults on both sides.
    whole = torch.empty(
        max((b[-1][1] + b[-1][2] for b in buckets), default=0), dtype=torch.uint8, device=device
    )
    for bucket in buckets:
        flat = whole[: bucket[-1][1] + bucket[-1][2]]
        for i, off, n in bucket if mine else ():
            flat[off : off + n].copy_(tensors[i].detach().reshape(-1).view(torch.uint8))
        tdist.broadcast(flat, src=src)
        if not mine:
            host = flat.cpu()
            received += [
                host[off : off + n].view(specs[i][1]).reshape(specs[i][0]).clone()
                for i, off, n in bucket
            ]
    return obj if mine else tree.unflatten(skeleton, received)


# Host seconds spent inside the tensor collectives below (the losses' gathers): a step's wait
# for its peers, which the straggler watch leaves out of a rank's own part of the step.
_WAITED_S = [0.0]


def waited_s() -> float:
    """Host seconds this process has spent in :func:`all_gather_tensors` and
    :func:`all_reduce_tensor` so far."""
    return _WAITED_S[0]


def all_gather_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape on each), in rank order."""
    if not initialized():
        return [t]
    parts = [torch.empty_like(t) for _ in range(world())]
    t0 = time.perf_counter()
    tdist.all_gather(parts, t.contiguous())
    _WAITED_S[0] += time.perf_counter() - t0
    return parts


# How many rows each rank holds in the micro-batch being trained (set by the trainer from the
# sampler: ranks may hold one row more than others at no host sync); None outside training.
_BATCH_ROWS: tuple[int, ...] | None = None


@contextlib.contextmanager
def batch_rows(rows: Sequence[int]) -> Iterator[None]:
    """While a micro-batch trains: every rank's row count in it, for :func:`all_gather_rows`."""
    global _BATCH_ROWS
    before, _BATCH_ROWS = _BATCH_ROWS, tuple(rows)
    try:
        yield
    finally:
        _BATCH_ROWS = before


def rows_of_ranks(t: torch.Tensor) -> tuple[int, ...]:
    """Every rank's number of rows of ``t`` (a tensor of k rows per sample of this rank's part of
    the micro-batch in training, e.g. two views each), or ``t``'s rows on every rank outside
    training."""
    if _BATCH_ROWS is None:
        return (t.shape[0],) * world()
    mine = _BATCH_ROWS[rank()]
    per, left = divmod(t.shape[0], mine) if mine else (0, 1)
    if left or not per:
        raise ValueError(
            f"gathering a tensor of {t.shape[0]} rows from every rank, where this rank holds "
            f"{mine} samples of the micro-batch: gather tensors of k rows per sample"
        )
    return tuple(r * per for r in _BATCH_ROWS)


def all_gather_rows(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's rows of ``t`` (a tensor over this rank's samples of the micro-batch in
    training, shape (rows, ...)), in rank order, where ranks may hold different numbers of rows:
    they are padded to the largest count for the collective and trimmed on arrival."""
    rows = rows_of_ranks(t)
    if len(set(rows)) <= 1:
        return all_gather_tensors(t)
    most = max(rows)
    pad = t.new_zeros((most - t.shape[0], *t.shape[1:]))
    padded = torch.cat([t, pad]) if t.shape[0] < most else t
    return [part[:r] for part, r in zip(all_gather_tensors(padded), rows)]


def all_reduce_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over ranks, in place."""
    if initialized():
        t0 = time.perf_counter()
        tdist.all_reduce(t)
        _WAITED_S[0] += time.perf_counter() - t0
    return t


# The reductions a script may ask for (``run.reduce``); "mean" is the sum over the world size.
REDUCE_OPS = ("mean", "sum", "max", "min")


def reduce(t: torch.Tensor, op: str = "mean") -> torch.Tensor:
    """A copy of ``t`` reduced over every rank (``op``: one of :data:`REDUCE_OPS`; an integer
    tensor's mean is a float one). ``t`` itself is unchanged."""
    if op not in REDUCE_OPS:
        raise UserError(f"run.reduce(tensor, op={op!r}): op is one of {', '.join(REDUCE_OPS)}")
    if not torch.is_tensor(t):
        raise UserError(f"run.reduce(tensor, ...): expected a torch.Tensor, got {type(t).__name__}")
    out = t.detach().clone()
    if initialized():
        kind = {"max": tdist.ReduceOp.MAX, "min": tdist.ReduceOp.MIN}.get(op, tdist.ReduceOp.SUM)
        tdist.all_reduce(out, op=kind)
    return out / world() if op == "mean" else out


def gather(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` concatenated along the first dimension, in rank order, on every rank;
    the first dimensions may differ (the last, smaller batch of an evaluation): each rank's is
    padded to the largest for the collective and trimmed on arrival."""
    if not torch.is_tensor(t) or t.dim() == 0:
        raise UserError(
            "run.gather(tensor): expected a torch.Tensor of at least one dimension (rows), got "
            f"{type(t).__name__}{' of 0 dimensions' if torch.is_tensor(t) else ''}"
        )
    if not initialized():
        return t.detach().clone()
    shapes = [None] * world()
    tdist.all_gather_object(shapes, (tuple(t.shape[1:]), str(t.dtype)))
    if len(set(shapes)) > 1:
        raise UserError(
            "run.gather(tensor): every rank's tensor must have the same shape after the first "
            f"dimension and the same dtype; the ranks have {', '.join(map(str, shapes))}"
        )
    rows = [int(r) for r in all_gather_tensors(torch.tensor([t.shape[0]], device=t.device))]
    most = max(rows)
    part = t.detach().contiguous()
    if part.shape[0] < most:
        part = torch.cat([part, part.new_zeros((most - part.shape[0], *part.shape[1:]))])
    return torch.cat([p[:r] for p, r in zip(all_gather_tensors(part), rows)])


def gather_rows(
    indices: np.ndarray, rows: np.ndarray, n: int, dim: int, dtype: npt.DTypeLike = None
) -> np.ndarray | None:
    """Rank 0 receives every rank's rows and places them by index into an (n, dim) array; the
    others get None and keep O(shard) memory. Indices travel with the rows, so uneven or
    padded shards can never shift a row (the collective needs equal sizes: gloo refuses uneven
    ones, so shards are padded with index -1 and trimmed on arrival)."""
    dtype = np.dtype(dtype or np.float32)
    if not initialized():
        full = np.zeros((n, dim), dtype)
        full[indices] = rows
        return full
    pad = -(-n // world())
    e = torch.zeros((pad, dim), dtype=torch.from_numpy(np.zeros(0, dtype)).dtype)
    i = torch.full((pad,), -1, dtype=torch.int64)
    e[: len(indices)] = torch.from_numpy(rows) if len(indices) else e[:0]
    i[: len(indices)] = torch.from_numpy(indices)
    if tdist.get_backend() == "nccl":
        e, i = e.cuda(), i.cuda()
    es = [torch.empty_like(e) for _ in range(world())] if rank() == 0 else None
    is_ = [torch.empty_like(i) for _ in range(world())] if rank() == 0 else None
    tdist.gather(e, es, dst=0)
    tdist.gather(i, is_, dst=0)
    if rank() != 0:
        return None
    full = np.zeros((n, dim), dtype)
    seen = np.zeros(n, bool)
    for ee, ii in zip(es, is_):
        ii = ii.cpu().numpy()
        ok = ii >= 0
        full[ii[ok]] = ee.cpu().numpy()[ok]
        seen[ii[ok]] = True
    if not seen.all():
        raise RuntimeError(
            f"gathering rows lost {int((~seen).sum())} of {n}; this is a bug in clusterflow"
        )
    return full


def exchange(parts: list[np.ndarray], rows: list[int] | None = None) -> list[np.ndarray]:
    """All-to-all of numpy arrays: ``parts[r]`` goes to rank r, and entry r of the result is what
    rank r sent here. Every array has one dtype and one shape past the first axis on every rank;
    lengths may differ (zero too). The lengths travel first, unless ``rows`` gives them (how many
    rows each rank sends here: a reply to a request of known size), then one
    ``all_to_all_single``."""
    if not initialized():
        return [np.asarray(parts[0])]
    parts = [np.ascontiguousarray(p) for p in parts]
    tail, dtype = parts[0].shape[1:], parts[0].dtype
    width = int(np.prod(tail, dtype=np.int64))
    device = collective_device()
    if rows is None:
        sent = torch.tensor([len(p) for p in parts], dtype=torch.int64, device=device)
        got = torch.empty_like(sent)
        tdist.all_to_all_single(got, sent)
        rows = got.tolist()
    got_rows = list(rows)
    flat = torch.from_numpy(np.concatenate([p.reshape(-1) for p in parts]).view(np.uint8))
    out = torch.empty(sum(got_rows) * width * dtype.itemsize, dtype=torch.uint8, device=device)
    tdist.all_to_all_single(
        out,
        flat.to(device),
        [r * width * dtype.itemsize for r in got_rows],
        [len(p) * width * dtype.itemsize for p in parts],
    )
    host = out.cpu().numpy().view(dtype)
    ends = np.cumsum([r * width for r in got_rows])[:-1]
    return [a.reshape(-1, *tail) for a in np.split(host, ends)]


def ring_pass(send: list[torch.Tensor], recv: list[torch.Tensor], tag: int = 0) -> list[tdist.Work]:
    """Start sending ``send`` (tensors) to the next rank and receiving ``recv`` (tensors to fill)
    from the previous one, in a ring; returns the pending works (``wait_all``). Empty tensors are
    not sent: both sides know the sizes. ``tag`` tells apart passes that are in flight at once."""
    if not initialized():
        raise RuntimeError("ring_pass needs a process group; this is a bug in clusterflow")
    nxt, prev = (rank() + 1) % world(), (rank() - 1) % world()
    # One batch, so NCCL posts the sends and receives together (two ranks send to each other).
    ops = [tdist.P2POp(tdist.isend, t.contiguous(), nxt, tag=tag) for t in send if t.numel()]
    ops += [tdist.P2POp(tdist.irecv, t, prev, tag=tag) for t in recv if t.numel()]
    return tdist.batch_isend_irecv(ops) if ops else []


def wait_all(works: list[tdist.Work]) -> None:
    for w in works:
        w.wait()
