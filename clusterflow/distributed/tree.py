"""A nested state (dicts, lists, tuples of tensors and small objects) taken apart and put back.

``flatten`` returns a *skeleton*, the same nesting with every tensor replaced by a :class:`Slot`
naming its place in the returned list, and the list of tensors. ``unflatten`` fills a skeleton
with other tensors (host copies, or tensors received from another rank). The skeleton is small
and picklable, so it can travel where the tensors should not: the checkpointer snapshots the
tensors into host buffers, and the restore broadcasts them as tensors while only the skeleton is
pickled. Dict subclasses and their ``_metadata`` (what ``Module.state_dict`` attaches) survive.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


@dataclass(frozen=True)
class Slot:
    index: int  # place in the tensor list
    path: str  # where it sits in the state, for messages ("model.pt/0.weight")


class Flat(NamedTuple):
    """One part of a flattened state, handed on without being put back together: its skeleton
    and the tensors its slots name, by slot index (a codec that writes tensors one by one need
    not walk the state again)."""

    skeleton: Any
    tensors: dict[int, torch.Tensor]

    def whole(self) -> Any:
        return unflatten(self.skeleton, self.tensors)


def _empty(d: dict) -> dict:
    try:
        return type(d)()  # OrderedDict (state_dicts) and plain dicts
    except TypeError:
        return {}  # a dict subclass that needs arguments: its items are what matters


def _is_tensor(obj: object) -> bool:
    return isinstance(obj, torch.Tensor)


# Leaves that never change in place: a skeleton keeps them as they are.
_IMMUTABLE = (int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


def flatten(
    obj: object, path: str = "", copy_leaves: bool = False
) -> tuple[Any, list[torch.Tensor]]:
    """(skeleton, tensors). The skeleton's dicts, lists and tuples are new; its other leaves (and
    a state_dict's ``_metadata``) are the state's own, or with ``copy_leaves`` deep copies of the
    mutable ones (a set, an object), so that the skeleton does not change with the state later (a
    snapshot taken at a step)."""
    tensors: list[torch.Tensor] = []
    memo: dict[int, object] = {}  # one copy of a leaf the state holds twice

    def walk(o: object, where: str) -> Any:
        if _is_tensor(o):
            tensors.append(o)
            return Slot(len(tensors) - 1, where)
        if isinstance(o, dict):
            out = _empty(o)
            for k, v in o.items():
                out[k] = walk(v, f"{where}/{k}" if where else str(k))
            if hasattr(o, "_metadata"):
                meta = o._metadata  # type: ignore[attr-defined]
                out._metadata = copy.deepcopy(meta, memo) if copy_leaves else meta
            return out
        if isinstance(o, (list, tuple)) and type(o) in (list, tuple):
            items = [walk(v, f"{where}/{i}" if where else str(i)) for i, v in enumerate(o)]
            return items if isinstance(o, list) else tuple(items)
        if copy_leaves and not isinstance(o, _IMMUTABLE):
            return copy.deepcopy(o, memo)
        return o

    return walk(obj, path), tensors


def slots(skeleton: object) -> list[Slot]:
    """Every slot of a skeleton, in tensor-list order."""
    found: list[Slot] = []

    def walk(o: object) -> None:
        if isinstance(o, Slot):
            found.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(skeleton)
    return sorted(found, key=lambda s: s.index)


def unflatten(
    skeleton: object, tensors: Sequence[torch.Tensor] | Mapping[int, torch.Tensor]
) -> Any:
    """The skeleton with each slot replaced by ``tensors[slot.index]`` (containers are rebuilt)."""
    if isinstance(skeleton, Slot):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        out = _empty(skeleton)
        for k, v in skeleton.items():
            out[k] = unflatten(v, tensors)
        if hasattr(skeleton, "_metadata"):
            out._metadata = skeleton._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(skeleton, (list, tuple)) and type(skeleton) in (list, tuple):
        items = [unflatten(v, tensors) for v in skeleton]
        return items if isinstance(skeleton, list) else tuple(items)
    return skeleton
