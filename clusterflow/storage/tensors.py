"""torch's file format for the store and the durable writer: the one place storage meets torch.

Checkpoint files are ``torch.save`` pickles that ``torch.load(path, weights_only=True)`` reads
without clusterflow. The job side passes :data:`TORCH` to :class:`~clusterflow.storage.store.
CheckpointStore` and to ``durable.write_atomic``; the login side never imports this module, so
``durable.py`` and ``store.py`` stay free of torch (the forbidden contract in pyproject.toml).
"""

from __future__ import annotations

import io
from typing import IO, Any

import torch

from clusterflow.storage.durable import Codec


def _load(source: str | IO[bytes]) -> Any:
    return torch.load(source, map_location="cpu", weights_only=True)


TORCH = Codec(dump=torch.save, load=_load, versions={"torch": torch.__version__})


def serialize(obj: object) -> bytes:
    """``obj`` as the bytes ``torch.save`` writes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
