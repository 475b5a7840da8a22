"""Two committed checkpoints of the same step, compared tensor by tensor: what ``clusterflow
check`` (``launch/check.py``) calls the final state of a run, against the uninterrupted run's.

Everything a checkpoint holds is compared, by the name the script registered it under: the
model's weights (``model.pt``; a sharded checkpoint's every tensor), each registered state
(``optimizer``, ``scheduler``, a dict of counters, ...), the run's counters and sample position
(``train``), and every rank's random streams (``rng``: Python's, NumPy's, torch's, CUDA's and the
script's own generators). Tensors are equal when their dtype, shape and bytes are (a NaN equals
the same NaN). What legitimately differs between two runs of the same experiment is left out:
each save's id (``identity.py``), which attempt trained which range of the sample ledger or of
a loop's steps (the ranges themselves are compared), and the seconds a mining round took.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from clusterflow.checkpoint import identity
from clusterflow.checkpoint.export import open_store, shard_tensors
from clusterflow.storage.names import DCP, MODEL, TRAIN_STATE

# Differences named in full; the rest are counted.
SHOWN = 8


def _merged(ranges: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ranges without who trained them: merged where they follow each other at one world size
    and batch size."""
    merged: list[dict[str, Any]] = []
    for r in ranges:
        key = (r.get("world_size"), r.get("batch_size"))
        last = merged[-1] if merged else None
        if last and last["end"] == r.get("start") and key == last["key"]:
            last["end"] = r.get("end")
        else:
            merged.append({"start": r.get("start"), "end": r.get("end"), "key": key})
    return merged


def _ledger(epochs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ledger without who trained what: each epoch's ranges merged (``_merged``)."""
    return [
        {
            **{k: v for k, v in epoch.items() if k != "ranges"},
            "ranges": _merged(epoch.get("ranges") or []),
        }
        for epoch in epochs
    ]


def comparable(train_state: Mapping[str, Any]) -> dict[str, Any]:
    """``train_state.pt`` without what differs between two runs of one experiment."""
    out = {k: v for k, v in train_state.items() if k != identity.STATE_KEY}
    train = out.get("train")
    if isinstance(train, dict):
        train = dict(train)
        train["ledger"] = _ledger(train.get("ledger") or [])
        if "ledger_steps" in train:  # a loop without a loader: the steps, not who took them
            train["ledger_steps"] = _merged(train["ledger_steps"] or [])
        train["mining_history"] = [
            {k: v for k, v in (h or {}).items() if k != "seconds"}
            for h in train.get("mining_history") or []
        ]
        out["train"] = train
    return out


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().cpu().contiguous().reshape(-1), b.detach().cpu().contiguous().reshape(-1)
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def _how(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    if a.is_floating_point() and a.numel():
        diff = (a.double() - b.double()).abs()
        return f"max |difference| {diff.max().item():.3g}"
    unequal = int((a.reshape(-1) != b.reshape(-1)).sum().item()) if a.numel() else 0
    return f"{unequal} of {a.numel()} values differ"


def _same_value(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _walk(a: object, b: object, where: str, out: list[str]) -> int:
    """Append to ``out`` where ``a`` and ``b`` differ; returns the tensors compared."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if not _same_tensor(a, b):
            out.append(f"{where} ({_how(a, b)})")
        return 1
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        n = 0
        for key in list(a) + [k for k in b if k not in a]:
            if key not in a or key not in b:
                side = "only uninterrupted" if key in a else "only resumed"
                out.append(f"{where}[{key!r}] ({side})")
                continue
            n += _walk(a[key], b[key], f"{where}[{key!r}]", out)
        return n
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return sum(_walk(x, y, f"{where}[{i}]", out) for i, (x, y) in enumerate(zip(a, b)))
    if not _same_value(a, b):
        out.append(f"{where} ({_short(a)} vs {_short(b)})")
    return 0


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}...({len(text)} characters)"


def _named(state: Mapping[str, Any]) -> dict[str, Any]:
    """``train_state.pt`` by the names a reader knows: each rank's random streams apart."""
    out = {k: v for k, v in state.items() if k != "rng"}
    for rank, streams in enumerate(state.get("rng") or []):
        out[f"rng of rank {rank}"] = streams
    return out


def _state(root: str, step: int) -> dict[str, Any]:
    """What the checkpoint of ``step`` under ``root`` holds, by name (verified as a resume
    verifies it)."""
    store = open_store(root)
    ckpt = store.verify(step)
    train_state = comparable(ckpt.load(TRAIN_STATE) or {})
    if ckpt.manifest.get("format") == DCP:
        shards = shard_tensors(store.step_path(step))
        return {"shards": shards, **_named(train_state)}
    model = {k: v for k, v in ckpt.load(MODEL).items()}
    return {"model": model, **_named(train_state)}


def differences(reference: str, other: str, step: int) -> tuple[int, list[str]]:
    """(tensors compared, where the checkpoint of ``step`` under the checkpoint root ``other``
    differs from the one under ``reference``: ``model['fc.weight'] (max |difference| 0.01)``,
    ``optimizer['state'][0]['momentum_buffer'] (...)``, ``rng of rank 1['torch'] (...)``,
    ``counters['seen'] (3 vs 5)``)."""
    a, b = _state(reference, step), _state(other, step)
    found: list[str] = []
    n = 0
    for name in list(a) + [k for k in b if k not in a]:
        if name not in a or name not in b:
            found.append(f"{name} ({'only uninterrupted' if name in a else 'only resumed'})")
            continue
        n += _walk(a[name], b[name], name, found)
    return n, found


__all__ = ["SHOWN", "comparable", "differences"]
