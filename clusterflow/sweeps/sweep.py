"""Sweeps: ``--sweep KEY=V1,V2[,...]`` (repeatable) expanded into one validated config per member.

``--sweep arg:NAME=V1,V2`` sweeps an argument of a script of the user's own (``submit --script``):
each member's ``script.args`` are the base ones (the words after ``--``) with ``NAME`` set to the
value: ``--lr 0.1`` or ``--lr=0.1`` replaced for a dashed name, ``lr=0.1`` for a ``key=value``
argument, appended where the base arguments lack it. Such values are passed as typed, as text.

Values are split at top-level commas only, so a value may itself hold commas inside brackets,
braces or quotes: ``--sweep train.lr=1e-3,1e-2``, ``--sweep task.params.dims=[64,32],[128,64]``,
``--sweep run.name='a,b',c``. Each value then goes through the config loader exactly like a
``KEY=VALUE`` override (numbers, strings, booleans, YAML lists and mappings).

The cartesian product is taken in a stable order (the first ``--sweep`` varies slowest) and every
member's config is built and validated here, on the login node, before anything is submitted; all
failures are reported at once, each naming its member. A member lives in ``RUN_DIR/<name>``, where
``name`` is readable and filesystem-safe, e.g. ``k=10,lr=0.001-3f9a1c``: the varying values (keys
sorted, so the order of the ``--sweep`` flags does not matter), then six hex digits hashing the
member's result fingerprint and values, so two members never share a directory (even on a
case-insensitive filesystem, or when long values are cut short) and a resubmission with more time
finds the same directories. A value that is a secret by ``config/masking.py``'s rule (the key
names one, ``arg:--api-key``, or the value holds one, a URL's password) reads ``masked`` in the
name, ``api-key=masked-6d8bd9``: the hash alone tells such members apart, and a folder name that
anyone listing the sweep dir sees holds no secret. A member that the sweep's index already holds
under the name its values had before they were masked keeps that name, so its run dir is found
again. Login-node module: no torch.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import unicodedata
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from clusterflow import config as cfgmod
from clusterflow import rundir
from clusterflow.config import fingerprint, masking
from clusterflow.config.job_config import Config
from clusterflow.errors import UserError
from clusterflow.rundir import saved_config

MAX_MEMBERS = 1000  # Slurm's default MaxArraySize is 1001 (array indices 0..1000)
VALUE_CHARS = 32  # characters of one value in a member name
# Characters of the readable part of a member name (file names hold 255 bytes).
READABLE_CHARS = 100
HASH_CHARS = 6
# What a masked value reads in a member's name (a name holds letters, digits, '.', '+' and '-').
MASKED_IN_NAME = "masked"
# An axis over a script's own argument: arg:NAME.
ARG = "arg:"
# Keys a sweep may not vary, and why (one job array = one sbatch script; members need their own
# dirs).
FIXED = {
    "run.dir": "it is the sweep's directory; each member gets RUN_DIR/<name>",
    "run.name": "a job array has one job name",
    "checkpoint.dir": "each member's checkpoints go to checkpoint.dir/<name>",
    "cluster.": "a job array asks Slurm for one set of resources; submit one sweep per value",
}


@dataclass(frozen=True)
class Axis:
    key: str
    texts: tuple[str, ...]  # the values as typed, one override text each


@dataclass(frozen=True)
class Member:
    name: str  # directory name under the sweep dir
    values: dict[str, Any]  # swept key -> resolved value
    overrides: tuple[str, ...]  # KEY=TEXT, as given to the config loader
    config: Config  # validated; run.dir (and checkpoint.dir) are the member's own

    @property
    def run_dir(self) -> str:
        return self.config.run.dir


@dataclass
class Sweep:
    paths: rundir.RunPaths  # the sweep dir: run.dir of the base config
    keys: list[str]  # swept keys in --sweep order
    members: list[Member]
    base: dict[str, Any] = field(default_factory=dict)  # resolved config without the swept keys


def split_values(text: str, key: str = "") -> list[str]:
    """``a,[1,2],'x,y'`` -> ``["a", "[1,2]", "'x,y'"]``: split at commas outside brackets and
    quotes."""
    out, depth, quote, start = [], [], "", 0
    pairs = {"[": "]", "{": "}", "(": ")"}
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in pairs:
            depth.append(pairs[ch])
        elif ch in pairs.values():
            if not depth or depth.pop() != ch:
                raise UserError(
                    f"--sweep {key}={text}: unbalanced {ch!r} at position {i + 1}; "
                    f"write lists as [1,2] and quote values that contain brackets"
                )
        elif ch == "," and not depth:
            out.append(text[start:i])
            start = i + 1
    if quote or depth:
        raise UserError(
            f"--sweep {key}={text}: unclosed {quote or depth[-1]!r}; close it or quote the value"
        )
    out.append(text[start:])
    if any(not v.strip() for v in out):
        raise UserError(
            f"--sweep {key}={text}: an empty value (two commas in a row, or a trailing comma); "
            f"write the values as V1,V2 and quote an empty string as ''"
        )
    return [v.strip() for v in out]


def parse(args: list[str], overrides: list[str] | tuple[str, ...] = ()) -> list[Axis]:
    """The axes of ``--sweep KEY=V1,V2`` arguments, checked against each other and the overrides."""
    axes: list[Axis] = []
    fixed = {o.partition("=")[0].strip() for o in overrides}
    for arg in args:
        key, sep, text = arg.partition("=")
        key = key.strip()
        if key.startswith(ARG) and sep and key[len(ARG) :] and text.strip():
            if key in [a.key for a in axes]:
                raise UserError(f"--sweep {key}: given twice; give each argument once")
            axes.append(Axis(key, tuple(split_values(text, key))))
            continue
        if not sep or "." not in key or not text.strip():
            raise UserError(
                f"--sweep {arg!r} must look like section.key=V1,V2, e.g. --sweep "
                "train.lr=0.001,0.01, or arg:NAME=V1,V2 for a script's argument, e.g. "
                "--sweep arg:--lr=0.1,0.3"
            )
        for prefix, why in FIXED.items():
            if key == prefix or (prefix.endswith(".") and key.startswith(prefix)):
                raise UserError(f"--sweep {key}: a sweep cannot vary {key}: {why}")
        for other in [a.key for a in axes] + sorted(fixed):
            if key == other or key.startswith(other + ".") or other.startswith(key + "."):
                where = (
                    "another --sweep" if other in [a.key for a in axes] else "a KEY=VALUE override"
                )
                raise UserError(
                    f"--sweep {key}: {other} is also set by {where}; give each key once"
                )
        axes.append(Axis(key, tuple(split_values(text, key))))
    if not axes:
        raise UserError("a sweep needs at least one --sweep KEY=V1,V2")
    size = 1
    for a in axes:
        size *= len(a.texts)
    if size > MAX_MEMBERS:
        raise UserError(
            f"the sweep has {size} members ({' x '.join(str(len(a.texts)) for a in axes)}); "
            f"one job array holds at most {MAX_MEMBERS}: split it into several sweeps"
        )
    return axes


def lookup(cfg: dict[str, Any], key: str) -> Any:
    """The value of ``section.key`` or ``section.key.sub`` in a config dict."""
    node: Any = cfg
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _drop(cfg: dict[str, Any], key: str) -> None:
    *parents, last = key.split(".")
    node: Any = cfg
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(last, None)


def show(value: object) -> str:
    """A value as it reads in a name or a table: 0.001, true, [64,32]."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def shown_value(key: str, value: object) -> object:
    """A member's value of the swept ``key`` as every table, page and name shows it, its secrets
    masked (``masking``): an ``arg:NAME`` value as the script's argument NAME's."""
    if key.startswith(ARG):
        return masking.mask_argument(key[len(ARG) :], show(value))
    return masking.mask_value(key, value)


