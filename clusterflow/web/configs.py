"""A run's configuration as the pages show it: config.yaml flattened to ``section.key`` rows with
every secret masked by ``config/masking.py``'s rule (the one rule for every place a config value
or an argument is shown), and the keys that tell a set of runs apart (the compare view's
legend). The page gets the masked text only: what is masked never leaves the server.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from clusterflow.config import masking

# Keys every run has its own value of: never what tells runs apart.
OWN_KEYS = ("run.dir",)
# A key shown as its value in a legend at most this long.
LEGEND_VALUE_CHARS = 40


def flatten(config: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    """``{"train": {"lr": 0.1}}`` as ``{"train.lr": 0.1}``; an empty mapping stays a value."""
    out: dict[str, object] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def shown(key: str, value: object) -> str:
    """A value as a page shows it, masked (``masking.mask_value``)."""
    return text(masking.mask_value(key, value))


def text(value: object) -> str:
    """A (masked) value as a page writes it: text as it is, anything else as JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, default=str, ensure_ascii=False)


def rows(config: Mapping[str, object]) -> list[list[str]]:
    """config.yaml (read as plain YAML) as ``[key, shown value]`` rows, in the file's order."""
    return [[key, shown(key, value)] for key, value in flatten(config).items()]


def differing(configs: Mapping[str, Mapping[str, object]]) -> list[str]:
    """The keys whose values differ between the runs of ``configs`` (run id -> config.yaml), a
    key one run lacks included; the run's own place (:data:`OWN_KEYS`) left out."""
    flat = [flatten(c) for c in configs.values()]
    keys: dict[str, None] = {}
    for f in flat:
        keys.update(dict.fromkeys(f))
    missing = object()
    out = []
    for key in keys:
        if key in OWN_KEYS:
            continue
        values = [json.dumps(f.get(key, missing), sort_keys=True, default=repr) for f in flat]
        if len(set(values)) > 1:
            out.append(key)
    return out


def legend(config: Mapping[str, object], keys: Iterable[str]) -> dict[str, str]:
    """A run's values of ``keys`` (its differing keys), shown and cut to a legend's length."""
    flat = flatten(config)
    out = {}
    for key in keys:
        text = shown(key, flat[key]) if key in flat else "(unset)"
        if len(text) > LEGEND_VALUE_CHARS:
            text = text[: LEGEND_VALUE_CHARS - 1] + "…"
        out[key] = text
    return out
