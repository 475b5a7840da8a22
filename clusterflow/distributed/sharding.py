"""torch's sharding stack (FSDP2, DTensor, the distributed checkpoint), imported at its first use.

Together they are about a second of a process's start-up, a third of a rank's imports (DTensor
brings sympy): a rank that never shards (DDP, one process) and a command that only reads a run
dir start without them. ``train.parallel=fsdp`` imports them when it shards the model. A check
whether an object is sharded looks for the class only where its module is loaded: no FSDP
module, DTensor or CheckpointException exists before its module is imported.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import torch  # at the top, where the login side's contract sees it; its sharding stack later


def loaded(module: str, name: str) -> Any:
    """``module.name`` if ``module`` has been imported, else None."""
    found = sys.modules.get(module)
    return getattr(found, name) if found is not None else None


def _instance(obj: object, module: str, name: str) -> bool:
    """Whether ``obj`` is a ``module.name``: never, while ``module`` is not imported."""
    cls = loaded(module, name)
    return cls is not None and isinstance(obj, cls)


def is_fsdp(module: torch.nn.Module) -> bool:
    """Whether ``module`` is one ``fully_shard`` sharded (an FSDPModule)."""
    return _instance(module, "torch.distributed.fsdp", "FSDPModule")


def is_dtensor(obj: object) -> bool:
    """Whether ``obj`` is a DTensor (a sharded parameter, gradient or optimizer state)."""
    return _instance(obj, "torch.distributed.tensor", "DTensor")


def is_checkpoint_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is DCP's CheckpointException (every failed rank's traceback)."""
    return _instance(exc, "torch.distributed.checkpoint.api", "CheckpointException")


def fsdp() -> ModuleType:
    """``torch.distributed.fsdp`` (``fully_shard``, ``MixedPrecisionPolicy``)."""
    from torch.distributed import fsdp

    return fsdp


def dcp() -> ModuleType:
    """``torch.distributed.checkpoint``."""
    import torch.distributed.checkpoint as dcp

    return dcp


def state_dicts() -> ModuleType:
    """``torch.distributed.checkpoint.state_dict``: a sharded model's and optimizer's state."""
    import torch.distributed.checkpoint.state_dict as state_dicts

    return state_dicts
