"""GPUs as NVML sees them: one thin reader that builds a plain snapshot, and pure functions over
it.

The snapshot is a list of dicts, one per GPU, in NVML's order (PCI bus order, as nvidia-smi
shows):

    {"index": 0, "uuid": "GPU-...", "name": "NVIDIA H100 80GB HBM3",
     "memory_total_mb": 81559, "memory_used_mb": 523, "util_pct": 0, "temp_c": 31,
     "processes": [{"pid": 4242, "name": "python", "used_mb": 30000}]}

Everything that decides something (heartbeat fields, GPU selection in ``launch/gpus.py``) works
on that dict, so it is table-tested without a GPU. :func:`read_snapshot` is the only code that
talks to the driver; it returns None when nvidia-ml-py (``pip install clusterflow[gpu]``) or the
driver is missing, and a field NVML cannot read (utilisation on some MIG slices, temperature in
some VMs) is left out.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

MB = 2**20


def read_snapshot() -> list[dict[str, Any]] | None:
    """Every GPU NVML can see, or None without nvidia-ml-py or a working driver."""
    try:
        import pynvml  # from nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound / DriverNotLoaded: no GPU here
        return None
    try:
        return [_read_gpu(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # noqa: BLE001 - a GPU that fell off the bus must not break monitoring
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _read_gpu(nv: types.ModuleType, index: int) -> dict[str, Any]:
    h = nv.nvmlDeviceGetHandleByIndex(index)
    mem = nv.nvmlDeviceGetMemoryInfo(h)
    gpu: dict[str, Any] = {
        "index": index,
        "uuid": _text(nv.nvmlDeviceGetUUID(h)),
        "name": _text(nv.nvmlDeviceGetName(h)),
        "memory_total_mb": mem.total // MB,
        "memory_used_mb": mem.used // MB,
    }
    for key, read in (
        ("util_pct", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu),
        ("temp_c", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
    ):
        try:
            gpu[key] = int(read())
        except Exception:  # noqa: BLE001 - not supported on this device: leave the field out
            pass
    procs = {}
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            for p in getattr(nv, getter)(h):
                used = getattr(p, "usedGpuMemory", None)
                procs[p.pid] = {
                    "pid": p.pid,
                    "name": process_name(p.pid),
                    "used_mb": used // MB if isinstance(used, int) else None,
                }
        except Exception:  # noqa: BLE001
            pass
    gpu["processes"] = sorted(procs.values(), key=lambda p: p["pid"])
    return gpu


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def process_name(pid: int) -> str:
    """The command name of ``pid`` ("?" when it runs in another PID namespace, e.g. another
    container)."""
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8") as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"


def gpu_fields(gpu: Mapping[str, Any] | None) -> dict[str, Any]:
    """The per-GPU fields a heartbeat carries (and `status --ranks` shows); absent values are
    left out."""
    if not gpu:
        return {}
    out = {
        "gpu_index": gpu.get("index"),
        "gpu_name": gpu.get("name"),
        "gpu_mem_used_mb": gpu.get("memory_used_mb"),
        "gpu_mem_total_mb": gpu.get("memory_total_mb"),
        "gpu_util_pct": gpu.get("util_pct"),
        "gpu_temp_c": gpu.get("temp_c"),
    }
    return {k: v for k, v in out.items() if v is not None}


def find_gpu(
    snapshot: list[Mapping[str, Any]] | None, ident: int | str | None
) -> Mapping[str, Any] | None:
    """The snapshot entry for an NVML index or a UUID (``GPU-...``; a prefix is enough, as CUDA
    accepts)."""
    if snapshot is None or ident is None:
        return None
    for gpu in snapshot:
        if isinstance(ident, int) and gpu.get("index") == ident:
            return gpu
        if isinstance(ident, str) and str(gpu.get("uuid", "")).startswith(ident):
            return gpu
    return None


def nvml_id_for_torch_device(
    device_index: int, cuda_visible_devices: str | None
) -> int | str | None:
    """Which NVML GPU is torch's ``cuda:<device_index>``.

    torch numbers only the GPUs in CUDA_VISIBLE_DEVICES, NVML numbers all of them, so cuda:0 under
    ``CUDA_VISIBLE_DEVICES=3,5`` is NVML's GPU 3. Entries may be indices or UUIDs (``GPU-...``,
    ``MIG-...``); None when the variable does not name that device. Indices in the variable follow
    CUDA_DEVICE_ORDER; they equal NVML's only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or on a node
    of identical GPUs (CUDA breaks speed ties by PCI order), hence UUIDs when in doubt. (Under
    Slurm with ConstrainDevices the job sees only its own GPUs; prefer passing the device's UUID
    from ``torch.cuda.get_device_properties(i).uuid`` to :func:`find_gpu` there.)
    """
    if cuda_visible_devices is None:
        return device_index
    entries = [e.strip() for e in cuda_visible_devices.split(",") if e.strip()]
    if device_index >= len(entries):
        return None
    entry = entries[device_index]
    if entry.isdigit():
        return int(entry)
    if entry.startswith(("GPU-", "MIG-")):
        return entry
    return None
