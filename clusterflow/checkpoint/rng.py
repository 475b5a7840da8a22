"""Random-number state, captured and restored in a form that
``torch.load(weights_only=True)`` accepts."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

# One rank's random streams by source ("python", "numpy", "torch", "cuda"), in plain lists and
# tensors that torch.load(weights_only=True) reads.
RngState = dict[str, Any]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank_seed(run_seed: int, rank: int) -> int:
    """Per-rank seed: distinct streams (dropout, user randomness) that depend only on the run
    seed."""
    return (run_seed * 1_000_003 + rank * 7919) % 2**31


def capture_rng() -> RngState:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    out: RngState = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng(state: RngState) -> None:
    v, s, g = state["python"]
    random.setstate((v, tuple(s), g))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if (
        "cuda" in state
        and torch.cuda.is_available()
        and len(state["cuda"]) == torch.cuda.device_count()
    ):
        torch.cuda.set_rng_state_all(state["cuda"])
