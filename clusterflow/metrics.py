"""Side effects on rank 0 only, through a null object; throughput bookkeeping.

Rank 0 gets a :class:`TensorBoardWriter`; every other rank gets a :class:`NullWriter` whose methods
do nothing, so call sites never test the rank.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Mapping


class NullWriter:
    def scalars(self, values: Mapping[str, float], step: int) -> None:
        pass

    def histogram(self, tag: str, values: Any, step: int) -> None:
        pass

    def text(self, tag: str, value: str, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardWriter(NullWriter):
    """One event file per attempt (SummaryWriter never reuses a file name); ``purge_step`` tells
    TensorBoard to drop the steps an earlier attempt logged after the checkpoint we resumed from."""

    def __init__(self, logdir: str, attempt: int, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(log_dir=logdir, purge_step=purge_step, filename_suffix=f".attempt{attempt}")
        # The same scalars as JSON lines beside tb/, for scripts and tests that do not read event files.
        self._jsonl = open(os.path.join(os.path.dirname(logdir.rstrip("/")), "metrics.jsonl"), "a", encoding="utf-8")
        self._attempt = attempt

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        for k, v in values.items():
            self._w.add_scalar(k, v, step)
        self._w.flush()
        self._jsonl.write(json.dumps({"step": step, "attempt": self._attempt, **{k: float(v) for k, v in values.items()}}) + "\n")
        self._jsonl.flush()

    def histogram(self, tag: str, values: Any, step: int) -> None:
        self._w.add_histogram(tag, values, step)

    def text(self, tag: str, value: str, step: int) -> None:
        self._w.add_text(tag, value, step)

    def close(self) -> None:
        self._w.close()
        self._jsonl.close()


def writer_for(is_main: bool, logdir: str, attempt: int, purge_step: int | None) -> NullWriter:
    return TensorBoardWriter(logdir, attempt, purge_step) if is_main else NullWriter()


class Throughput:
    """Samples and seconds since the last report."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.samples = 0
        self.steps = 0

    def add(self, samples: int) -> None:
        self.samples += samples
        self.steps += 1

    def report(self) -> dict[str, float]:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        out = {"samples_per_s_rank": self.samples / dt, "step_time_s": dt / max(self.steps, 1)}
        self.reset()
        return out


def gpu_stats() -> dict[str, float]:
    """Per-GPU memory and utilisation from NVML, when GPUs and nvidia-ml-py exist."""
    try:
        import pynvml  # from nvidia-ml-py
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
        out = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            out[f"gpu{i}/mem_used_gb"] = mem.used / 2**30
            out[f"gpu{i}/util_pct"] = float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
        return out
    except Exception:  # noqa: BLE001 - monitoring must never fail a training step
        return {}
