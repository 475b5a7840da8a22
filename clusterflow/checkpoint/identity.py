"""What ties every file of a checkpoint to it: a random id per save, in the manifest and inside
each file, checked before anything is loaded.

A manifest's digests say that each file is the one its entry describes, not that the entry
belongs to this checkpoint: a file copied from another step together with its entry verifies,
and would load beside the other files of this one (the weights of step 4, the optimizer of step
8). So every save draws an id (``checkpoint_id`` in the manifest, 32 hex digits) and writes it,
with the step, into every file it commits:

- ``train_state.pt``: under the key ``checkpoint`` (``{"id": ..., "step": ...}``);
- ``model.pt``: in the state_dict's ``_metadata`` under ``clusterflow:checkpoint``, which
  ``torch.load`` keeps and ``load_state_dict`` ignores, so it stays a plain state_dict;
- sharded checkpoints (``sharded.py``): each rank's ``__<rank>_0.distcp`` holds the entry
  ``checkpoint.rank<rank>``, and DCP's ``.metadata`` records the id as its ``save_id``.

:func:`check` (the store's ``check``, run by every reader: resume, export, ``task.init_from``)
refuses a step whose files carry another id or step, or none. A manifest without
``checkpoint_id`` was written by an older version, whose files carry none: such a checkpoint is
checked as before (its manifest, and every file's size and digest) and loads.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from clusterflow.checkpoint import sharded
from clusterflow.storage.names import DCP, MODEL, TRAIN_STATE
from clusterflow.storage.store import Checkpoint

STATE_KEY = "checkpoint"  # the entry of train_state.pt
MODEL_KEY = "clusterflow:checkpoint"  # the entry of model.pt's _metadata


def new_id() -> str:
    return uuid.uuid4().hex


def tag(ident: str, step: int) -> dict[str, Any]:
    return {"id": ident, "step": step}


def stamp(files: Mapping[str, Any], ident: str, step: int) -> dict[str, Any]:
    """``files`` (name -> object, as the checkpointer commits them) with the id and step inside
    ``train_state.pt`` and ``model.pt``; the objects themselves are not changed (shallow
    copies)."""
    out = dict(files)
    if TRAIN_STATE in out:
        out[TRAIN_STATE] = {**out[TRAIN_STATE], STATE_KEY: tag(ident, step)}
    if MODEL in out:
        model = out[MODEL]
        metadata = OrderedDict(getattr(model, "_metadata", {}))
        metadata[MODEL_KEY] = tag(ident, step)
        marked = OrderedDict(model)
        marked._metadata = metadata  # type: ignore[attr-defined]
        out[MODEL] = marked
    return out


def _carried(name: str, obj: object) -> object:
    if name == MODEL:
        return (getattr(obj, "_metadata", None) or {}).get(MODEL_KEY)
    return obj.get(STATE_KEY) if isinstance(obj, dict) else None


def mismatch(name: str, carried: object, ident: str, step: int) -> str | None:
    """Why ``name``, carrying ``carried``, is not a file of checkpoint ``ident`` of ``step``."""
    if carried == tag(ident, step):
        return None
    if not isinstance(carried, dict) or "id" not in carried:
        return (
            f"{name} carries no checkpoint id, and its manifest names {ident} "
            "(a file of an older version copied in?)"
        )
    return (
        f"{name} belongs to step {carried.get('step')}'s checkpoint {carried.get('id')}, not to "
        f"this one (step {step}, {ident}): a file copied from another checkpoint?"
    )


def check(ckpt: Checkpoint) -> None:
    """ValueError unless every file of ``ckpt`` carries its manifest's id and step (a manifest
    without ``checkpoint_id``, of an older version: nothing to compare)."""
    ident = ckpt.manifest.get("checkpoint_id")
    if ident is None:
        return
    for name, obj in sorted(ckpt.objects.items()):
        why = mismatch(name, _carried(name, obj), ident, ckpt.step)
        if why:
            raise ValueError(why)
    if ckpt.manifest.get("format") == DCP:
        save_id, shards = sharded.carried(ckpt.path, ckpt.manifest["files"])
        if save_id != ident:
            raise ValueError(
                f"{sharded.METADATA} belongs to another checkpoint ({save_id}), not to this one "
                f"(step {ckpt.step}, {ident}): copied from another checkpoint?"
            )
        for name, carried in sorted(shards.items()):
            why = mismatch(name, carried, ident, ckpt.step)
            if why:
                raise ValueError(why)
