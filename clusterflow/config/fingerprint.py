"""Which config keys change a run's result, and which may change when a run is resumed.

Every key of every config section has one kind:

- ``result``: part of the experiment (model, data, optimisation, seed, mining). A resumed run must
  keep it; :func:`result_fingerprint` hashes exactly these (plus the derived values below).
- ``numerics``: the same experiment computed another way: a resume may change it, but from then on
  the run is not bitwise equal to an uninterrupted one (summation order, random streams).
- ``resource``: where and how fast the job runs (Slurm resources, workers, intervals, timeouts,
  names). A resume may change it and stays bitwise exact, on the same hardware and software.

Some resource keys change the result through another key; these are derived values, hashed
with the result keys: the world size when ``train.lr_scaling`` scales the learning rate with it,
and the precision ``train.amp=auto`` resolves to (bf16 on a GPU, none on CPU; ``dist.backend=gloo``
trains on CPU). Each key's kind and the reason for it are declared next to the key's field in
``sections/`` (``doc(kind=..., why=...)``, which refuses a field without them); :data:`KEYS`
is built from there. Everything else here works on plain config dicts (``Config.to_dict()``). A
key this table does not know (say, one a newer version added) counts as ``result``: it can
never be changed silently.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from clusterflow.config import masking
from clusterflow.config.sections import NUMERICS, RESULT, SECTIONS, keys


def _classified() -> dict[str, tuple[str, str]]:
    """``section.key`` -> (kind, why) of every config field, as declared next to the field
    (``doc(kind=..., why=...)`` in ``sections/``), in the config reference's order."""
    out = {}
    for section, cls in SECTIONS.items():
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key, name in keys(cls).items():
            meta = fields[name].metadata
            out[f"{section}.{key}"] = (meta["kind"], meta["why"])
    return out


# key -> (kind, why). The reasons are shown to users when a resume changes the key.
KEYS: dict[str, tuple[str, str]] = _classified()


def kind(key: str) -> str:
    """The kind of ``section.key`` (or a sub-key such as ``task.params.lr``); unknown keys are
    ``result``."""
    parts = key.split(".")
    return KEYS.get(".".join(parts[:2]), (RESULT, ""))[0]


def flatten(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}``; mappings inside a section (task.params,
    cluster.sbatch_extra) are flattened one level further so a change names the sub-key."""
    out: dict[str, Any] = {}
    for section, values in cfg.items():
        if not isinstance(values, Mapping):
            out[section] = values
            continue
        for key, value in values.items():
            # An empty mapping adds no key: {} and absent are the same.
            if isinstance(value, Mapping):
                for sub, v in value.items():
                    out[f"{section}.{key}.{sub}"] = v
            else:
                out[f"{section}.{key}"] = value
    return out


def _get(cfg: Mapping[str, Any], section: str, key: str, default: object) -> Any:
    return (cfg.get(section) or {}).get(key, default)


def derived(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Result-changing values that resource keys set through other keys (hashed with the result
    keys)."""
    nodes, tasks = _get(cfg, "cluster", "nodes", 1), _get(cfg, "cluster", "tasks_per_node", 1)
    gpus, backend = _get(cfg, "cluster", "gpus_per_node", 0), _get(cfg, "dist", "backend", "auto")
    device = "cuda" if gpus and backend != "gloo" else "cpu"
    amp = _get(cfg, "train", "amp", "auto")
    out = {"precision": ("bf16" if device == "cuda" else "none") if amp == "auto" else amp}
    if _get(cfg, "train", "lr_scaling", "none") != "none":
        out["world_size"] = nodes * tasks
    return out


_DERIVED_FROM = {"precision": "train.amp", "world_size": "train.lr_scaling"}
_DERIVED_WHY = {
    "precision": (
        "train.amp=auto resolves to bf16 on a GPU and to none on CPU "
        "(set by cluster.gpus_per_node and dist.backend)"
    ),
    "world_size": (
        "train.lr_scaling scales the learning rate with cluster.nodes x cluster.tasks_per_node"
    ),
}


