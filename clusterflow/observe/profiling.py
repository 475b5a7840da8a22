"""``train.profile``: a torch.profiler trace of a window of global steps on chosen ranks.

The trainer calls ``begin(step)`` before an optimizer step's first micro-batch and ``end(step)``
after the step. Ranks and attempts outside the window get :class:`NoProfile`, whose methods do
nothing, so profiling off costs two empty calls a step. The trace is a Chrome trace
(``RUN_DIR/profile/rank<R>.attempt<A>.steps<F>-<L>.pt.trace.json``) that TensorBoard's profiler
view (``torch-tb-profiler``) and Perfetto (ui.perfetto.dev) open; its ``ProfilerStep#N`` spans
are the global steps. On a GPU a CUDA memory snapshot of the window is written beside it
(``.memory.pickle``, for pytorch.org/memory_viz).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from clusterflow.rundir.paths import RunPaths

log = logging.getLogger("clusterflow.profile")


class NoProfile:
    def begin(self, step: int) -> None:
        pass

    def end(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class StepProfile(NoProfile):
    """Profiles global steps ``first``..``last`` of this rank (those this attempt runs)."""

    def __init__(self, first: int, last: int, folder: str, name: str, cuda: bool) -> None:
        self.first, self.last, self.folder, self.name, self.cuda = first, last, folder, name, cuda
        self._prof: Any = None
        self._span: Any = None
        self._steps: list[int] = []

    def begin(self, step: int) -> None:
        if not self.first <= step <= self.last:
            return
        if self._prof is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            if self.cuda:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
            self._prof = profile(activities=activities, record_shapes=True, profile_memory=True)
            self._prof.start()
        # The span TensorBoard's profiler view splits steps by, named by the global step.
        self._span = record_function(f"ProfilerStep#{step}")
        self._span.__enter__()
        self._steps.append(step)

    def end(self, step: int) -> None:
        if self._span is None:
            return
        self._span.__exit__(None, None, None)
        self._span = None
        if step >= self.last:
            self._finish()

    def _finish(self) -> None:
        self._prof.stop()
        os.makedirs(self.folder, exist_ok=True)
        first, last = self._steps[0], self._steps[-1]
        base = os.path.join(self.folder, f"{self.name}.steps{first}-{last}")
        self._prof.export_chrome_trace(base + ".pt.trace.json")
        if self.cuda:
            torch.cuda.memory._dump_snapshot(base + ".memory.pickle")
            torch.cuda.memory._record_memory_history(enabled=None)
        log.info("profiled global steps %d-%d: %s.pt.trace.json", first, last, base)
        self._prof = None
        self.first = self.last + 1  # done: a later step is never profiled again

    def close(self) -> None:
        """A stop inside the window: the steps begun so far are written."""
        if self._span is not None:
            self._span.__exit__(None, None, None)
            self._span = None
        if self._prof is not None:
            self._finish()


def profile_for(
    window: tuple[int, int, tuple[int, ...]] | None,
    rank: int,
    attempt: int,
    paths: RunPaths,
    cuda: bool,
) -> NoProfile:
    if window is None or rank not in window[2]:
        return NoProfile()
    first, last, _ = window
    return StepProfile(first, last, paths.profile, f"rank{rank}.attempt{attempt}", cuda)
