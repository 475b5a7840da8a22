"""The built-in demo: pseudo-ID contrastive learning on a synthetic identity dataset.

The data stands in for face or re-identification crops, without a download. Each sample is

    x = A · identity_code[y] + B · nuisance_i + noise

where the identity code lives in a small subspace and the per-sample nuisance ("pose, lighting")
in another one with larger variance. A randomly initialised encoder mixes both, so clustering its
embeddings groups samples by nuisance as much as by identity. Two augmented views of a sample
share its identity but resample part of its nuisance; contrastive learning on them, then on the
pseudo-identities mined between epochs, teaches the encoder to ignore the nuisance, and the
mined clusters approach the true identities round after round.

Everything is generated from ``run.seed``; each view depends only on (seed, epoch, index, view),
never on which rank draws it, so 1 and N processes see the same data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from clusterflow.tasks import Range, Task
from clusterflow.tasks.losses import supcon_loss


@dataclass(frozen=True)
class IdentityWorld:
    """The synthetic world the samples come from: ``identities`` identities, each a code of
    ``id_dim`` dimensions, seen in ``input_dim`` dimensions with ``nuisance_dim`` nuisance
    dimensions at ``nuisance_scale``, ``noise`` on top; ``keep``: how much of a sample's nuisance
    an augmented view keeps."""

    identities: int
    input_dim: int
    id_dim: int
    nuisance_dim: int
    nuisance_scale: float
    noise: float
    keep: float = 0.5


class SyntheticIdentities(Dataset):
    """``world.identities`` x ``samples_per_identity`` samples of dimension ``world.input_dim``,
    shuffled."""

    def __init__(
        self,
        seed: int,
        world: IdentityWorld,
        samples_per_identity: int | np.ndarray,
        *,
        augment: bool = True,
        split: int = 0,
    ) -> None:
        identities, input_dim, id_dim = world.identities, world.input_dim, world.id_dim
        nuisance_dim, nuisance_scale = world.nuisance_dim, world.nuisance_scale
        noise, keep = world.noise, world.keep
        rng = np.random.default_rng([seed, 7])  # the world: shared by every split
        self.A = rng.standard_normal((id_dim, input_dim)).astype(np.float32) / np.sqrt(id_dim)
        self.B = rng.standard_normal((nuisance_dim, input_dim)).astype(np.float32) / np.sqrt(
            nuisance_dim
        )
        codes = rng.standard_normal((identities, id_dim)).astype(np.float32)
        srng = np.random.default_rng([seed, 11, split])  # the samples of this split
        per_identity = np.broadcast_to(
            np.asarray(samples_per_identity), (identities,)
        )  # one count, or one per identity
        self.labels = srng.permutation(np.repeat(np.arange(identities), per_identity)).astype(
            np.int64
        )
        n = len(self.labels)
        self.nuisance = srng.standard_normal((n, nuisance_dim)).astype(np.float32) * nuisance_scale
        self.signal = codes[self.labels] @ self.A
        self.base = (
            self.signal
            + self.nuisance @ self.B
            + noise * srng.standard_normal((n, input_dim)).astype(np.float32)
        )
        self.A, self.B = self.A.astype(np.float32), self.B.astype(np.float32)
        self.signal, self.base = self.signal.astype(np.float32), self.base.astype(np.float32)
        self.seed, self.split, self.noise, self.keep, self.augment = (
            seed,
            split,
            noise,
            keep,
            augment,
        )
        self.nuisance_scale = nuisance_scale
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.labels)

    def _view(self, index: int, view: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 13, self.split, self.epoch, index, view])
        fresh = rng.standard_normal(self.nuisance.shape[1]).astype(np.float32) * self.nuisance_scale
        nuis = self.keep * self.nuisance[index] + float(np.sqrt(1 - self.keep**2)) * fresh
        eps = rng.standard_normal(self.base.shape[1]).astype(np.float32) * self.noise
        return (self.signal[index] + nuis @ self.B + eps).astype(np.float32)

    def __getitem__(self, index: int) -> dict[str, Any]:
        # "label" is the true identity: for supervised tasks and quality metrics, never for
        # pseudo-ID training.
        if not self.augment:
            return {
                "x": torch.from_numpy(self.base[index]),
                "index": index,
                "label": int(self.labels[index]),
            }
        return {
            "x1": torch.from_numpy(self._view(index, 0)),
            "x2": torch.from_numpy(self._view(index, 1)),
            "index": index,
            "label": int(self.labels[index]),
        }


class Encoder(nn.Module):
    """A small MLP; LayerNorm, not BatchNorm, so per-rank batch statistics never differ."""

    def __init__(self, input_dim: int, hidden: int, embed_dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(input_dim, hidden),
            nn.LayerNorm(hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.LayerNorm(hidden),
            nn.GELU(),
            nn.Linear(hidden, embed_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.net(x), dim=-1)


# The parameters of the synthetic identities and of the encoder, each range declared once: the
# tasks built on SyntheticIdentities (PseudoIDTask, ClassifierTask) take them under the same names.
Identities = Annotated[int, Range(2)]  # identities, samples_per_identity
InputDim = Annotated[int, Range(2)]
IdDim = Annotated[int, Range(1)]
NuisanceDim = Annotated[int, Range(0)]
NonNegative = Annotated[float, Range(0)]  # nuisance_scale, noise
Hidden = Annotated[int, Range(1)]
EmbedDim = Annotated[int, Range(2)]
Keep = Annotated[float, Range(0, 1)]


def identity_data(
    identities: int,
    input_dim: int,
    id_dim: int,
    *,
    nuisance_dim: int,
    nuisance_scale: float,
    noise: float,
    keep: float,
) -> IdentityWorld:
    """SyntheticIdentities' world from a task's parameters; ``nuisance_dim`` 0 means no
    nuisance: one nuisance dimension at scale 0."""
    return IdentityWorld(
        identities,
        input_dim,
        id_dim,
        nuisance_dim=max(nuisance_dim, 1),
        nuisance_scale=nuisance_scale if nuisance_dim else 0.0,
        noise=noise,
        keep=keep,
    )


class PseudoIDTask(Task):
    """Parameters (``task.params``): identities, samples_per_identity, input_dim, id_dim,
    nuisance_dim, nuisance_scale, noise, hidden, embed_dim, temperature, keep."""

    def __init__(
        self,
        seed: int = 0,
        *,
        identities: Identities = 100,
        samples_per_identity: Identities = 20,
        input_dim: InputDim = 64,
        id_dim: IdDim = 8,
        nuisance_dim: NuisanceDim = 16,
        nuisance_scale: NonNegative = 1.5,
        noise: NonNegative = 0.1,
        hidden: Hidden = 128,
        embed_dim: EmbedDim = 32,
        temperature: Annotated[float, Range(0, open_min=True)] = 0.1,
        keep: Keep = 0.5,
    ) -> None:
        self.seed = seed
        shape = identity_data(
            identities,
            input_dim,
            id_dim,
            nuisance_dim=nuisance_dim,
            nuisance_scale=nuisance_scale,
            noise=noise,
            keep=keep,
        )
        # SyntheticIdentities' arguments after the seed.
        self.data_args = {"world": shape, "samples_per_identity": samples_per_identity}
        self.hidden, self.embed_dim, self.temperature = hidden, embed_dim, temperature
        self._train: SyntheticIdentities | None = None
        self._embed: SyntheticIdentities | None = None

    def build_model(self) -> nn.Module:
        return Encoder(self.data_args["world"].input_dim, self.hidden, self.embed_dim)

    def train_dataset(self) -> SyntheticIdentities:
        if self._train is None:
            self._train = SyntheticIdentities(self.seed, **self.data_args, split=0)
        return self._train

    def eval_dataset(self) -> SyntheticIdentities:
        return SyntheticIdentities(
            self.seed, **{**self.data_args, "samples_per_identity": 4}, split=1
        )

    def embed_dataset(self) -> SyntheticIdentities:
        if self._embed is None:
            self._embed = SyntheticIdentities(self.seed, **self.data_args, split=0, augment=False)
        return self._embed

    def set_epoch(self, epoch: int) -> None:
        self.train_dataset().epoch = epoch

    def loss(
        self, model: nn.Module, batch: dict[str, Any], labels: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        index = batch["index"]
        n_total = len(self.train_dataset())
        if labels is None:
            # Before any mining round: each sample is its own identity (instance discrimination).
            ids = index
        else:
            # -1 (ignored singleton): its own views only.
            ids = torch.where(labels >= 0, labels, n_total + index)
        z = model(torch.cat([batch["x1"], batch["x2"]]))
        return supcon_loss(z.float(), torch.cat([ids, ids]), self.temperature)

    def eval_step(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, tuple[float, float]]:
        z = model(torch.cat([batch["x1"], batch["x2"]])).float()
        n = batch["x1"].shape[0]
        cos = (z[:n] * z[n:]).sum(1)
        return {"eval/view_cos": (float(cos.sum()), float(n))}

    def embed(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return model(batch["x"])

    def ground_truth(self) -> np.ndarray:
        return self.embed_dataset().labels