def _safe(text: str, limit: int) -> str:
    """Letters, digits, '.', '+' and '-' survive; anything else (/, spaces, %, commas, non-ASCII
    after folding accents) becomes '_', so a value can neither nest directories nor break the
    ``key=value,key=value`` reading."""
    folded = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    out = "".join(c if c.isascii() and (c.isalnum() or c in ".+-") else "_" for c in folded)
    while "__" in out:
        out = out.replace("__", "_")
    return out.strip("_")[:limit] or "_"


def labels(keys: list[str]) -> dict[str, str]:
    """Short labels: the last part of each key (a script argument's name without its dashes), or
    the whole key where two last parts clash."""
    last = [
        _safe(k[len(ARG) :].lstrip("-"), VALUE_CHARS) if k.startswith(ARG) else k.rsplit(".", 1)[-1]
        for k in keys
    ]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


def member_name(values: dict[str, Any], result_fingerprint: str, masked: bool = True) -> str:
    """``k=10,lr=0.001-3f9a1c``: the varying values (keys sorted; a secret masked, unless
    ``masked`` is false), then a short hash of the member's result fingerprint and exact values.
    Resource keys outside the sweep are not in it, so a resubmission with a longer time limit
    finds the same directories."""
    short = labels(sorted(values))
    readable = ",".join(
        f"{short[k]}={_safe(_in_name(k, values[k], masked), VALUE_CHARS)}" for k in sorted(values)
    )
    exact = json.dumps([result_fingerprint, values], sort_keys=True, default=str)
    return (
        f"{readable[:READABLE_CHARS].rstrip(',=')}-"
        f"{hashlib.sha256(exact.encode()).hexdigest()[:HASH_CHARS]}"
    )


