"""Side effects on rank 0 only, through a null object; reading the metrics back; throughput.

Rank 0 gets a :class:`TensorBoardWriter`; every other rank gets a :class:`NullWriter` whose methods
do nothing, so call sites never test the rank.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.tensorboard import SummaryWriter

from clusterflow import rundir
from clusterflow.config.sections import TrackersConfig
from clusterflow.observe import scalar_log, trackers
from clusterflow.rundir.records import RunPaths


class NullWriter:
    def scalars(self, values: Mapping[str, float], step: int) -> None:
        pass

    def histogram(self, tag: str, values: np.ndarray | torch.Tensor, step: int) -> None:
        pass

    def text(self, tag: str, value: str, step: int) -> None:
        pass

    def image(self, tag: str, draw: Callable[[], np.ndarray], step: int) -> None:
        """``draw()`` returns an (H, W, 3) uint8 array; only a writer that keeps images calls it."""

    def flush(self) -> None:
        pass

    def tag(self, key: str, value: str) -> None:
        """A tracker tag (e.g. the newest checkpoint); TensorBoard has none."""

    def close(self, outcome: str = "") -> None:
        """``outcome``: how the attempt ends ("completed", "failed", "cancelled", or a stop)."""


class Every:
    """Due at most once per ``seconds`` (the first ask is due): for side effects that cost
    milliseconds on a network or journaling filesystem and need not happen at every log step."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self._last = seconds, -math.inf

    def due(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.seconds:
            return False
        self._last = now
        return True


class TensorBoardWriter(NullWriter):
    """One event file per attempt (SummaryWriter never reuses a file name), and the same scalars as
    JSON lines in ``metrics.jsonl``.

    Every attempt starts its events with a TensorBoard START at ``purge_step`` (a fresh run too:
    an attempt killed before its first checkpoint leaves steps that the next one logs again), so
    TensorBoard drops what earlier attempts logged at or after it; ``metrics.jsonl`` gets a marker
    row with the same step, and :func:`read_metrics` applies the same rule.

    ``metrics.jsonl`` gets every row at once (one write call). The event file is flushed at most
    every ``FLUSH_S`` seconds (a flush waits for SummaryWriter's thread: about a millisecond per
    log step), and the trainer flushes it before every checkpoint and after logging that
    checkpoint's own scalars (``flush``), so a killed attempt loses no point that the next
    attempt does not log again: it resumes from a checkpoint and logs every later step.

    The scalars also go to the experiment trackers configured (``trackers/``), each fed from its
    own thread; each sends first what earlier attempts left in ``metrics.jsonl`` before
    ``purge_step`` and it does not hold yet.
    """

    FLUSH_S = 5.0
    # How long the end of an attempt waits for each tracker's queue: a run that ended has no later
    # attempt to send what is left; a stop does (from metrics.jsonl), and must exit in its grace.
    TRACKER_WAIT_S = 60.0
    TRACKER_STOP_WAIT_S = 5.0

    def __init__(
        self,
        paths: RunPaths,
        attempt: int,
        purge_step: int,
        trackers_cfg: TrackersConfig | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self._w = SummaryWriter(
            log_dir=paths.tb, purge_step=purge_step, filename_suffix=f".attempt{attempt}"
        )
        self._jsonl = rundir.open_jsonl(paths.metrics)
        self._attempt = attempt
        self._flush_due = Every(self.FLUSH_S)
        self._row({"step": purge_step, "attempt": attempt, "purge_step": purge_step})
        self._trackers = (
            trackers.start(trackers_cfg, paths, config or {}, lambda: _before(paths, purge_step))
            if trackers_cfg is not None
            else []
        )

    def _row(self, record: dict[str, Any]) -> None:
        self._jsonl.write((json.dumps(record) + "\n").encode())
        self._jsonl.flush()

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        for k, v in values.items():
            self._w.add_scalar(k, v, step)
        if self._flush_due.due():
            self._w.flush()
        self._row(
            {
                "step": step,
                "attempt": self._attempt,
                "time": round(time.time(), 3),
                **{k: float(v) for k, v in values.items()},
            }
        )
        for t in self._trackers:
            t.scalars(values, step)

    def tag(self, key: str, value: str) -> None:
        for t in self._trackers:
            t.tag(key, value)

    def histogram(self, tag: str, values: np.ndarray | torch.Tensor, step: int) -> None:
        self._w.add_histogram(tag, values, step)

    def text(self, tag: str, value: str, step: int) -> None:
        self._w.add_text(tag, value, step)

    def image(self, tag: str, draw: Callable[[], np.ndarray], step: int) -> None:
        self._w.add_image(tag, draw(), step, dataformats="HWC")
        self._w.flush()

    def flush(self) -> None:
        self._w.flush()

    def close(self, outcome: str = "") -> None:
        self._w.close()
        self._jsonl.close()
        ended = outcome in trackers.ENDED
        for t in self._trackers:
            t.close(outcome, self.TRACKER_WAIT_S if ended else self.TRACKER_STOP_WAIT_S)


def _before(paths: RunPaths, step: int) -> dict[int, dict[str, float]]:
    return {s: v for s, v in _read(paths).items() if s < step}


def writer_for(
    is_main: bool,
    paths: RunPaths,
    attempt: int,
    purge_step: int,
    trackers_cfg: TrackersConfig | None = None,
    config: Mapping[str, Any] | None = None,
) -> NullWriter:
    if not is_main:
        return NullWriter()
    return TensorBoardWriter(paths, attempt, purge_step, trackers_cfg, config)


def read_metrics(run_dir: str) -> dict[int, dict[str, float]]:
    """``{step: {tag: value}}`` from ``RUN_DIR/metrics.jsonl``, one value per (step, tag) as
    TensorBoard shows them: when an attempt starts, what earlier attempts logged at or after its
    ``purge_step`` (the first step it logs again) is dropped, and a later row wins over an
    earlier one at the same (step, tag). The entry for a path a user gives (docs/status.md)."""
    return _read(RunPaths(run_dir))


def _read(paths: RunPaths) -> dict[int, dict[str, float]]:
    return scalar_log.read(paths)


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
