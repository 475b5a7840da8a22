"""The distributed environment: who am I, who are the others, and the few collectives we use.

One place reads the environment: :meth:`DistEnv.from_env` takes a plain mapping (``os.environ``
in production, a dict in tests) and understands Slurm's ``srun``, torchrun, submitit's local
executor and a bare single process. The helpers below have single-process defaults, so the same
code runs with and without a process group. torch is imported lazily: parsing an environment or
a nodelist must work on a login node without torch.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping

from clusterflow.errors import UserError

# ---------------------------------------------------------------------------------------------
# Slurm nodelists, parsed without calling scontrol (it may not exist on compute nodes' PATH).

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("']' without '['")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError("'[' without ']'")
    parts.append(text[start:])
    return parts


def _expand_ranges(body: str) -> list[str]:
    out = []
    for piece in body.split(","):
        m = _RANGE.match(piece)
        if not m:
            raise ValueError(f"bad range {piece!r}")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {piece!r}")
        width = len(lo)  # node[01-10] keeps the zero padding
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def _expand_host(pattern: str) -> list[str]:
    """Expand one host pattern, possibly with several bracket groups: rack1-[1-2]-gpu[3-4]."""
    m = re.search(r"\[([^\]]*)\]", pattern)
    if not m:
        if not pattern or any(c in pattern for c in "[], "):
            raise ValueError(f"bad host name {pattern!r}")
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end() :]
    tails = _expand_host(tail) if tail else [""]
    return [head + x + t for x in _expand_ranges(m.group(1)) for t in tails]


def parse_nodelist(text: str) -> list[str]:
    """Expand a Slurm hostlist: ``node[01-04,07]``, ``a[1-3],b1``, ``rack1-[1-2]-gpu[3-4]``."""
    text = (text or "").strip()
    if not text:
        raise UserError("SLURM_JOB_NODELIST is empty; it should name the job's nodes, e.g. node[01-04]")
    try:
        hosts: list[str] = []
        for part in _split_top(text):
            if not part:
                raise ValueError("empty entry")
            hosts.extend(_expand_host(part))
        return hosts
    except ValueError as exc:
        raise UserError(
            f"cannot parse the Slurm nodelist {text!r}: {exc}; expected a form like node[01-04,07] or a[1-3],b1"
        ) from None


# ---------------------------------------------------------------------------------------------
# The environment


def free_port() -> int:
    """A TCP port free on this machine now, for a rendezvous of processes started here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def derive_port(job_id: str, attempt: int) -> int:
    """A port in [20000, 40000) from the job id and the attempt, the same on every rank.

    A requeued attempt gets a different port, so it never trips over the previous attempt's
    socket lingering in TIME_WAIT on the master node.
    """
    return 20000 + zlib.crc32(f"{job_id}:{attempt}".encode()) % 20000


