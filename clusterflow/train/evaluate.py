"""Evaluation on every rank, reduced exactly: each rank scores its contiguous shard of the eval set,
sums and counts are added across ranks in one all-reduce, and the task turns the totals into
metrics. So 1 rank and N ranks report the same numbers (a mean of per-rank means would not, and
macro F1 cannot be averaged at all; it needs the summed per-class counts).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import Dataset

from clusterflow.distributed import comm as dist
from clusterflow.distributed.sampler import shard_range
from clusterflow.tasks import Task


def _as_array(value: torch.Tensor | npt.ArrayLike) -> np.ndarray:
    if torch.is_tensor(value):
        value = value.detach().float().cpu().numpy()
    return np.atleast_1d(np.asarray(value, dtype=np.float64))


def evaluate(
    task: Task,
    model: torch.nn.Module,
    dataset: Dataset,
    device: torch.device,
    amp: torch.dtype | None,
    batch_size: int,
    *,
    tick: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Collective: every rank must call it. Returns the same metrics on every rank. ``tick()``
    once per batch."""
    shard = shard_range(len(dataset), dist.rank(), dist.world())
    loader = torch.utils.data.DataLoader(
        torch.utils.data.Subset(dataset, list(shard)), batch_size=max(1, batch_size)
    )
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, float] = {}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for batch in loader:
            batch = {
                k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v
                for k, v in batch.items()
            }
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                out = task.eval_step(model, batch)
            for k, (s, c) in out.items():
                s = _as_array(s)
                sums[k] = sums[k] + s if k in sums else s
                counts[k] = counts.get(k, 0.0) + float(c)
            if tick is not None:
                tick()
    model.train(was_training)
    # Every rank reduces the same keys with the same sizes, even one whose shard was empty.
    shapes: dict[str, int] = {}
    for part in dist.gather_object({k: len(v) for k, v in sums.items()}) or []:
        shapes.update(part)
    shapes = dist.broadcast_object(dict(sorted(shapes.items())))
    flat = (
        np.concatenate(
            [
                np.concatenate([sums.get(k, np.zeros(n)), [counts.get(k, 0.0)]])
                for k, n in shapes.items()
            ]
        )
        if shapes
        else np.zeros(0)
    )
    flat = dist.all_reduce_sum(flat, device)
    totals: dict[str, tuple[float | np.ndarray, float]] = {}
    i = 0
    for k, n in shapes.items():
        s = flat[i : i + n]
        totals[k] = (float(s[0]) if n == 1 else s, float(flat[i + n]))
        i += n + 1
    return task.eval_metrics(totals)
