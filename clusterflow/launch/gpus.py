"""Which GPUs a workstation run uses (`submit --local` with cluster.gpus_per_node): the free ones.

A pure function over an NVML snapshot (see ``observe/nvml.py``), so every case is table-tested
without a GPU:

    need = Need(train.memory_estimate.estimate(cfg))   # what one process needs, by part
    sel = select_gpus(nvml.read_snapshot(), want=2, request="auto", need=need)  # or [0, 2]
    sel.env_for(local_rank)   # {"CUDA_VISIBLE_DEVICES": "GPU-<uuid>",
                              #  "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    sel.summary()             # which GPUs and why, and why not the others

A GPU is free when no other process holds it, its used memory is at the idle level of a driver
context (a process in another container holds memory but is invisible to us), and it has the
run's need free (its estimate plus a margin for the CUDA context; ``MIN_FREE_MB`` without one).
``auto`` (and a count, ``cluster.gpus: N``) takes the free GPUs with the most free memory. A
request that cannot be met raises a UserError, one line, naming each GPU left out and why (the
process holding it: pid, name, memory; or its free memory against the need and the need's parts)
and the fix. Each process gets one GPU, named by UUID: CUDA's own numbering follows
CUDA_DEVICE_ORDER (fastest first by default), NVML's the PCI bus, and a UUID means the same GPU
to both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from clusterflow.errors import UserError
from clusterflow.observe import nvml

# A driver context with no process (persistence mode, MIG, ECC) stays under this.
IDLE_USED_MB = 1024
# The least free memory of a GPU taken when the run's need is not known.
MIN_FREE_MB = 2048


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


# The CUDA context and the caching allocator's slack, on top of what the run's tensors need.
CONTEXT_MB = 1024


@dataclass(frozen=True)
class Need:
    """What one process of the run needs on its GPU: bytes by part (``train/memory_estimate.py``'s
    estimate), and the margin for the CUDA context."""

    parts: Mapping[str, int]
    margin_mb: float = CONTEXT_MB

    @property
    def total_mb(self) -> float:
        return sum(self.parts.values()) / 2**20 + self.margin_mb

    def line(self) -> str:
        """The estimate with its parts, in one clause."""
        parts = ", ".join(f"{k} {_gib(v / 2**20)}" for k, v in self.parts.items())
        return (
            f"the run needs about {_gib(self.total_mb)} per GPU ({parts}, "
            f"CUDA context {_gib(self.margin_mb)})"
        )


@dataclass(frozen=True)
class Selection:
    indices: tuple[int, ...]  # NVML indices, one per local process, in local-rank order
    uuids: tuple[str | None, ...]
    reasons: Mapping[int, str]  # every GPU of the snapshot: why it was taken or not
    need: Need | None = None

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
        if self.need is not None:
            lines.append(f"  {self.need.line()}")
        lines += [
            f"  GPU {i}: {'used' if i in self.indices else 'not used'}, {why}"
            for i, why in sorted(self.reasons.items())
        ]
        return "\n".join(lines)


def select_gpus(
    snapshot: Sequence[Mapping[str, Any]] | None,
    want: int,
    request: str | int | Sequence[int] = "auto",
    *,
    need: Need | None = None,
    min_free_mb: float = MIN_FREE_MB,
    idle_used_mb: float = IDLE_USED_MB,
    ignore_pids: Iterable[int] = (),
    cuda_visible_devices: str | None = None,
) -> Selection:
    """Choose ``want`` GPUs: the free ones with the most free memory ("auto" or a count, within
    CUDA_VISIBLE_DEVICES when set), or exactly the listed NVML indices, each of which must be
    free. With ``need``, a GPU must have the run's need free (``min_free_mb`` otherwise)."""
    asked = (
        f"cluster.gpus={request}" if isinstance(request, int) else f"cluster.gpus_per_node={want}"
    )
    if not snapshot:
        raise UserError(
            f"{asked} asks for GPUs, but NVML sees none on this machine "
            "(no NVIDIA driver, or nvidia-ml-py missing: pip install 'clusterflow[gpu]'); "
            "set cluster.gpus_per_node=0 to run on CPU"
        )
    ignore = tuple(ignore_pids)
    floor = need.total_mb if need is not None else min_free_mb
    verdicts = {int(g["index"]): classify(g, floor, idle_used_mb, ignore) for g in snapshot}
    reasons = {i: why for i, (_, why) in verdicts.items()}
    by_index = {int(g["index"]): g for g in snapshot}
    if request == "auto" or isinstance(request, int):
        chosen = _auto(
            snapshot,
            verdicts,
            reasons,
            want,
            cuda_visible_devices=cuda_visible_devices,
            asked=asked,
            need=need,
        )
    else:
        chosen = _explicit(request, verdicts, by_index, want, need)
    return Selection(tuple(chosen), tuple(by_index[i].get("uuid") for i in chosen), reasons, need)


