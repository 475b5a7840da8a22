"""Which GPUs a workstation run uses (`submit --local` with cluster.gpus_per_node): the free ones.

A pure function over an NVML snapshot (see ``observe/nvml.py``), so every case is table-tested
without a GPU:

    sel = select_gpus(nvml.read_snapshot(), want=2, request="auto")   # or request=[0, 2]
    sel.env_for(local_rank)   # {"CUDA_VISIBLE_DEVICES": "GPU-<uuid>",
                              #  "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    sel.summary()             # which GPUs and why, and why not the others

A GPU is free when no other process holds it, its used memory is at the idle level of a driver
context (a process in another container holds memory but is invisible to us), and it has at least
``min_free_mb`` free. A request that cannot be met raises a UserError naming the busy GPU, the
process holding it (pid, name, memory) and the fix. Each process gets one GPU, named by UUID:
CUDA's own numbering follows CUDA_DEVICE_ORDER (fastest first by default), NVML's the PCI bus,
and a UUID means the same GPU to both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from clusterflow.errors import UserError
from clusterflow.observe import nvml

# A driver context with no process (persistence mode, MIG, ECC) stays under this.
IDLE_USED_MB = 1024


def _gib(mb: float) -> str:
    return f"{mb / 1024:.1f} GiB"


def _procs(gpu: Mapping[str, Any], ignore_pids: Iterable[int]) -> list[Mapping[str, Any]]:
    ignore = set(ignore_pids)
    return [p for p in gpu.get("processes") or [] if p.get("pid") not in ignore]


def _holders(procs: Sequence[Mapping[str, Any]]) -> str:
    shown = [
        f"pid {p['pid']} ({p.get('name') or '?'}"
        + (f", {_gib(p['used_mb'])}" if p.get("used_mb") is not None else "")
        + ")"
        for p in procs[:3]
    ]
    more = f" and {len(procs) - 3} more" if len(procs) > 3 else ""
    return ", ".join(shown) + more


def classify(
    gpu: Mapping[str, Any],
    min_free_mb: float,
    idle_used_mb: float = IDLE_USED_MB,
    ignore_pids: Iterable[int] = (),
) -> tuple[bool, str]:
    """(usable, why) for one GPU of the snapshot."""
    total, used = gpu.get("memory_total_mb") or 0, gpu.get("memory_used_mb") or 0
    free = total - used
    procs = _procs(gpu, ignore_pids)
    if procs:
        return False, f"busy: held by {_holders(procs)}"
    if used > idle_used_mb:
        return (
            False,
            f"in use: {_gib(used)} used by a process not visible here (another container or user?)",
        )
    if free < min_free_mb:
        return False, f"too little memory: {_gib(free)} free, {_gib(min_free_mb)} needed"
    util = f", {gpu['util_pct']}% busy" if gpu.get("util_pct") is not None else ""
    return True, f"free: no process, {_gib(free)} of {_gib(total)} free{util}"


@dataclass(frozen=True)
class Selection:
    indices: tuple[int, ...]  # NVML indices, one per local process, in local-rank order
    uuids: tuple[str | None, ...]
    reasons: Mapping[int, str]  # every GPU of the snapshot: why it was taken or not

    def env_for(self, local_rank: int) -> dict[str, str]:
        """What local process ``local_rank`` exports before CUDA starts: exactly its GPU."""
        uuid = self.uuids[local_rank]
        return {
            "CUDA_VISIBLE_DEVICES": uuid or str(self.indices[local_rank]),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }

    def summary(self) -> str:
        chosen = ", ".join(str(i) for i in self.indices)
        lines = [f"using GPU{'s' if len(self.indices) > 1 else ''} {chosen} (one per process)"]
        lines += [
            f"  GPU {i}: {'used' if i in self.indices else 'not used'}, {why}"
            for i, why in sorted(self.reasons.items())
        ]
        return "\n".join(lines)


def select_gpus(
    snapshot: Sequence[Mapping[str, Any]] | None,
    want: int,
    request: str | Sequence[int] = "auto",
    *,
    min_free_mb: float = 2048,
    idle_used_mb: float = IDLE_USED_MB,
    ignore_pids: Iterable[int] = (),
    cuda_visible_devices: str | None = None,
) -> Selection:
    """Choose ``want`` GPUs: the free ones in index order ("auto", within CUDA_VISIBLE_DEVICES
    when set), or exactly the listed NVML indices, each of which must be free."""
    if not snapshot:
        raise UserError(
            f"cluster.gpus_per_node={want} asks for GPUs, but NVML sees none on this machine "
            "(no NVIDIA driver, or nvidia-ml-py missing: pip install 'clusterflow[gpu]'); "
            "set cluster.gpus_per_node=0 to run on CPU"
        )
    ignore = tuple(ignore_pids)
    verdicts = {int(g["index"]): classify(g, min_free_mb, idle_used_mb, ignore) for g in snapshot}
    reasons = {i: why for i, (_, why) in verdicts.items()}
    by_index = {int(g["index"]): g for g in snapshot}
    if request == "auto":
        chosen = _auto(snapshot, verdicts, reasons, want, cuda_visible_devices)
    else:
        chosen = _explicit(request, verdicts, by_index, want)
    return Selection(tuple(chosen), tuple(by_index[i].get("uuid") for i in chosen), reasons)


def _auto(
    snapshot: Sequence[Mapping[str, Any]],
    verdicts: Mapping[int, tuple[bool, str]],
    reasons: dict[int, str],
    want: int,
    cuda_visible_devices: str | None,
) -> list[int]:
    allowed = _visible(snapshot, cuda_visible_devices)
    for i in verdicts:
        if i not in allowed:
            reasons[i] = f"hidden by CUDA_VISIBLE_DEVICES={cuda_visible_devices}"
    free = [i for i in sorted(verdicts) if i in allowed and verdicts[i][0]]
    if len(free) >= want:
        return free[:want]
    taken = "; ".join(f"GPU {i} {reasons[i]}" for i in sorted(verdicts) if i not in free)
    fix = (
        f"lower cluster.gpus_per_node to {len(free)}, " if free else ""
    ) + "wait for or stop the processes holding them, or name GPUs with cluster.gpus=[...]"
    raise UserError(
        f"cluster.gpus_per_node={want} but only {len(free)} of {len(verdicts)} GPUs are free "
        f"({', '.join(map(str, free)) or 'none'}): {taken}; {fix}"
    )


def _visible(snapshot: Sequence[Mapping[str, Any]], cuda_visible_devices: str | None) -> set[int]:
    if cuda_visible_devices is None:
        return {int(g["index"]) for g in snapshot}
    names = [n.strip() for n in cuda_visible_devices.split(",") if n.strip()]
    return {
        int(g["index"])
        for g in snapshot
        if str(g["index"]) in names
        or any(n.startswith("GPU-") and str(g.get("uuid", "")).startswith(n) for n in names)
    }


def _explicit(
    request: Sequence[int],
    verdicts: Mapping[int, tuple[bool, str]],
    by_index: Mapping[int, Any],
    want: int,
) -> list[int]:
    listed = list(request)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in listed) or len(
        set(listed)
    ) != len(listed):
        raise UserError(
            f"cluster.gpus={listed!r} must be 'auto' or a list of distinct GPU indices, e.g. [0, 2]"
        )
    if len(listed) != want:
        raise UserError(
            f"cluster.gpus={listed} names {len(listed)} GPU(s) but cluster.gpus_per_node={want}; "
            f"make them agree (one process per GPU)"
        )
    missing = [i for i in listed if i not in verdicts]
    if missing:
        raise UserError(
            f"cluster.gpus={listed}: no GPU {', '.join(map(str, missing))} on this machine; "
            f"it has {', '.join(str(i) for i in sorted(by_index))} (as nvidia-smi numbers them)"
        )
    free = [i for i in sorted(verdicts) if verdicts[i][0] and i not in listed]
    for i in listed:
        ok, why = verdicts[i]
        if not ok:
            alt = (
                f"pick a free one ({', '.join(map(str, free))})" if free else "no other GPU is free"
            )
            raise UserError(
                f"cluster.gpus={listed}: GPU {i} is {why}; {alt}, use cluster.gpus=auto, "
                "or wait for or stop that process"
            )
    return listed


def for_local(
    gpus_per_node: int, request: str | Sequence[int], environ: Mapping[str, str]
) -> list[int] | None:
    """`submit --local`: the NVML indices its processes use (None on CPU), said on stdout with why.
    The processes see them in PCI bus order (CUDA_DEVICE_ORDER=PCI_BUS_ID, set by the caller), so
    local rank i runs on the i-th chosen GPU."""
    if gpus_per_node <= 0:
        return None

    sel = select_gpus(
        nvml.read_snapshot(),
        gpus_per_node,
        request,
        cuda_visible_devices=environ.get("CUDA_VISIBLE_DEVICES"),
    )
    print(sel.summary())
    return list(sel.indices)