def result_part(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The flat result keys of ``cfg`` and its derived values: what must match for a resume."""
    flat = {k: v for k, v in flatten(cfg).items() if kind(k) == RESULT}
    return {**flat, **{f"derived.{k}": v for k, v in derived(cfg).items()}}


def result_fingerprint(cfg: Mapping[str, Any]) -> str:
    """16 hex digits over the result keys and derived values only: equal for two configs that differ
    in resources (time limit, partition, nodes, workers, intervals), different otherwise."""
    text = json.dumps(result_part(cfg), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    kind: str
    why: str = ""

    def __str__(self) -> str:
        text = f"{self.key} {_show(self.key, self.old)} -> {_show(self.key, self.new)}"
        if self.kind == NUMERICS:
            text += f" (resumes, not bitwise: {self.why})"
        elif self.kind == RESULT and self.key.startswith("derived."):
            text += f" ({self.why})"
        return text


_ABSENT = object()


def _show(key: str, value: object) -> str:
    """A value as a change names it, its secrets masked (``masking``)."""
    if value is _ABSENT:
        return "(unset)"
    return json.dumps(masking.mask_value(key, value), default=str, ensure_ascii=False)


def compare(old: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[list[Change], list[Change]]:
    """(result_changes, resource_changes) from ``old`` to ``new`` config dicts.

    The consistency policy refuses a resume with result changes (naming them) and reports the
    others (``cluster.time_min 60 -> 240``); ``numerics`` changes are in the second list and say
    why the resumed run is no longer bitwise equal to an uninterrupted one.
    """
    a, b = flatten(old), flatten(new)
    result: list[Change] = []
    other: list[Change] = []
    for key in list(a) + [k for k in b if k not in a]:
        va, vb = a.get(key, _ABSENT), b.get(key, _ABSENT)
        if va == vb:
            continue
        k = kind(key)
        change = Change(key, va, vb, k, KEYS.get(".".join(key.split(".")[:2]), (k, ""))[1])
        (result if k == RESULT else other).append(change)
    da, db = derived(old), derived(new)
    named = {c.key for c in result}
    for key in list(da) + [k for k in db if k not in da]:
        va, vb = da.get(key, _ABSENT), db.get(key, _ABSENT)
        # A named change of train.amp ('auto' -> 'bf16') already says it.
        if va != vb and _DERIVED_FROM[key] not in named:
            result.append(Change(f"derived.{key}", va, vb, RESULT, _DERIVED_WHY[key]))
    return result, other


# The one result key a resume may change when the launch asks for it: the order of samples goes
# on from the sample reached (distributed/sampler.py), in batches of the new size.
BATCH_SIZE, ALLOW_BATCH_SIZE_CHANGE = "train.batch_size", "train.allow_batch_size_change"
_REBATCH_WHY = (
    "train.allow_batch_size_change: the same sample order goes on from the sample reached, in "
    "batches of the new size"
)


def allowed_batch_size_change(
    result: list[Change], new: Mapping[str, Any]
) -> tuple[list[Change], list[Change]]:
    """(``result`` without a change of ``train.batch_size``, that change as a numerics change)
    when ``new`` sets ``train.allow_batch_size_change``; else (``result``, [])."""
    if _get(new, "train", "allow_batch_size_change", False) is not True:
        return result, []
    kept = [c for c in result if c.key != BATCH_SIZE]
    moved = [
        Change(c.key, c.old, c.new, NUMERICS, _REBATCH_WHY) for c in result if c.key == BATCH_SIZE
    ]
    return kept, moved


def summary(changes: list[Change], limit: int = 6) -> str:
    """``a 1 -> 2; b x -> y; and 3 more`` for one-line messages."""
    text = "; ".join(str(c) for c in changes[:limit])
    return text + (f"; and {len(changes) - limit} more" if len(changes) > limit else "")


def reference_markdown() -> str:
    """The table of docs/workflows.md, generated from :data:`KEYS`."""
    lines = ["| key | kind | why |", "|---|---|---|"]
    lines += [f"| `{k}` | {kd} | {why} |" for k, (kd, why) in KEYS.items()]
    return "\n".join(lines)