def _in_name(key: str, value: object, masked: bool) -> str:
    if not masked:
        return show(value)
    return show(shown_value(key, value)).replace(masking.MASK, MASKED_IN_NAME)


def _member_dirs(cfg: Config, sweep_paths: rundir.RunPaths, name: str) -> Config:
    d = cfg.to_dict()
    d["run"]["dir"] = sweep_paths.member(name)
    # Members must never share a checkpoint dir (they would resume each other).
    if d["checkpoint"]["dir"]:
        d["checkpoint"]["dir"] = d["checkpoint"]["dir"].rstrip("/") + "/" + name
    return cfgmod.from_dict(d)


def report_invalid(failures: list[tuple[str, str]], total: int) -> None:
    messages = {m for _, m in failures}
    if len(failures) == total and len(messages) == 1 and total > 1:
        raise UserError(f"every member of the sweep fails: {failures[0][1]}")
    lines = [f"member {label}: {msg}" for label, msg in failures[:20]]
    more = f"\n  ... and {len(failures) - 20} more" if len(failures) > 20 else ""
    raise UserError(
        f"{len(failures)} of {total} sweep members are invalid (nothing was submitted):\n  "
        + "\n  ".join(lines)
        + more
    )


def _check_distinct(axes: list[Axis], members: list[Member]) -> None:
    """One text listed twice, or two texts of one axis that resolve to one value (0.1 and 1e-1),
    would make twin members."""
    for a in axes:
        twice = next((t for i, t in enumerate(a.texts) if t in a.texts[:i]), None)
        if twice is not None:
            raise UserError(
                f"--sweep {a.key}={','.join(a.texts)}: {twice} is listed twice; "
                "list each value once"
            )
    for a in axes:
        resolved: dict[str, str] = {}
        for m in members:
            text = next(o for o in m.overrides if o.startswith(a.key + "=")).partition("=")[2]
            value = json.dumps(m.values[a.key], sort_keys=True, default=str)
            first = resolved.setdefault(value, text)
            if first != text:
                raise UserError(
                    f"--sweep {a.key}: {first} and {text} are the same "
                    f"value ({show(m.values[a.key])}); list each value once"
                )


