"""k nearest neighbours by inner product on L2-normalised rows, behind one interface.

:func:`search` finds, for every row, its ``k`` nearest *other* rows (self excluded) as ``(sims,
ids)`` arrays of shape (N, k), most similar first; missing neighbours (N <= k) are id -1, sim
-inf. :class:`KnnParams` says how (engine, FAISS index and its knobs, query batch). The engines:
``faiss_engine.py`` (FAISS: flat, ivf, hnsw; every local GPU with a GPU build) and
``torch_engine.py`` (exact chunked matmul + top-k, on every local GPU, or spread over every
rank). Queries run in batches of ``query_batch`` to bound memory, and ``should_abort`` is polled
between batches so a preemption signal can cut a long search short (the result is then None).
``blocks`` (a :class:`Blocks`, ``mining.rounds.SearchBlocks`` in a mining round) hands back the
query blocks an earlier attempt finished and takes each block just computed, so a search cut
short continues where it stopped; a block's result does not depend on which others were
computed with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from clusterflow.mining.knn.common import Blocks, KnnParams, SearchHooks, k_others
from clusterflow.mining.knn.faiss_engine import faiss_search
from clusterflow.mining.knn.torch_engine import torch_search

log = logging.getLogger("clusterflow.knn")

__all__ = [
    "Blocks",
    "KnnParams",
    "SearchHooks",
    "choose_engine",
    "faiss_available",
    "k_others",
    "search",
]


def faiss_available() -> bool:
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


def choose_engine(requested: str) -> tuple[str, str]:
    """Which engine runs, and why (logged with every mining round)."""
    if requested == "faiss":
        if not faiss_available():
            raise RuntimeError(
                "mining.engine=faiss but faiss is not installed; pip install faiss-cpu, "
                "or set mining.engine=torch"
            )
        return "faiss", "asked for by mining.engine"
    if requested == "torch":
        return "torch", "asked for by mining.engine"
    if faiss_available():
        import faiss

        if torch.cuda.is_available() and not hasattr(faiss, "StandardGpuResources"):
            return (
                "torch",
                (
                    "CUDA is available but this faiss build has no GPU support; "
                    "the exact torch engine uses the GPU"
                ),
            )
        return "faiss", "faiss is installed" + (
            " with GPU support" if hasattr(faiss, "StandardGpuResources") else " (CPU build)"
        )
    return "torch", "faiss is not installed"


def search(
    x: np.ndarray,
    params: KnnParams,
    should_abort: Callable[[], bool] | None = None,
    timings: dict[str, Any] | None = None,
    blocks: Blocks | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """k nearest others of every (already normalised) row of ``x``, with the chosen engine.
    ``timings`` receives ``engine`` (which and why), ``index`` and ``search`` seconds."""
    name, why = choose_engine(params.engine)
    if timings is not None:
        timings["engine"] = f"{name} ({why})"
    if name == "torch":
        if params.index != "flat":
            log.info(
                "the torch engine is exact; mining.index=%s applies to faiss only", params.index
            )
        return torch_search(
            x,
            params.k,
            query_batch=params.query_batch,
            hooks=SearchHooks(should_abort, timings, blocks),
        )
    return faiss_search(x, params, should_abort=should_abort, timings=timings, blocks=blocks)
