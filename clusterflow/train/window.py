"""What the training loop sums between two log steps, kept where a step need not read it back."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from clusterflow.errors import UserError
from clusterflow.observe.metrics import Throughput


class LossWindow:
    """Sums over the micro-steps since the last log. Losses and tensor metrics stay on the device
    (float64, the same sums a Python float gives), so a step that does not log reads nothing back;
    a log step reads them all in one transfer. ``throughput`` counts the samples of each step."""

    def __init__(self) -> None:
        self.throughput = Throughput()  # resets itself at each report
        self.clear()

    def clear(self) -> None:
        self.loss: torch.Tensor | float = 0.0
        self.n = 0.0
        self.losses = 0  # additions that carried a loss
        self.extra: dict[str, torch.Tensor | float] = {}

    @staticmethod
    def _value(v: torch.Tensor | float, name: str = "loss") -> torch.Tensor | float:
        if not torch.is_tensor(v):
            return float(v)
        if v.numel() != 1:  # the shape is known on the host: checking it reads nothing back
            raise UserError(
                f"{name!r} has shape {tuple(v.shape)} (a task's loss() or run.step's loss= and "
                "metrics=); a loss and each metric must be one number (a 0-dim tensor or a "
                "float), e.g. metric.mean()"
            )
        return v.detach().reshape(()).to(torch.float64)

    def add(
        self, loss: torch.Tensor | float | None, metrics: Mapping[str, torch.Tensor | float]
    ) -> None:
        if loss is not None:
            self.loss = self.loss + self._value(loss)
            self.losses += 1
        self.n += 1
        for k, v in metrics.items():
            self.extra[k] = self.extra.get(k, 0.0) + self._value(v, k)

    def means(self) -> dict[str, float]:
        """Read on log steps only: the sums come back in one transfer (one sync on a GPU). No
        ``train/loss`` when no loss was added."""
        n = max(self.n, 1)
        sums = {
            **({"train/loss": self.loss} if self.losses else {}),
            **{f"train/{k}": v for k, v in self.extra.items()},
        }
        on_device = [k for k, v in sums.items() if torch.is_tensor(v)]
        if on_device:
            read = torch.stack([sums[k] for k in on_device]).tolist()
            sums.update(zip(on_device, read))
        return {k: float(v) / n for k, v in sums.items()}
