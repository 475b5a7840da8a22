"""What every section's fields are made of: :func:`doc` (a field with its help text, what
changing it does to a run's result, and whom it applies to: a script, a task, or both), and the
checks a section's ``__post_init__`` calls. No torch here: the config runs on the login node.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import field
from typing import Any

from clusterflow.config import masking
from clusterflow.config.values import short
from clusterflow.errors import UserError

# What changing a key does to a run's result (``fingerprint.py`` says what each kind allows on a
# resume): part of the experiment; the same experiment computed another way; where and how fast.
RESULT, NUMERICS, RESOURCE = "result", "numerics", "resource"
KINDS = (RESULT, NUMERICS, RESOURCE)

# Why the world size (cluster.nodes, cluster.tasks_per_node) is a numerics key.
WORLD_WHY = (
    "the global-batch sampler keeps the data order and the global batch; per-rank RNG streams are "
    "re-derived and the all-reduce sums in another order, so the result is not bitwise equal to an "
    "uninterrupted run (tasks whose loss depends on the per-rank batch, e.g. BatchNorm without "
    "dist.sync_batchnorm, train differently)"
)


# Whom a key applies to: a job of the task trainer, a script of the user's own
# (docs/own-loop.md), or both. A script's job that sets a task's key is told so in one line.
TASK, SCRIPT, BOTH = "task", "script", "script, task"
APPLIES = (TASK, SCRIPT, BOTH)


def doc(
    default: object = dataclasses.MISSING,
    help: str = "",
    factory: Callable[[], object] | None = None,
    key: str = "",
    *,
    kind: str,
    why: str,
    applies: str = BOTH,
) -> Any:
    """A dataclass field with its documentation attached (read by the config reference). ``key``:
    the name in YAML and overrides when it cannot be a Python name (``checkpoint.async``).
    ``kind`` (one of :data:`KINDS`) and ``why``: what changing the key does to the run's result,
    and why; ``fingerprint.KEYS`` is built from them and a resume that changes the key shows
    ``why``. ``applies`` (one of :data:`APPLIES`): whose job reads the key."""
    if kind not in KINDS or not why:
        raise ValueError(f"config field kind={kind!r}, why={why!r}: give one of {KINDS} and a why")
    if applies not in APPLIES:
        raise ValueError(f"config field applies={applies!r}: give one of {APPLIES}")
    metadata = {
        "help": help,
        "kind": kind,
        "why": why,
        "applies": applies,
        **({"key": key} if key else {}),
    }
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def keys(section_cls: type) -> dict[str, str]:
    """Config key -> dataclass field name, in declaration order (they differ only where
    ``doc(key=...)`` says)."""
    return {f.metadata.get("key", f.name): f.name for f in dataclasses.fields(section_cls)}


YEAR_S = 365 * 24 * 3600  # timeouts become a timedelta, and then int64 milliseconds in torch
INT32 = 2**31 - 1


def check(ok: bool, key: str, value: object, why: str) -> None:
    """Refuse ``key``'s ``value`` with ``why``; the message names the value with its secrets
    masked (``masking``), as it may reach a job's error record and the dashboard."""
    if not ok:
        raise UserError(f"{key} = {short(repr(masking.mask_value(key, value)))}: {why}")


def choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    check(value in choices, key, value, f"must be one of {', '.join(choices)}")


# numpy's legacy seeding takes seeds below 2**32; the derived seeds stay within int64.
SEED_LIMIT = 2**32

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://|::")


def is_url(text: str) -> bool:
    """``scheme://...`` or an fsspec chain (``simplecache::s3://...``), as opposed to a path."""
    return bool(_URL.search(text))
