"""Random-number state, captured and restored in a form that
``torch.load(weights_only=True)`` accepts."""

from __future__ import annotations

import array
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

# One rank's random streams by source ("python", "numpy", "torch", "cuda", and "own": the streams
# of a script's own), in plain lists and tensors that torch.load(weights_only=True) reads.
RngState = dict[str, Any]

# The random streams a script owns (a torch.Generator, a numpy Generator, a random.Random it
# registered with run.restore), by name: (its state now, set it). Each rank's differ, so they are
# captured and restored with the global streams, per rank. One run per process.
_OWN: dict[str, tuple[Callable[[], object], Callable[[object], None]]] = {}


def track(name: str, get: Callable[[], object], put: Callable[[object], None]) -> None:
    """Capture and restore a stream of the script's own with this rank's global streams."""
    _OWN[name] = (get, put)


def untrack(names: list[str]) -> None:
    for name in names:
        _OWN.pop(name, None)


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
        # Python's Mersenne Twister state (625 ints) as the bytes of unsigned 64-bit words: a
        # snapshot every few steps copies and pickles one object, not 625.
        "python": [py_version, array.array("Q", py_state).tobytes(), py_gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    if _OWN:
        out["own"] = {name: get() for name, (get, _) in _OWN.items()}
    return out


def _python_words(saved: object) -> tuple[int, ...]:
    """Python's Mersenne Twister words as ``capture_rng`` saved them: bytes; checkpoints of
    earlier versions hold an int64 tensor or a list."""
    if isinstance(saved, bytes):
        return tuple(array.array("Q", saved))
    if isinstance(saved, torch.Tensor):
        return tuple(saved.tolist())
    return tuple(saved)  # type: ignore[call-overload]


def restore_rng(state: RngState) -> None:
    v, s, g = state["python"]
    random.setstate((v, _python_words(s), g))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if (
        "cuda" in state
        and torch.cuda.is_available()
        and len(state["cuda"]) == torch.cuda.device_count()
    ):
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, value in (state.get("own") or {}).items():
        if name in _OWN:
            _OWN[name][1](value)
