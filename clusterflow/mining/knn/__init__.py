"""k nearest neighbours by inner product on L2-normalised rows, behind one interface.

:func:`search` finds, for every row, its ``k`` nearest *other* rows (self excluded) as ``(sims,
ids)`` arrays of shape (N, k), most similar first; missing neighbours (N <= k) are id -1, sim
-inf. :class:`KnnParams` says how (engine, FAISS index and its knobs, query batch). The engines:
``knn_faiss.py`` (FAISS: flat, ivf, hnsw; every local GPU with a GPU build) and ``knn_torch.py``
(exact chunked matmul + top-k, on every local GPU, or spread over every rank). Queries run in
batches of ``query_batch`` to bound memory, and ``should_abort`` is polled between batches so a
preemption signal can cut a long search short (the result is then None). ``blocks`` (a
:class:`Blocks`, ``mining_rounds.SearchBlocks`` in a mining round) hands back the query blocks an
earlier attempt finished and takes each block just computed, so a search cut short continues
where it stopped; a block's result does not depend on which others were computed with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

log = logging.getLogger("clusterflow.knn")


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
    use_gpu: bool = True  # FAISS: shard the index over every local GPU when the build has GPU support

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")

    @classmethod
    def from_config(cls, mining: Any) -> "KnnParams":
        return cls(k=mining.k, engine=mining.engine, index=mining.index, query_batch=mining.query_batch,
                   nlist=mining.nlist, nprobe=mining.nprobe, hnsw_m=mining.hnsw_m, ef_search=mining.ef_search)


class Blocks(Protocol):
    """Finished query blocks of one search, kept across attempts."""

    def get(self, start: int, rows: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(sims, ids) of the ``rows`` queries from ``start`` when an earlier attempt finished them."""

    def put(self, start: int, sims: np.ndarray, ids: np.ndarray) -> None:
        """The block of queries from ``start``, just computed."""


def faiss_available() -> bool:
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


def choose_engine(requested: str) -> tuple[str, str]:
    """Which engine runs, and why (logged with every mining round)."""
    import torch

    if requested == "faiss":
        if not faiss_available():
            raise RuntimeError("mining.engine=faiss but faiss is not installed; pip install faiss-cpu, or set mining.engine=torch")
        return "faiss", "asked for by mining.engine"
    if requested == "torch":
        return "torch", "asked for by mining.engine"
    if faiss_available():
        import faiss

        if torch.cuda.is_available() and not hasattr(faiss, "StandardGpuResources"):
            return "torch", "CUDA is available but this faiss build has no GPU support; the exact torch engine uses the GPU"
        return "faiss", "faiss is installed" + (" with GPU support" if hasattr(faiss, "StandardGpuResources") else " (CPU build)")
    return "torch", "faiss is not installed"


def search(x: np.ndarray, params: KnnParams, should_abort: Callable[[], bool] | None = None,
           timings: dict[str, Any] | None = None, blocks: Blocks | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """k nearest others of every (already normalised) row of ``x``, with the chosen engine.
    ``timings`` receives ``engine`` (which and why), ``index`` and ``search`` seconds."""
    name, why = choose_engine(params.engine)
    if timings is not None:
        timings["engine"] = f"{name} ({why})"
    if name == "torch":
        from clusterflow.mining.knn.torch_engine import torch_search

        if params.index != "flat":
            log.info("the torch engine is exact; mining.index=%s applies to faiss only", params.index)
        return torch_search(x, params.k, query_batch=params.query_batch, should_abort=should_abort, timings=timings,
                            blocks=blocks)
    from clusterflow.mining.knn.faiss_engine import faiss_search

    return faiss_search(x, params, should_abort=should_abort, timings=timings, blocks=blocks)


def _drop_self(sims: np.ndarray, ids: np.ndarray, start: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Remove each query's own id from its k+1 results, keeping k."""
    q = np.arange(start, start + ids.shape[0])[:, None]
    is_self = ids == q
    # Rows where self was not returned (duplicates outranked it): drop the last column instead.
    no_self = ~is_self.any(1)
    is_self[no_self, -1] = True
    keep = ~is_self
    return sims[keep].reshape(len(ids), k), ids[keep].reshape(len(ids), k)


def k_others(best_s: Any, best_i: Any, start: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top k+1 (or fewer, when the set is that small) of queries ``start..`` (numpy arrays or
    tensors), as numpy padded to k+1 columns, without each query itself: its k nearest others."""
    s_np, i_np = (t.cpu().numpy() if hasattr(t, "cpu") else t for t in (best_s, best_i))
    missing = k + 1 - s_np.shape[1]
    if missing > 0:
        s_np = np.pad(s_np, ((0, 0), (0, missing)), constant_values=-np.inf)
        i_np = np.pad(i_np, ((0, 0), (0, missing)), constant_values=-1)
    return _drop_self(s_np, i_np, start, k)
