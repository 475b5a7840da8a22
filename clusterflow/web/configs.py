"""A run's configuration as the pages show it: config.yaml flattened to ``section.key`` rows with
every secret masked, and the keys that tell a set of runs apart (the compare view's legend).

A value is masked when its key names a secret (any part of the dotted name, split at ``.``,
``_`` and ``-``, that holds ``token``, ``key``, ``password``, ``passwd`` or ``secret``:
``trackers.wandb.api_key``, ``task.params.hf_token``), and inside any text that is shown: the
credentials of a URL (``https://USER:PASSWORD@host``), an assignment whose name does
(``WANDB_API_KEY=...`` in ``cluster.setup``), and a script argument after a flag that does
(``--api-key VALUE``, ``--token=VALUE``). The page gets the masked text only: what is masked never
leaves the server.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping

MASK = "••••••"
SECRET_WORDS = ("token", "key", "password", "passwd", "secret")
# Keys every run has its own value of: never what tells runs apart.
OWN_KEYS = ("run.dir",)
# A key shown as its value in a legend at most this long.
LEGEND_VALUE_CHARS = 40

_URL_CREDENTIALS = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://)[^\s/@]+(?=@)")
_ASSIGNMENT = re.compile(
    r"(?P<head>\b[\w.-]*(?:token|key|password|passwd|secret)[\w.-]*\s*[=:]\s*)"
    r"(?P<value>\"[^\"]*\"|'[^']*'|[^\s,;&|\"']+)",
    re.IGNORECASE,
)


def is_secret(key: str) -> bool:
    """Whether a (dotted) config key, or a flag, names a secret."""
    parts = re.split(r"[._\-\s]+", key.lower())
    return any(word in part for part in parts for word in SECRET_WORDS)


def mask_text(text: str) -> str:
    """``text`` with the secrets inside it masked (a URL's user and password,
    ``NAME_KEY=value``)."""
    text = _URL_CREDENTIALS.sub(lambda m: m["head"] + MASK, text)
    return _ASSIGNMENT.sub(lambda m: m["head"] + MASK, text)


def mask_args(args: Iterable[str]) -> list[str]:
    """A script's arguments, each value that follows a flag naming a secret masked (``--token
    X`` and ``--token=X``), and secrets inside the others masked by :func:`mask_text`."""
    out: list[str] = []
    hide_next = False
    for arg in (str(a) for a in args):
        if hide_next and not arg.startswith("-"):
            out.append(MASK)
            hide_next = False
            continue
        hide_next = False
        flag, eq, _ = arg.partition("=")
        if arg.startswith("-") and is_secret(flag.lstrip("-")):
            if eq:
                out.append(f"{flag}={MASK}")
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(mask_text(arg))
    return out


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
    """A value as a page shows it, masked where its key or its text names a secret."""
    if is_secret(key) and value not in ("", None, [], {}):
        return MASK
    if key == "script.args" and isinstance(value, list):
        return json.dumps(mask_args(value), ensure_ascii=False)
    if isinstance(value, list):
        items = [mask_text(v) if isinstance(v, str) else v for v in value]
        return json.dumps(items, sort_keys=True, default=str, ensure_ascii=False)
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return mask_text(text)


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
