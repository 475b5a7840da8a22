"""What every k-NN engine shares: the parameters, the finished-blocks store, and how a query's
own id is dropped from its results."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from clusterflow.config.sections import MiningConfig


@dataclass(frozen=True)
class KnnParams:
    """How the k nearest others are found; the mining.* config keys of the same names."""

    k: int
    engine: str = "auto"  # auto, faiss or torch
    index: str = "flat"  # FAISS only: flat (exact), ivf or hnsw
    query_batch: int = 65536
    nlist: int = 1024  # ivf
    nprobe: int = 16  # ivf
    hnsw_m: int = 32  # hnsw
    ef_search: int = 128  # hnsw
    # FAISS: shard the index over every local GPU when the build has GPU support.
    use_gpu: bool = True

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")

    @classmethod
    def from_config(cls, mining: MiningConfig) -> KnnParams:
        return cls(
            k=mining.k,
            engine=mining.engine,
            index=mining.index,
            query_batch=mining.query_batch,
            nlist=mining.nlist,
            nprobe=mining.nprobe,
            hnsw_m=mining.hnsw_m,
            ef_search=mining.ef_search,
        )


class Blocks(Protocol):
    """Finished query blocks of one search, kept across attempts."""

    def get(self, start: int, rows: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(sims, ids) of the ``rows`` queries from ``start`` when an earlier attempt finished
        them."""

    def put(self, start: int, sims: np.ndarray, ids: np.ndarray) -> None:
        """The block of queries from ``start``, just computed."""


@dataclass(frozen=True)
class SearchHooks:
    """The caller's side of a long search: ``should_abort()``, checked before each query block
    (None: never); ``timings``, filled with where the time went; ``blocks``, the finished query
    blocks an earlier attempt kept; ``tick()``, once per ring hop (the heartbeat)."""

    should_abort: Callable[[], bool] | None = None
    timings: dict[str, Any] | None = None
    blocks: Blocks | None = None
    tick: Callable[[], None] | None = None


NO_HOOKS = SearchHooks()


def _drop_self(
    sims: np.ndarray, ids: np.ndarray, start: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Remove each query's own id from its k+1 results, keeping k."""
    q = np.arange(start, start + ids.shape[0])[:, None]
    is_self = ids == q
    # Rows where self was not returned (duplicates outranked it): drop the last column instead.
    no_self = ~is_self.any(1)
    is_self[no_self, -1] = True
    keep = ~is_self
    return sims[keep].reshape(len(ids), k), ids[keep].reshape(len(ids), k)


def k_others(
    best_s: np.ndarray | torch.Tensor, best_i: np.ndarray | torch.Tensor, start: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The top k+1 (or fewer, when the set is that small) of queries ``start..`` (numpy arrays or
    tensors), as numpy padded to k+1 columns, without each query itself: its k nearest others."""
    s_np, i_np = (t.cpu().numpy() if hasattr(t, "cpu") else t for t in (best_s, best_i))
    missing = k + 1 - s_np.shape[1]
    if missing > 0:
        s_np = np.pad(s_np, ((0, 0), (0, missing)), constant_values=-np.inf)
        i_np = np.pad(i_np, ((0, 0), (0, missing)), constant_values=-1)
    return _drop_self(s_np, i_np, start, k)
