"""Where this process sits in the job, read from the environment in one place.

:meth:`DistEnv.from_env` takes a plain mapping (``os.environ`` in production, a dict in tests) and
understands Slurm's ``srun``, torchrun, submitit's local executor and a bare single process. Slurm
nodelists are parsed here without calling scontrol (it may not be on compute nodes' PATH). No torch:
this runs on login nodes too; ``clusterflow.distributed`` re-exports these names.
"""

from __future__ import annotations

import os
import random
import re
import socket
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from clusterflow.errors import UserError

# Set by the in-allocation restart driver (clusterflow/job/restarts.py) for each srun step it
# starts: 0 for the first, n for the n-th restart inside the same Slurm attempt.
RESTART_IN_JOB_ENV = "CLUSTERFLOW_RESTART_IN_JOB"

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


MAX_HOSTS = 65536  # Slurm's own limit on the hosts of one range (hostlist.c MAX_RANGE)


class _TooMany(ValueError):
    pass


def _ranges(body: str) -> list[tuple[int, int, int]]:
    """``01-04,07`` -> [(1, 4, 2), (7, 7, 1)]: bounds and zero-padding width, nothing expanded
    yet."""
    out = []
    for piece in body.split(","):
        m = _RANGE.match(piece)
        if not m:
            raise ValueError(f"bad range {piece!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"descending range {piece!r}")
        if int(hi) - int(lo) + 1 > MAX_HOSTS:
            raise _TooMany(f"range {piece!r} has {int(hi) - int(lo) + 1} hosts")
        out.append((int(lo), int(hi), len(lo)))  # node[01-10] keeps the zero padding
    return out


def _host_groups(pattern: str) -> list[list[tuple[int, int, int]] | str]:
    """One host pattern as literal text and parsed bracket groups: rack1-[1-2]-gpu[3-4]."""
    parts: list[list[tuple[int, int, int]] | str] = []
    rest = pattern
    while m := re.search(r"\[([^\]]*)\]", rest):
        parts += [rest[: m.start()], _ranges(m.group(1))]
        rest = rest[m.end() :]
    parts.append(rest)
    if not pattern or any(isinstance(p, str) and any(c in p for c in "[], ") for p in parts):
        raise ValueError(f"bad host name {pattern!r}")
    return parts


def _count(groups: list[list[tuple[int, int, int]] | str]) -> int:
    n = 1
    for g in groups:
        if isinstance(g, list):
            n *= sum(hi - lo + 1 for lo, hi, _ in g)
    return n


def _expand(groups: list[list[tuple[int, int, int]] | str]) -> list[str]:
    hosts = [""]
    for g in groups:
        if isinstance(g, str):
            hosts = [h + g for h in hosts]
        else:
            hosts = [
                h + str(i).zfill(w) for h in hosts for lo, hi, w in g for i in range(lo, hi + 1)
            ]
    return hosts


def parse_nodelist(text: str) -> list[str]:
    """Expand a Slurm hostlist: ``node[01-04,07]``, ``a[1-3],b1``, ``rack1-[1-2]-gpu[3-4]``.

    Like Slurm, a list of more than 65,536 hosts is refused, and it is refused before anything
    is allocated (``n[0-100000000]`` would otherwise exhaust memory).
    """
    text = (text or "").strip()
    if not text:
        raise UserError(
            "SLURM_JOB_NODELIST is empty; it should name the job's nodes, e.g. node[01-04]"
        )
    try:
        patterns = []
        for part in _split_top(text):
            if not part:
                raise ValueError("empty entry")
            patterns.append(_host_groups(part))
        total = sum(_count(g) for g in patterns)
        if total > MAX_HOSTS:
            raise _TooMany(f"it names {total} hosts")
        return [h for g in patterns for h in _expand(g)]
    except _TooMany as exc:
        raise UserError(
            f"Slurm nodelist {text[:80]!r}: {exc}, over Slurm's limit of {MAX_HOSTS} hosts; check "
            "SLURM_JOB_NODELIST (or the nodelist you passed), which should name the job's nodes"
        ) from None
    except ValueError as exc:
        raise UserError(
            f"cannot parse the Slurm nodelist {text!r}: {exc}; "
            "expected a form like node[01-04,07] or a[1-3],b1"
        ) from None


# ---------------------------------------------------------------------------------------------
# The environment


# Linux hands out ports for outgoing connections (and for a bind to port 0) from
# net.ipv4.ip_local_port_range, 32768-60999 by default. A rendezvous port chosen there can be
# taken by any connection made before the master binds it (gloo's own connections, another job's):
# the master then fails with EADDRINUSE before the first step. So ports are chosen below it.
PORT_LOW, PORT_HIGH = 20000, 32000


def free_port() -> int:
    """A TCP port free on this machine now, for a rendezvous of processes started here: a random
    one in [PORT_LOW, PORT_HIGH), out of the range Linux takes ports from for connections, so only
    another explicit choice can take it before the master binds it."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(PORT_LOW, PORT_HIGH)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every try taken: any port the kernel has free
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def address_toward(host: str) -> str:
    """This machine's address on its route to ``host`` (the process group's master): where a
    peer of the job reaches a socket of this process, whether or not this machine's name
    resolves. No packet is sent (a UDP socket's connect only picks the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostname()


def derive_port(job_id: str, attempt: int, restart: int = 0) -> int:
    """A port in [PORT_LOW, PORT_HIGH) from the job id, the attempt and the restart inside it, the
    same on every rank (below the range Linux takes connection ports from, see above).

    A requeued attempt (or a step restarted inside the allocation) gets a different port, so it
    never trips over the previous one's socket lingering in TIME_WAIT on the master node.
    """
    key = f"{job_id}:{attempt}" + (f":{restart}" if restart else "")
    return PORT_LOW + zlib.crc32(key.encode()) % (PORT_HIGH - PORT_LOW)


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
            f"incomplete {source} environment: {', '.join(missing)} not set "
            f"while {', '.join(present)} {'is' if len(present) == 1 else 'are'}; "
            f"launch with {'srun' if source == 'Slurm' else source} so all of "
            "them are set, or unset the stray ones to run as a single process"
        )
    out = {}
    for n in names:
        try:
            out[n] = int(env[n])
        except ValueError:
            raise UserError(
                f"{n}={env[n]!r} in the {source} environment is not an integer"
            ) from None
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
    # The srun step's number within this Slurm attempt: 0 for the first, n for the n-th restart
    # inside the allocation (clusterflow/job/restarts.py sets RESTART_IN_JOB_ENV).
    restart_in_job: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DistEnv:
        env = os.environ if env is None else env
        if "RANK" in env or "LOCAL_RANK" in env or "WORLD_SIZE" in env:
            # torchrun wins even inside a Slurm allocation: it sets the exact layout it launched.
            return cls._torchrun(env)
        if "SLURM_PROCID" in env:
            return cls._slurm(env)
        if "SUBMITIT_LOCAL_GLOBALID" in env:
            return cls._submitit_local(env)
        return cls(
            master_port=int(env.get("MASTER_PORT", 29500)),
            hosts=(env.get("HOSTNAME", "localhost"),),
        )

    @classmethod
    def _torchrun(cls, env: Mapping[str, str]) -> DistEnv:
        v = _ints(env, ["RANK", "LOCAL_RANK", "WORLD_SIZE"], "torchrun")
        local_world = int(env.get("LOCAL_WORLD_SIZE", v["WORLD_SIZE"]))
        _consistent(
            v["RANK"] < v["WORLD_SIZE"],
            f"RANK={v['RANK']} must be below WORLD_SIZE={v['WORLD_SIZE']}",
        )
        _consistent(
            v["LOCAL_RANK"] < local_world,
            f"LOCAL_RANK={v['LOCAL_RANK']} must be below LOCAL_WORLD_SIZE={local_world}",
        )
        if v["WORLD_SIZE"] > 1 and "MASTER_ADDR" not in env:
            raise UserError(
                "torchrun environment without MASTER_ADDR: launch "
                "with torchrun, which sets it, or export MASTER_ADDR"
            )
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
            attempt=int(
                env.get("SLURM_RESTART_COUNT", env.get("TORCHELASTIC_RESTART_COUNT", 0)) or 0
            ),
            hosts=(
                tuple(parse_nodelist(env["SLURM_JOB_NODELIST"]))
                if env.get("SLURM_JOB_NODELIST")
                else (env.get("MASTER_ADDR", "127.0.0.1"),)
            ),
            source="torchrun",
        )

    @classmethod
    def _slurm(cls, env: Mapping[str, str]) -> DistEnv:
        v = _ints(
            env,
            [
                "SLURM_PROCID",
                "SLURM_NTASKS",
                "SLURM_LOCALID",
                "SLURM_NODEID",
                "SLURM_JOB_NUM_NODES",
            ],
            "Slurm",
        )
        if not env.get("SLURM_JOB_NODELIST"):
            raise UserError(
                "incomplete Slurm environment: SLURM_JOB_NODELIST "
                "not set while SLURM_PROCID is; launch with srun"
            )
        # A step may run on part of the allocation (spare nodes, a node left out after a fault):
        # srun names the step's own nodes, and SLURM_NODEID counts within them.
        step = (
            bool(env.get("SLURM_STEP_NODELIST")) and env.get("SLURM_STEP_NUM_NODES", "").isdigit()
        )
        hosts = parse_nodelist(env["SLURM_STEP_NODELIST" if step else "SLURM_JOB_NODELIST"])
        rank, ntasks, nodes, node = (
            v["SLURM_PROCID"],
            v["SLURM_NTASKS"],
            int(env["SLURM_STEP_NUM_NODES"]) if step else v["SLURM_JOB_NUM_NODES"],
            v["SLURM_NODEID"],
        )
        _consistent(rank < ntasks, f"SLURM_PROCID={rank} must be below SLURM_NTASKS={ntasks}")
        _consistent(node < nodes, f"SLURM_NODEID={node} must be below SLURM_JOB_NUM_NODES={nodes}")
        _consistent(
            len(hosts) == nodes,
            f"SLURM_JOB_NODELIST names {len(hosts)} hosts "
            f"({', '.join(hosts)}) but SLURM_JOB_NUM_NODES={nodes}",
        )
        job_id = env.get("SLURM_JOB_ID", "")
        if not job_id:
            raise UserError(
                "incomplete Slurm environment: SLURM_JOB_ID not set "
                "while SLURM_PROCID is; launch with srun inside a job"
            )
        if (
            env.get("SLURM_ARRAY_JOB_ID", "").isdigit()
            and env.get("SLURM_ARRAY_TASK_ID", "").isdigit()
        ):
            # An array task as squeue, scancel and scontrol requeue name it (the bare array id
            # means every task).
            job_id = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
        attempt = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
        restart = int(env[RESTART_IN_JOB_ENV]) if env.get(RESTART_IN_JOB_ENV, "").isdigit() else 0
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") if step else None
        local_world = _tasks_per_node(
            per_node or env.get("SLURM_TASKS_PER_NODE"), nodes, ntasks, node
        )
        _consistent(
            v["SLURM_LOCALID"] < local_world,
            f"SLURM_LOCALID={v['SLURM_LOCALID']} must be "
            f"below the tasks on this node ({local_world})",
        )
        port = (
            int(env["MASTER_PORT"])
            if env.get("MASTER_PORT")
            else derive_port(job_id, attempt, restart)
        )
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
            restart_in_job=restart,
        )

    @classmethod
    def _submitit_local(cls, env: Mapping[str, str]) -> DistEnv:
        v = _ints(
            env,
            ["SUBMITIT_LOCAL_GLOBALID", "SUBMITIT_LOCAL_LOCALID", "SUBMITIT_LOCAL_NTASKS"],
            "submitit local",
        )
        _consistent(
            v["SUBMITIT_LOCAL_GLOBALID"] < v["SUBMITIT_LOCAL_NTASKS"],
            f"SUBMITIT_LOCAL_GLOBALID={v['SUBMITIT_LOCAL_GLOBALID']} must "
            f"be below SUBMITIT_LOCAL_NTASKS={v['SUBMITIT_LOCAL_NTASKS']}",
        )
        job_id = env.get("SUBMITIT_LOCAL_JOB_ID", "local")
        attempt = int(env.get("CLUSTERFLOW_ATTEMPT", "0") or 0)
        return cls(
            rank=v["SUBMITIT_LOCAL_GLOBALID"],
            world_size=v["SUBMITIT_LOCAL_NTASKS"],
            local_rank=v["SUBMITIT_LOCAL_LOCALID"],
            local_world_size=v["SUBMITIT_LOCAL_NTASKS"],
            master_addr="127.0.0.1",
            master_port=(
                int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else derive_port(job_id, attempt)
            ),
            job_id=job_id,
            attempt=attempt,
            hosts=(env.get("HOSTNAME", "localhost"),),
            source="submitit-local",
        )


def _consistent(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(f"inconsistent distributed environment: {message}")