def _tasks_per_node(value: str | None, num_nodes: int, ntasks: int, node_id: int) -> int:
    """Read SLURM_TASKS_PER_NODE ('2(x3),1') for this node; fall back to an even split."""
    if value:
        counts: list[int] = []
        for piece in value.split(","):
            m = re.match(r"^(\d+)(?:\(x(\d+)\))?$", piece.strip())
            if not m:
                break
            counts.extend([int(m.group(1))] * int(m.group(2) or 1))
        if len(counts) == num_nodes and 0 <= node_id < num_nodes:
            return counts[node_id]
    return max(1, ntasks // max(1, num_nodes))


def _ints(env: Mapping[str, str], names: list[str], source: str) -> dict[str, int]:
    missing = [n for n in names if n not in env or env[n] == ""]
    if missing:
        present = [n for n in names if n not in missing]
        raise UserError(
            f"incomplete {source} environment: {', '.join(missing)} not set while {', '.join(present)} "
            f"{'is' if len(present) == 1 else 'are'}; launch with {'srun' if source == 'Slurm' else source} "
            f"so all of them are set, or unset the stray ones to run as a single process"
        )
    out = {}
    for n in names:
        try:
            out[n] = int(env[n])
        except ValueError:
            raise UserError(f"{n}={env[n]!r} in the {source} environment is not an integer") from None
    return out


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job. Built only by :meth:`from_env`."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    job_id: str = "local"
    attempt: int = 0
    hosts: tuple[str, ...] = field(default_factory=tuple)
    source: str = "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "DistEnv":
        env = os.environ if env is None else env
        if "RANK" in env or "LOCAL_RANK" in env or "WORLD_SIZE" in env:
            # torchrun wins even inside a Slurm allocation: it sets the exact layout it launched.
            return cls._torchrun(env)
        if "SLURM_PROCID" in env:
            return cls._slurm(env)
        if "SUBMITIT_LOCAL_GLOBALID" in env:
            return cls._submitit_local(env)
        return cls(master_port=int(env.get("MASTER_PORT", 29500)), hosts=(env.get("HOSTNAME", "localhost"),))

    @classmethod
    def _torchrun(cls, env: Mapping[str, str]) -> "DistEnv":
        v = _ints(env, ["RANK", "LOCAL_RANK", "WORLD_SIZE"], "torchrun")
        local_world = int(env.get("LOCAL_WORLD_SIZE", v["WORLD_SIZE"]))
        _consistent(v["RANK"] < v["WORLD_SIZE"], f"RANK={v['RANK']} must be below WORLD_SIZE={v['WORLD_SIZE']}")
        _consistent(v["LOCAL_RANK"] < local_world, f"LOCAL_RANK={v['LOCAL_RANK']} must be below LOCAL_WORLD_SIZE={local_world}")
        if v["WORLD_SIZE"] > 1 and "MASTER_ADDR" not in env:
            raise UserError("torchrun environment without MASTER_ADDR: launch with torchrun, which sets it, or export MASTER_ADDR")
        return cls(
            rank=v["RANK"],
            world_size=v["WORLD_SIZE"],
            local_rank=v["LOCAL_RANK"],
            local_world_size=local_world,
            node_rank=int(env.get("GROUP_RANK", v["RANK"] // max(1, local_world))),
            num_nodes=max(1, v["WORLD_SIZE"] // max(1, local_world)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            job_id=env.get("SLURM_JOB_ID", env.get("TORCHELASTIC_RUN_ID", "torchrun")),
            attempt=int(env.get("SLURM_RESTART_COUNT", env.get("TORCHELASTIC_RESTART_COUNT", 0)) or 0),
            hosts=tuple(parse_nodelist(env["SLURM_JOB_NODELIST"])) if env.get("SLURM_JOB_NODELIST") else (env.get("MASTER_ADDR", "127.0.0.1"),),
            source="torchrun",
        )

    @classmethod
    def _slurm(cls, env: Mapping[str, str]) -> "DistEnv":
        v = _ints(env, ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_NUM_NODES"], "Slurm")
        if not env.get("SLURM_JOB_NODELIST"):
            raise UserError("incomplete Slurm environment: SLURM_JOB_NODELIST not set while SLURM_PROCID is; launch with srun")
        hosts = parse_nodelist(env["SLURM_JOB_NODELIST"])
        rank, ntasks, nodes, node = v["SLURM_PROCID"], v["SLURM_NTASKS"], v["SLURM_JOB_NUM_NODES"], v["SLURM_NODEID"]
        _consistent(rank < ntasks, f"SLURM_PROCID={rank} must be below SLURM_NTASKS={ntasks}")
        _consistent(node < nodes, f"SLURM_NODEID={node} must be below SLURM_JOB_NUM_NODES={nodes}")
        _consistent(len(hosts) == nodes, f"SLURM_JOB_NODELIST names {len(hosts)} hosts ({', '.join(hosts)}) but SLURM_JOB_NUM_NODES={nodes}")
        job_id = env.get("SLURM_JOB_ID", "")
        if not job_id:
            raise UserError("incomplete Slurm environment: SLURM_JOB_ID not set while SLURM_PROCID is; launch with srun inside a job")
        attempt = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
        local_world = _tasks_per_node(env.get("SLURM_TASKS_PER_NODE"), nodes, ntasks, node)
        _consistent(v["SLURM_LOCALID"] < local_world, f"SLURM_LOCALID={v['SLURM_LOCALID']} must be below the tasks on this node ({local_world})")
        port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else derive_port(job_id, attempt)
        return cls(
            rank=rank,
            world_size=ntasks,
            local_rank=v["SLURM_LOCALID"],
            local_world_size=local_world,
            node_rank=node,
            num_nodes=nodes,
            master_addr=env.get("MASTER_ADDR") or hosts[0],
            master_port=port,
            job_id=job_id,
            attempt=attempt,
            hosts=tuple(hosts),
            source="slurm",
        )

    @classmethod
    def _submitit_local(cls, env: Mapping[str, str]) -> "DistEnv":
        v = _ints(env, ["SUBMITIT_LOCAL_GLOBALID", "SUBMITIT_LOCAL_LOCALID", "SUBMITIT_LOCAL_NTASKS"], "submitit local")
        _consistent(v["SUBMITIT_LOCAL_GLOBALID"] < v["SUBMITIT_LOCAL_NTASKS"],
                    f"SUBMITIT_LOCAL_GLOBALID={v['SUBMITIT_LOCAL_GLOBALID']} must be below SUBMITIT_LOCAL_NTASKS={v['SUBMITIT_LOCAL_NTASKS']}")
        job_id = env.get("SUBMITIT_LOCAL_JOB_ID", "local")
        attempt = int(env.get("CLUSTERFLOW_ATTEMPT", "0") or 0)
        return cls(
            rank=v["SUBMITIT_LOCAL_GLOBALID"],
            world_size=v["SUBMITIT_LOCAL_NTASKS"],
            local_rank=v["SUBMITIT_LOCAL_LOCALID"],
            local_world_size=v["SUBMITIT_LOCAL_NTASKS"],
            master_addr="127.0.0.1",
            master_port=int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else derive_port(job_id, attempt),
            job_id=job_id,
            attempt=attempt,
            hosts=(env.get("HOSTNAME", "localhost"),),
            source="submitit-local",
        )


def _consistent(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(f"inconsistent distributed environment: {message}")


# ---------------------------------------------------------------------------------------------
# Process group and collectives (torch imported lazily)


def pick_backend(requested: str = "auto") -> str:
    import torch

    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise UserError("dist.backend=nccl but this process sees no CUDA device; use dist.backend=auto or gloo on CPU")
    return requested


def device_for(env: DistEnv, backend: str) -> Any:
    """One device per local rank. When Slurm binds one GPU per task, CUDA sees only index 0,
    so the local rank is taken modulo the visible devices."""
    import torch

    if backend == "nccl" or (backend != "gloo" and torch.cuda.is_available()):
        index = env.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init(env: DistEnv, backend: str = "auto", timeout_s: int = 600) -> Any:
    """Join the process group (when there is more than one rank) and return this rank's device."""
    import torch.distributed as tdist

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


def shutdown() -> None:
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


def _initialized() -> bool:
    try:
        import torch.distributed as tdist
    except ImportError:
        return False
    return tdist.is_available() and tdist.is_initialized()


def rank() -> int:
    import torch.distributed as tdist

    return tdist.get_rank() if _initialized() else 0


def world() -> int:
    import torch.distributed as tdist

    return tdist.get_world_size() if _initialized() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if _initialized():
        import torch.distributed as tdist

        tdist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s object on every rank (pickled; for configs, labels and small state)."""
    if not _initialized():
        return obj
    import torch.distributed as tdist

    box = [obj if rank() == src else None]
    tdist.broadcast_object_list(box, src=src)
    return box[0]


def gather_object(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's object on rank ``dst`` (None elsewhere)."""
    if not _initialized():
        return [obj]
    import torch.distributed as tdist

    out = [None] * world() if rank() == dst else None
    tdist.gather_object(obj, out, dst=dst)
    return out


def all_reduce_dict(metrics: Mapping[str, float], op: str = "sum", device: Any = None) -> dict[str, float]:
    """Reduce a dict of numbers across ranks in one collective (sum, mean or max)."""
    if not metrics:
        return {}
    keys = sorted(metrics)
    if not _initialized():
        return {k: float(metrics[k]) for k in keys}
    import torch
    import torch.distributed as tdist

    t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=device or "cpu")
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX if op == "max" else tdist.ReduceOp.SUM)
    if op == "mean":
        t /= world()
    return dict(zip(keys, t.tolist()))


def all_reduce_sum(values: Any, device: Any = None) -> Any:
    """Element-wise float64 sum of a 1-D array across ranks (a numpy array comes back)."""
    import numpy as np

    values = np.asarray(values, dtype=np.float64)
    if not _initialized():
        return values
    import torch
    import torch.distributed as tdist

    t = torch.from_numpy(values.copy()).to(device or "cpu")
    tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
    return t.cpu().numpy()


def any_rank(flag: bool, device: Any = None) -> bool:
    """True on every rank when it is true on at least one (one tiny all-reduce)."""
    if not _initialized():
        return bool(flag)
    return all_reduce_dict({"f": 1.0 if flag else 0.0}, op="max", device=device)["f"] > 0