def _free_mb(gpu: Mapping[str, Any]) -> float:
    return (gpu.get("memory_total_mb") or 0) - (gpu.get("memory_used_mb") or 0)


def _auto(
    snapshot: Sequence[Mapping[str, Any]],
    verdicts: Mapping[int, tuple[bool, str]],
    reasons: dict[int, str],
    want: int,
    *,
    cuda_visible_devices: str | None,
    asked: str,
    need: Need | None,
) -> list[int]:
    allowed = _visible(snapshot, cuda_visible_devices)
    for i in verdicts:
        if i not in allowed:
            reasons[i] = f"hidden by CUDA_VISIBLE_DEVICES={cuda_visible_devices}"
    free_mb = {int(g["index"]): _free_mb(g) for g in snapshot}
    free = [i for i in sorted(verdicts) if i in allowed and verdicts[i][0]]
    if len(free) >= want:
        # The most free memory first (a stable sort: equal ones in nvidia-smi order).
        return sorted(free, key=lambda i: -free_mb[i])[:want]
    taken = "; ".join(f"GPU {i} {reasons[i]}" for i in sorted(verdicts) if i not in free)
    fewer = "cluster.gpus" if asked.startswith("cluster.gpus=") else "cluster.gpus_per_node"
    fix = (
        f"lower {fewer} to {len(free)}, " if free else ""
    ) + "wait for or stop the processes holding them, or name GPUs with cluster.gpus=[...]"
    said = f" ({need.line()})" if need is not None else ""
    raise UserError(
        f"{asked} but only {len(free)} of {len(verdicts)} GPUs are free "
        f"({', '.join(map(str, free)) or 'none'}): {taken}{said}; {fix}"
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
    request: str | Sequence[int],
    verdicts: Mapping[int, tuple[bool, str]],
    by_index: Mapping[int, Any],
    want: int,
    need: Need | None,
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
            said = f" ({need.line()})" if need is not None else ""
            raise UserError(
                f"cluster.gpus={listed}: GPU {i} is {why}{said}; {alt}, use cluster.gpus=auto, "
                "or wait for or stop that process"
            )
    return listed


def for_local(
    gpus_per_node: int,
    request: str | int | Sequence[int],
    environ: Mapping[str, str],
    need: Callable[[], Need | None] = lambda: None,
) -> list[int] | None:
    """`submit --local`: the NVML indices its processes use (None on CPU), said on stdout with why
    (and with what the run needs, by part). The processes see them in PCI bus order
    (CUDA_DEVICE_ORDER=PCI_BUS_ID, set by the caller), so local rank i runs on the i-th chosen
    GPU. ``need`` is asked only once NVML sees GPUs (it builds the model)."""
    if gpus_per_node <= 0:
        return None
    seen = nvml.read_snapshot()
    sel = select_gpus(
        seen,
        gpus_per_node,
        request,
        need=need() if seen else None,
        cuda_visible_devices=environ.get("CUDA_VISIBLE_DEVICES"),
    )
    print(sel.summary())
    return list(sel.indices)
