"""Supervised classification on the synthetic identity data: stage 2 of a two-stage run (start
from a contrastive stage-1 encoder with ``task.init_from``) or a classifier on long-tailed classes
with a class-weighted loss.

Evaluation reports accuracy, macro F1 and balanced accuracy over the held-out split. Each rank
scores its shard and returns per-class counts; the counts are summed across ranks before F1 is
computed, so the numbers are those of the whole eval set, whatever the number of ranks.
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
import torch
from torch import nn

from clusterflow.errors import UserError
from clusterflow.tasks import Range, Task
from clusterflow.tasks.pseudo_id import (
    EmbedDim,
    Encoder,
    Hidden,
    IdDim,
    Identities,
    InputDim,
    Keep,
    NonNegative,
    NuisanceDim,
    SyntheticIdentities,
    identity_data,
)


class Classifier(Encoder):
    """The demo encoder (same parameter names, so a stage-1 ``model.pt`` loads into it) plus a
    cosine-softmax head: logits = scale * <normalised feature, normalised class weight>."""

    def __init__(
        self, input_dim: int, hidden: int, embed_dim: int, classes: int, scale: float = 16.0
    ) -> None:
        super().__init__(input_dim, hidden, embed_dim)
        self.head = nn.Linear(embed_dim, classes, bias=False)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (
            self.scale * super().forward(x) @ nn.functional.normalize(self.head.weight, dim=-1).t()
        )


def long_tail_counts(classes: int, largest: int, imbalance: float) -> np.ndarray:
    """Samples per class, geometric from ``largest`` down to ``largest / imbalance`` (at least
    2)."""
    if imbalance <= 1:
        return np.full(classes, largest)
    decay = np.power(1.0 / imbalance, np.arange(classes) / max(1, classes - 1))
    return np.maximum(2, np.round(largest * decay)).astype(np.int64)


class ClassifierTask(Task):
    """Parameters (``task.params``): identities (classes), samples_per_identity (of the largest
    class), imbalance (largest / smallest class, 1 = balanced), class_weights ("none" or
    "balanced"), label_smoothing, train_backbone, eval_samples_per_identity, and the data and
    encoder shape of PseudoIDTask (input_dim, id_dim, nuisance_dim, nuisance_scale, noise, hidden,
    embed_dim, keep), with the same ranges."""

    def __init__(
        self,
        seed: int = 0,
        *,
        identities: Identities = 100,
        samples_per_identity: Identities = 20,
        imbalance: Annotated[float, Range(1)] = 1.0,
        class_weights: str = "none",
        label_smoothing: Annotated[float, Range(0, 1, open_max=True)] = 0.0,
        train_backbone: bool = True,
        eval_samples_per_identity: Annotated[int, Range(1)] = 4,
        input_dim: InputDim = 64,
        id_dim: IdDim = 8,
        nuisance_dim: NuisanceDim = 16,
        nuisance_scale: NonNegative = 1.5,
        noise: NonNegative = 0.1,
        hidden: Hidden = 128,
        embed_dim: EmbedDim = 32,
        keep: Keep = 0.5,
    ) -> None:
        self.seed = seed
        if class_weights not in ("none", "balanced"):
            raise UserError(
                f"task.params.class_weights = {class_weights!r}; use 'none' or 'balanced'"
            )
        self.classes = identities
        self.counts = long_tail_counts(identities, samples_per_identity, imbalance)
        # SyntheticIdentities' arguments after the seed, but the samples per identity.
        self.data_args = {
            "world": identity_data(
                identities,
                input_dim,
                id_dim,
                nuisance_dim=nuisance_dim,
                nuisance_scale=nuisance_scale,
                noise=noise,
                keep=keep,
            )
        }
        self.eval_per_class = eval_samples_per_identity
        self.hidden, self.embed_dim = hidden, embed_dim
        self.label_smoothing, self.train_backbone = label_smoothing, train_backbone
        self.weights: torch.Tensor | None = None
        if class_weights == "balanced":
            # scikit-learn takes about a second to import; submit imports this module
            from sklearn.utils.class_weight import compute_class_weight

            w = compute_class_weight(
                "balanced",
                classes=np.arange(identities),
                y=np.repeat(np.arange(identities), self.counts),
            )
            self.weights = torch.tensor(w, dtype=torch.float32)
        self._train: SyntheticIdentities | None = None

    def build_model(self) -> nn.Module:
        model = Classifier(
            self.data_args["world"].input_dim, self.hidden, self.embed_dim, self.classes
        )
        if not self.train_backbone:  # a linear probe on a stage-1 encoder
            for p in model.net.parameters():
                p.requires_grad_(False)
        return model

    def train_dataset(self) -> SyntheticIdentities:
        if self._train is None:
            self._train = SyntheticIdentities(
                self.seed, samples_per_identity=self.counts, **self.data_args, split=0
            )
        return self._train

    def eval_dataset(self) -> SyntheticIdentities:
        # Balanced held-out samples of the same classes: macro F1 weighs rare classes like common
        # ones.
        return SyntheticIdentities(
            self.seed,
            samples_per_identity=self.eval_per_class,
            **self.data_args,
            split=1,
            augment=False,
        )

    def set_epoch(self, epoch: int) -> None:
        self.train_dataset().epoch = epoch

    def loss(
        self, model: nn.Module, batch: dict[str, Any], labels: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = model(batch["x1"]).float()
        y = batch["label"]
        weight = self.weights.to(logits.device) if self.weights is not None else None
        loss = nn.functional.cross_entropy(
            logits, y, weight=weight, label_smoothing=self.label_smoothing
        )
        return loss, {
            "accuracy": (logits.argmax(1) == y).float().mean()
        }  # a tensor: read back on log steps only

    def eval_step(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> dict[str, tuple[torch.Tensor | float, float]]:
        logits = model(batch["x"]).float()
        y = batch["label"]
        pred = logits.argmax(1)
        n = float(len(y))
        c = self.classes
        return {
            "eval/loss": (float(nn.functional.cross_entropy(logits, y, reduction="sum")), n),
            "eval/accuracy": (float((pred == y).sum()), n),
            "true_per_class": (torch.bincount(y, minlength=c), 0.0),
            "pred_per_class": (torch.bincount(pred, minlength=c), 0.0),
            "hit_per_class": (torch.bincount(y[pred == y], minlength=c), 0.0),
        }

    def eval_metrics(self, totals: dict[str, tuple[np.ndarray | float, float]]) -> dict[str, float]:
        out = super().eval_metrics(totals)
        true, pred, hit = (
            np.asarray(totals[k][0]) for k in ("true_per_class", "pred_per_class", "hit_per_class")
        )
        seen = (true + pred) > 0  # the classes sklearn's f1_score(average="macro") averages over
        f1 = np.where(seen, 2 * hit / np.maximum(true + pred, 1), 0.0)
        out["eval/macro_f1"] = float(f1[seen].mean()) if seen.any() else 0.0
        present = true > 0
        out["eval/balanced_accuracy"] = (
            float((hit[present] / true[present]).mean()) if present.any() else 0.0
        )
        return out
