"""A sparse autoencoder (dictionary learning on activations), the kind used to interpret a model's
hidden states, on synthetic activations whose true dictionary is known.

Each activation is a sparse non-negative mix of ``features`` unit directions in ``dim`` dimensions
(feature i fires with a probability that falls off as a power law, as in real activations) plus
noise. The autoencoder is ``z = relu(W_enc (x - b_dec) + b_enc)``, ``x_hat = W_dec z + b_dec``,
trained on ``mse + l1 * sum_i z_i * ||W_dec[:, i]||`` (the penalty scaled by the decoder norms, so
shrinking codes cannot be offset by growing the decoder).

Logged every step: mse, l1, l0 (active latents per sample) and explained variance. Evaluation
adds dictionary recovery: the mean, over true features, of the best cosine with a decoder column.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from clusterflow.errors import UserError
from clusterflow.tasks import Task


class SyntheticActivations(Dataset):
    def __init__(
        self,
        seed: int,
        samples: int,
        dim: int,
        features: int,
        active: float,
        noise: float,
        *,
        split: int = 0,
    ) -> None:
        rng = np.random.default_rng([seed, 21])
        d = rng.standard_normal((features, dim)).astype(np.float32)
        self.dictionary = d / np.linalg.norm(d, axis=1, keepdims=True)
        ranks = np.arange(1, features + 1, dtype=np.float64)
        p = ranks**-0.7
        self.p = np.minimum(1.0, p * active / p.sum()).astype(
            np.float64
        )  # about `active` features fire per sample
        self.seed, self.split, self.samples, self.noise = seed, split, samples, noise

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        rng = np.random.default_rng(
            [self.seed, 23, self.split, index]
        )  # depends on the index only, never the rank
        on = rng.random(len(self.p)) < self.p
        codes = np.zeros(len(self.p), dtype=np.float32)
        codes[on] = rng.exponential(1.0, int(on.sum())).astype(np.float32)
        x = codes @ self.dictionary + self.noise * rng.standard_normal(
            self.dictionary.shape[1]
        ).astype(np.float32)
        return {"x": torch.from_numpy(x.astype(np.float32)), "index": index}


class SparseAutoencoder(nn.Module):
    def __init__(self, dim: int, latents: int) -> None:
        super().__init__()
        self.enc = nn.Linear(dim, latents)
        self.dec = nn.Linear(latents, dim)
        with torch.no_grad():  # tied start: decoder columns of unit norm, encoder their transpose
            self.dec.weight.copy_(nn.functional.normalize(self.dec.weight, dim=0))
            self.enc.weight.copy_(self.dec.weight.t())
            self.enc.bias.zero_()
            self.dec.bias.zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.relu(self.enc(x - self.dec.bias))
        return self.dec(z), z


class SparseAutoencoderTask(Task):
    """Parameters (``task.params``): samples, dim, features (true dictionary size), latents
    (autoencoder width), active (mean true features per sample), noise, l1, eval_samples."""

    def __init__(
        self,
        seed: int = 0,
        *,
        samples: int = 20000,
        dim: int = 64,
        features: int = 256,
        latents: int = 512,
        active: float = 5.0,
        noise: float = 0.01,
        l1: float = 1.0,
        eval_samples: int = 2000,
    ) -> None:
        self.seed = seed
        checks = {
            "samples": samples >= 2,
            "dim": dim >= 2,
            "features": features >= 2,
            "latents": latents >= 2,
            "active": 0 < active <= features,
            "noise": noise >= 0,
            "l1": l1 >= 0,
            "eval_samples": eval_samples >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise UserError(
                    f"task.params.{name} = {locals()[name]!r} "
                    "is out of range for SparseAutoencoderTask"
                )
        self.args = {"dim": dim, "features": features, "active": active, "noise": noise}
        self.samples, self.eval_samples, self.latents, self.l1 = samples, eval_samples, latents, l1
        self._train: SyntheticActivations | None = None

    def build_model(self) -> nn.Module:
        return SparseAutoencoder(self.args["dim"], self.latents)

    def train_dataset(self) -> SyntheticActivations:
        if self._train is None:
            self._train = SyntheticActivations(self.seed, self.samples, **self.args, split=0)
        return self._train

    def eval_dataset(self) -> SyntheticActivations:
        return SyntheticActivations(self.seed, self.eval_samples, **self.args, split=1)

    @staticmethod
    def _parts(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
        x_hat, z = model(x)
        inner = model.module if hasattr(model, "module") else model  # DDP wraps the module
        mse = ((x_hat.float() - x) ** 2).sum(1)
        l1 = (z.float() * inner.dec.weight.norm(dim=0)).sum(1)
        return {
            "mse": mse,
            "l1": l1,
            "l0": (z > 0).float().sum(1),
            "var": ((x - x.mean(0)) ** 2).sum(1),
        }

    def loss(
        self, model: nn.Module, batch: dict[str, Any], labels: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        p = self._parts(model, batch["x"])
        loss = p["mse"].mean() + self.l1 * p["l1"].mean()
        p = {k: v.detach() for k, v in p.items()}
        # Tensors: the trainer reads them back on log steps only.
        metrics = {
            "mse": p["mse"].mean(),
            "l1": p["l1"].mean(),
            "l0": p["l0"].mean(),
            "explained_variance": 1 - p["mse"].sum() / p["var"].sum().clamp_min(1e-12),
        }
        return loss, metrics

    def eval_step(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> dict[str, tuple[torch.Tensor | float, float]]:
        x = batch["x"]
        p = self._parts(model, x)
        n = float(len(x))
        dictionary = torch.from_numpy(self.train_dataset().dictionary).to(x.device)
        cos = dictionary @ nn.functional.normalize(
            model.dec.weight.float(), dim=0
        )  # (features, latents)
        return {
            "eval/mse": (float(p["mse"].sum()), n),
            "eval/l0": (float(p["l0"].sum()), n),
            "sq_err": (float(p["mse"].sum()), 0.0),
            "sq_sum": (float((x.float() ** 2).sum()), 0.0),
            "x_sum": (x.float().sum(0), 0.0),
            "eval/dictionary_recovery": (float(cos.max(1).values.mean()), 1.0),
        }

    def eval_metrics(self, totals: dict[str, tuple[np.ndarray | float, float]]) -> dict[str, float]:
        out = {k: s / max(c, 1e-12) for k, (s, c) in totals.items() if k.startswith("eval/")}
        n = totals["eval/mse"][1]
        mean = np.asarray(totals["x_sum"][0]) / max(n, 1)
        total_var = totals["sq_sum"][0] - n * float(
            mean @ mean
        )  # sum of squared deviations, from reduced sums
        out["eval/explained_variance"] = 1 - totals["sq_err"][0] / max(total_var, 1e-12)
        return out
