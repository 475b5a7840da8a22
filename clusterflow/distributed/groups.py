"""Process groups of their own, for waits that must not share the default group's timeout or its
queue: the mining wait (ranks wait while rank 0 searches) and the stop agreement (an all-reduce
started at one step and read at the next).
"""

from __future__ import annotations

import datetime
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as tdist

from clusterflow.distributed import comm as dist


class Subgroup:
    """A gloo group with its own timeout, for waits that may outlast the default one (ranks wait
    in it while rank 0 runs the k-NN search). Collective to create: every rank, same order."""

    def __init__(self, timeout_s: int) -> None:
        self.group: tdist.ProcessGroup | None = None
        if dist.initialized():
            self.group = tdist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
            )

    def broadcast_object(self, obj: object, src: int = 0) -> Any:
        if self.group is None:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def gather_object(self, obj: object, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on ``dst`` (None elsewhere)."""
        if self.group is None:
            return [obj]
        out = [None] * tdist.get_world_size() if tdist.get_rank() == dst else None
        tdist.gather_object(obj, out, dst=dst, group=self.group)
        return out

    def broadcast_array(
        self, values: npt.NDArray[np.int64] | None, n: int, src: int = 0
    ) -> npt.NDArray[np.int64]:
        """Rank ``src``'s int64 array of length ``n`` on every rank (``values`` is ignored
        elsewhere)."""
        if self.group is None:
            return values
        t = torch.from_numpy(values) if dist.rank() == src else torch.empty(n, dtype=torch.int64)
        tdist.broadcast(t, src=src, group=self.group)
        return t.numpy()


class AsyncMax:
    """The element-wise maximum over ranks of a few integers per rank, started now and read later
    (``start``, then ``finish``), on a gloo group of its own. The buffer is a CPU tensor read
    through a numpy view, so neither end touches a CUDA stream or reads a device value: the loop
    can start one at a step boundary and read it at a later one without stopping the GPU's queue.
    Collective to create, and every rank must call ``start`` and ``finish`` in the same order."""

    def __init__(self, timeout_s: int, size: int = 1) -> None:
        self.group = Subgroup(timeout_s).group
        self._buf = torch.zeros(size, dtype=torch.int64)
        self._view = self._buf.numpy()  # shares the buffer: reads and writes without a tensor call
        self._work: tdist.Work | None = None
        self.pending = False

    def start(self, *values: int) -> None:
        if self.pending:
            raise RuntimeError(
                "AsyncMax.start while a reduce is in flight; this is a bug in clusterflow"
            )
        self._view[:] = values
        self.pending = True
        if self.group is not None:
            self._work = tdist.all_reduce(
                self._buf, op=tdist.ReduceOp.MAX, group=self.group, async_op=True
            )

    def finish(self) -> tuple[int, ...]:
        """The started reduce's result (waiting for it if it is still in flight); zeros when none
        was started."""
        if not self.pending:
            return (0,) * len(self._view)
        if self._work is not None:
            self._work.wait()
            self._work = None
        self.pending = False
        return tuple(int(v) for v in self._view)