def with_arg(args: list[str] | tuple[str, ...], name: str, value: str) -> list[str]:
    """``args`` with the script argument ``name`` set to ``value`` (``--lr 0.1``, ``--lr=0.1``,
    ``lr=0.1``); appended where ``args`` lacks it."""
    out = list(args)
    for i, a in enumerate(out):
        if a.startswith(name + "="):
            out[i] = f"{name}={value}"
            return out
        if name.startswith("-") and a == name and i + 1 < len(out):
            out[i + 1] = value
            return out
    return out + ([name, value] if name.startswith("-") else [f"{name}={value}"])


def _load(
    config_path: str | None,
    overrides: list[str],
    script: str | None,
    script_args: list[str] | tuple[str, ...],
    arg_values: list[tuple[str, str]],
) -> Config:
    """One member's config: the base config (or the script's), its overrides and arguments."""
    if not script:
        if arg_values:
            raise UserError(
                f"--sweep {arg_values[0][0]}=...: an arg: axis sweeps a script's own argument; "
                "give the script with --script PATH"
            )
        return cfgmod.load(config_path, overrides)
    args = list(script_args)
    for key, text in arg_values:
        args = with_arg(args, key[len(ARG) :], text)
    return saved_config.load_script(config_path, overrides, script, args)


def expand(
    config_path: str | None,
    overrides: list[str] | tuple[str, ...],
    sweep_args: list[str],
    script: str | None = None,
    script_args: list[str] | tuple[str, ...] = (),
    taken: Callable[[rundir.RunPaths], Collection[str]] | None = None,
) -> Sweep:
    """Every member of the sweep, validated; raises one UserError listing every invalid member.
    ``script``, ``script_args``: a script of the user's own and its base arguments. ``taken``:
    the member names the sweep dir's index holds (``sweeps.index.names``); a member held there
    under its name with its values unmasked keeps that name."""
    axes = parse(sweep_args, overrides)
    members: list[Member] = []
    unmasked: dict[str, str] = {}  # a member's name -> its name with its values unmasked
    failures: list[tuple[str, str]] = []
    combos = list(itertools.product(*[a.texts for a in axes]))
    for combo in combos:
        member_overrides = tuple(f"{a.key}={t}" for a, t in zip(axes, combo))
        keyed = [(a.key, t) for a, t in zip(axes, combo)]
        try:
            cfg = _load(
                config_path,
                [*overrides, *(f"{k}={t}" for k, t in keyed if not k.startswith(ARG))],
                script,
                script_args,
                [(k, t) for k, t in keyed if k.startswith(ARG)],
            )
        except UserError as exc:
            failures.append((",".join(f"{a.key}={t}" for a, t in zip(axes, combo)), str(exc)))
            continue
        d = cfg.to_dict()
        values = {k: t if k.startswith(ARG) else lookup(d, k) for k, t in keyed}
        result = fingerprint.result_fingerprint(d)
        name = member_name(values, result)
        unmasked[name] = member_name(values, result, masked=False)
        members.append(Member(name, values, member_overrides, cfg))
    if failures:
        report_invalid(failures, len(combos))
    _check_distinct(axes, members)
    sweep_paths = rundir.RunPaths(members[0].config.run.dir)
    folded: dict[str, str] = {}
    for m in members:
        # A clash needs equal readable parts and equal 24-bit hashes, and is never silent.
        if m.name.casefold() in folded:
            other = folded[m.name.casefold()]
            raise UserError(
                f"sweep members {other!r} and {m.name!r} would "
                "share a directory; shorten or reorder the values"
            )
        folded[m.name.casefold()] = m.name
    base = members[0].config.to_dict()
    for a in axes:
        _drop(base, a.key)
    if script:
        base["script"]["args"] = list(script_args)  # each member's are its own
    # The index is read only where a name has a secret masked (the others never changed).
    renamed = {n: u for n, u in unmasked.items() if n != u}
    held = set(taken(sweep_paths)) if taken is not None and renamed else set()
    named = [
        renamed[m.name] if m.name in renamed and renamed[m.name] in held else m.name
        for m in members
    ]
    members = [
        Member(name, m.values, m.overrides, _member_dirs(m.config, sweep_paths, name))
        for name, m in zip(named, members)
    ]
    return Sweep(sweep_paths, [a.key for a in axes], members, base)
