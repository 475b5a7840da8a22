"""What ``run.restore(model=..., **states)`` may register, and how each object is saved.

- anything with ``state_dict()``/``load_state_dict()`` (optimizer, scheduler, GradScaler,
  another module): as it is;
- a ``dict`` of numbers, strings, lists and tensors (counters, the best metric): saved as a copy,
  restored in place (:class:`InPlace`); a value that ``torch.load(weights_only=True)`` could not
  read back is refused at registration, naming its place;
- a ``torch.Generator``, a NumPy ``Generator`` or a ``random.Random``: a random stream of the
  script's own (:func:`stream`), saved per rank beside the global streams (``rng.track``).
"""

from __future__ import annotations

import collections
import copy
import io
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from clusterflow.checkpoint.checkpointer import TRAIN, Stateful
from clusterflow.errors import UserError

# The GradScaler of run.autocast's fp16 (run.scaler), registered by the run itself.
AMP_SCALER = "amp_scaler"
# Names a checkpoint's train_state.pt holds besides the registered states.
RESERVED = ("model", TRAIN, "rng", "world_size", AMP_SCALER)

# A random stream as (its state now, set it).
Stream = tuple[Callable[[], object], Callable[[object], None]]

# What a registered dict may hold as it is: a checkpoint's train_state.pt is read back with
# torch.load(weights_only=True), which takes these, tensors, and lists, tuples and these dicts of
# them; anything else is tried.
_PLAIN = (bool, int, float, complex, str, bytes, type(None))
_CONTAINERS = (dict, collections.OrderedDict)


def check_name(name: str) -> None:
    if name in RESERVED:
        raise UserError(
            f"run.restore({name}=...): {name!r} is a name the checkpoint keeps for itself "
            f"({', '.join(RESERVED)}); register it under another name"
        )


def stateful(name: str, obj: object) -> Stateful:
    """``obj`` as a registered state: anything with ``state_dict``/``load_state_dict`` as it is;
    a dict (restored in place) through an adapter."""
    if callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    ):
        return obj  # type: ignore[return-value]
    if isinstance(obj, dict):
        for key, value in obj.items():
            _check_savable(name, f"[{key!r}]", value)
        return InPlace(obj)
    raise UserError(
        f"run.restore({name}=...): a {type(obj).__name__} cannot be saved with the checkpoint; "
        "pass an object with state_dict()/load_state_dict() (optimizer, scheduler, GradScaler, "
        "module), a dict of numbers, strings, lists and tensors (restored in place), or a "
        "torch.Generator, numpy Generator or random.Random"
    )


def stream(obj: object) -> Stream | None:
    """A random generator of the script's own as (its state, set it), or None for another
    object: saved per rank, like the global streams."""
    if isinstance(obj, torch.Generator):
        return obj.get_state, obj.set_state  # type: ignore[return-value]
    if isinstance(obj, np.random.Generator):
        bits = obj.bit_generator

        def put(state: object) -> None:
            bits.state = copy.deepcopy(state)

        return (lambda: copy.deepcopy(bits.state)), put
    if isinstance(obj, random.Random):
        r = obj

        def put_py(state: object) -> None:
            version, internal, gauss = state  # type: ignore[misc]
            r.setstate((version, tuple(internal), gauss))

        return (lambda: [r.getstate()[0], list(r.getstate()[1]), r.getstate()[2]]), put_py
    return None


def _check_savable(name: str, where: str, value: object) -> None:
    """Refuse, naming its place, a value of a registered dict that a checkpoint cannot hold: it
    would fail the first save (a file, a lock), or the resume that loads it."""
    if type(value) in _PLAIN or isinstance(value, torch.Tensor):
        return
    if isinstance(value, dict) and type(value) in _CONTAINERS:
        for key, item in value.items():
            _check_savable(name, f"{where}[{key!r}]", item)
        return
    if type(value) in (list, tuple):
        for i, item in enumerate(value):  # type: ignore[arg-type]
            _check_savable(name, f"{where}[{i}]", item)
        return
    try:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:  # noqa: BLE001 - any failure is the same answer: not a state
        raise UserError(
            f"run.restore({name}=...): {name}{where} is a {type(value).__name__}, which a "
            "checkpoint cannot hold (it is saved and read back as torch.save and "
            "torch.load(weights_only=True) do); keep numbers, strings, lists, dicts and tensors "
            "in a registered dict, and register an object with state_dict()/load_state_dict() "
            "under a name of its own"
        ) from None


class InPlace:
    """A dict of the script's own (counters, best metric): saved as a copy, restored in place."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.d = d

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.d)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.d.clear()
        self.d.update(copy.deepcopy(state))
